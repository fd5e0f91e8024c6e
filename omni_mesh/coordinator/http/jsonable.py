"""Turn stage outputs into JSON: tensors and arrays become nested lists, bytes become base64.

Sets become lists (sorted where their members allow it, so answers are stable), slices become
{"start", "stop", "step"}, PIL images become {"mode", "size", "png_base64"}.
"""

from __future__ import annotations

import base64
import io
import math
import sys
from typing import Any

import numpy as np

from omni_mesh.lazy_torch import tensor_class


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        try:
            members = sorted(value)
        except TypeError:  # members of mixed types: any order is as good as another
            members = list(value)
        return [jsonable(v) for v in members]
    if isinstance(value, slice):
        return {"start": jsonable(value.start), "stop": jsonable(value.stop), "step": jsonable(value.step)}
    if isinstance(value, tensor_class()):  # not an import: a process without torch holds no tensor
        if value.dtype.is_floating_point and value.element_size() == 1:
            value = value.float()  # float8 has no Python conversion of its own
        return jsonable(value.tolist())
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, complex):
        return [jsonable(value.real), jsonable(value.imag)]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if _is_image(value):
        png = io.BytesIO()
        value.save(png, format="PNG")
        return {"mode": value.mode, "size": list(value.size), "png_base64": base64.b64encode(png.getvalue()).decode()}
    return value


def _is_image(value: Any) -> bool:
    """A PIL image, without importing Pillow where no stage output could hold one."""
    image_module = sys.modules.get("PIL.Image")
    return image_module is not None and isinstance(value, image_module.Image)
