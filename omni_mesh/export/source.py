"""Where a topology lives in the image that runs it.

The image (services/Dockerfile) is built from a context directory and copies the project to its
WORKDIR, /app: a topology at CONTEXT/compose/demo.yaml runs as /app/compose/demo.yaml in every
container. The export needs that path, the Dockerfile (its build arguments become the compose file's),
and the paths of both relative to where the generated file goes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from omni_mesh.topology import Topology

IMAGE_WORKDIR = PurePosixPath("/app")
DOCKERFILE = PurePosixPath("services/Dockerfile")  # relative to the build context
#: The directories services/Dockerfile copies into /app: a topology elsewhere is not in the image.
IMAGE_DIRS = ("compose", "services", "omni_mesh")

_ARG = re.compile(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(.*))?$")


class ExportError(ValueError):
    """The topology cannot be exported as asked; the message says what to change."""


@dataclass(frozen=True)
class ImageSource:
    context: Path  # the build context: the directory that holds services/Dockerfile
    topology: Path  # the topology file, resolved

    @classmethod
    def find(cls, topology: Topology, context: str | os.PathLike | None = None) -> ImageSource:
        """The build context: `context`, or the nearest directory above the topology with the Dockerfile."""
        if topology.path is None:
            raise ExportError("the topology has no file: export a topology loaded from a file")
        if context is not None:
            root = Path(context).resolve()
            if not (root / DOCKERFILE).is_file():
                raise ExportError(f"--context {context}: no {DOCKERFILE} there (the image is built from it)")
        else:
            root = next((d for d in topology.path.parents if (d / DOCKERFILE).is_file()), None)
            if root is None:
                raise ExportError(
                    f"{topology.path}: no {DOCKERFILE} in any directory above it; pass --context DIR, the "
                    "directory the image is built from"
                )
        source = cls(root, topology.path)
        first = source.relative.parts[0] if source.relative.parts else ""
        if first not in IMAGE_DIRS:
            raise ExportError(
                f"{topology.path}: the image copies only {', '.join(IMAGE_DIRS)}/ of {root} into "
                f"{IMAGE_WORKDIR}; move the topology under {root / 'compose'}"
            )
        return source

    @property
    def relative(self) -> PurePosixPath:
        try:
            return PurePosixPath(self.topology.relative_to(self.context).as_posix())
        except ValueError:
            raise ExportError(
                f"{self.topology}: not inside the build context {self.context}; the image holds only "
                "what is under it"
            ) from None

    @property
    def in_image(self) -> str:
        """The topology's path inside every container."""
        return str(IMAGE_WORKDIR / self.relative)

    def context_from(self, directory: Path) -> str:
        """The build context as a compose file in `directory` names it (compose resolves it from there)."""
        return Path(os.path.relpath(self.context, directory.resolve())).as_posix()

    def shown(self, path: Path) -> str:
        """`path` as the regenerating command shows it: relative to the context when under it."""
        resolved = path.resolve()
        try:
            return resolved.relative_to(self.context).as_posix()
        except ValueError:
            return str(path)

    def build_args(self) -> dict[str, str]:
        """The Dockerfile's `ARG NAME=default` lines, in order: what a compose file passes through."""
        args: dict[str, str] = {}
        for line in (self.context / DOCKERFILE).read_text().splitlines():
            match = _ARG.match(line.strip())
            if match:
                args[match.group(1)] = match.group(2) or ""
        return args
