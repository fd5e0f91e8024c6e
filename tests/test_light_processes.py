"""Light processes (issue 27): torch is loaded only by a process that holds a tensor.

The coordinator, the launcher and stages whose handlers hold no tensor never load it; neither do
`validate`, `status` and `export`. Checked in the real processes: /proc/PID/maps of each process of a
running mesh (a loaded torch maps libtorch), `python -X importtime` of the CLI commands. Each check
has its positive control (a stage or a command that does load torch), so it can fail.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.meshkit import Mesh, running_mesh, write_topology

from omni_mesh.launcher import Launcher
from omni_mesh.ports import free_port
from omni_mesh.procinfo import descendants
from omni_mesh.topology import load_topology
from omni_mesh.topology.handler_source import binds_handler

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "compose" / "omni-demo.yaml"
NOOP = ROOT / "compose" / "noop-pipeline.yaml"
LIGHT_HANDLERS = Path(__file__).parent / "support" / "light_handlers.py"
TOPOLOGY = {
    "name": "light",
    "stages": [
        {"stage_id": 0, "name": "a", "handler": "light_handlers:numbers"},
        {"stage_id": 1, "name": "b", "handler": "light_handlers:with_torch", "engine_input_source": [0]},
        {"stage_id": 2, "name": "c", "handler": "light_handlers:summary", "engine_input_source": [1]},
    ],
}
BIG_TEXT = "light " * 120_000  # 720 KB: over the work message's inline limit, so it goes through ingress


def torch_by_role(mesh: Mesh) -> dict[str, bool]:
    """{role: whether its process maps libtorch} for every process of the mesh: "launcher",
    "coordinator", and each replica by its stage name."""
    roles = {}
    for pid in [mesh.process.pid, *sorted(descendants(mesh.process.pid))]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            maps = Path(f"/proc/{pid}/maps").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone (a helper process that ended between the listing and the read)
        if pid == mesh.process.pid:
            role = "launcher"
        elif "coordinator" in argv:
            role = "coordinator"
        elif "--stage" in argv:
            role = argv[argv.index("--stage") + 1]
        else:
            continue
        roles[role] = "libtorch" in maps
    return roles


@pytest.fixture(scope="module")
def light_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    directory = tmp_path_factory.mktemp("light")
    shutil.copyfile(LIGHT_HANDLERS, directory / LIGHT_HANDLERS.name)
    with running_mesh(directory, TOPOLOGY) as mesh:
        yield mesh


def test_only_the_stage_whose_handler_uses_torch_loads_it(light_mesh: Mesh) -> None:
    """Launcher, coordinator (its ingress connector and the final output's JSON included) and the
    stages moving numpy arrays, bytes and text through shared memory stay without torch; the stage
    whose handler imports torch maps it (the check sees a loaded torch)."""
    assert torch_by_role(light_mesh) == {
        "launcher": False,
        "coordinator": False,
        "a": False,
        "b": False,
        "c": False,
    }
    answer = light_mesh.ok({"text": BIG_TEXT, "n": 100_000})["outputs"]
    assert answer == {
        "sha": hashlib.sha256(BIG_TEXT.encode()).hexdigest(),
        "sum": 4999950000.0,
        "blob_bytes": 100_000,
    }
    assert torch_by_role(light_mesh) == {
        "launcher": False,
        "coordinator": False,
        "a": False,
        "b": True,
        "c": False,
    }


def test_the_demo_keeps_torch_to_its_stages(tmp_path: Path) -> None:
    """compose/omni-demo.yaml: its handlers use torch, so its replicas load it; the launcher (which
    checks the handlers before starting anything) and the coordinator do not, before and after a
    request (its answer is text and base64 audio)."""
    stages = {"thinker": True, "talker": True, "code2wav": True}
    with running_mesh(tmp_path, DEMO) as mesh:
        assert torch_by_role(mesh) == {"launcher": False, "coordinator": False, **stages}
        answer = mesh.ok({"prompt": "Hello, light mesh"})["outputs"]
        assert answer["text"] and answer["audio_wav_base64"] and answer["duration_s"] > 0, sorted(answer)
        assert torch_by_role(mesh) == {"launcher": False, "coordinator": False, **stages}


def imported_modules(*argv: str, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime -m omni_mesh ARGV`: its result, and every module it imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "omni_mesh", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    assert len(lines) > 50, result.stderr[-2000:]  # the importtime report is there
    modules = {line.rsplit("|", 1)[1].strip() for line in lines[1:]}  # the first line is the table's head
    return result, modules


def test_validate_status_and_export_do_not_import_torch(light_mesh: Mesh, tmp_path: Path) -> None:
    commands = [
        ("validate", str(NOOP)),  # its handlers are imported, and hold no tensor
        ("validate", "--no-import", str(DEMO)),
        ("validate", "--json", "--no-import", str(DEMO)),
        ("export", "compose", str(DEMO), "-o", str(tmp_path / "compose.yml")),
        ("export", "k8s", str(DEMO), "-o", str(tmp_path / "k8s.yml")),
        ("status", light_mesh.url),
    ]
    for argv in commands:
        result, modules = imported_modules(*argv)
        assert result.returncode == 0, (argv, result.stdout[-2000:], result.stderr[-2000:])
        assert "torch" not in modules, f"omni-mesh {' '.join(argv)} imported torch"
        assert "omni_mesh.cli.entry" in modules
    assert (
        "services:" in (tmp_path / "compose.yml").read_text()
        and "kind:" in (tmp_path / "k8s.yml").read_text()
    )
    # The control: validate imports the demo's handlers, which import torch.
    result, modules = imported_modules("validate", str(DEMO))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch" in modules and "services.omni_demo.stages" in modules


_LAZY_CODEC = r"""
import ctypes, sys
import numpy as np
from omni_mesh import codec

def same(a, b):
    torch = sys.modules.get("torch")  # not imported here: comparing plain values must not load it
    if torch is not None and isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b

# Plain values and numpy arrays: no torch, in a process that never loaded it.
plain = {"a": [1, 2.5, "x", None, True], "t": (1, (2, 3)), "s": {1, 2}, "b": b"x" * 2000, "n": np.arange(6.0).reshape(2, 3)}
assert same(plain, codec.decode(codec.encode(plain)))
assert codec.plan_flat({"n": np.arange(3)}) is None
assert "torch" not in sys.modules, "plain values loaded torch"

# A frame from another process naming tensors: decoding it imports torch.
received = codec.decode(sys.stdin.buffer.read())
assert "torch" in sys.modules
import torch
assert same(received, {"x": torch.arange(5, dtype=torch.int16), "h": torch.ones(2, 3, dtype=torch.bfloat16)}), received

flat = {"x": torch.arange(70_000, dtype=torch.float32), "y": torch.ones(3, 4, dtype=torch.bfloat16), "z": torch.zeros(0)}
nested = {
    "list": [torch.tensor(3.5), torch.arange(12).view(3, 4).t()],  # 0-d, non-contiguous
    "tuple": (torch.ones(2, dtype=torch.bool), np.arange(4)),
    "cplx": torch.tensor([1 + 2j]).conj(),
    "meta": "text",
}
expected_nested = {**nested, "cplx": torch.tensor([1 - 2j])}
paths = 0
for payload, expected in ((flat, flat), (nested, expected_nested)):
    assert same(expected, codec.decode(codec.encode(payload))); paths += 1            # encode / write_into
    assert same(expected, codec.decode(codec.encode(payload), copy=True)); paths += 1  # copies
    frame = codec.plan(payload)
    whole = frame.to_bytes()
    assert same(expected, codec.decode(whole)) and same(expected, codec.decode(whole)); paths += 1  # bytes (cached head)
    header, leaves, lengths = codec.split(payload)
    assert same(expected, codec.decode_parts(header, codec.leaf_buffers(leaves, lengths))); paths += 1
    region = bytearray(frame.nbytes)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    for piece in frame.pieces():
        piece.write_at(base + piece.offset)
    assert same(expected, codec.decode(region)); paths += 1
    region = bytearray(frame.nbytes)
    frame.write_at(ctypes.addressof(ctypes.c_char.from_buffer(region)))
    assert same(expected, codec.decode(region)); paths += 1
    device = codec.DeviceLeaves(host_min_bytes=1)
    header, leaves, lengths = codec.split(payload, device=device)
    received = [t.reshape(-1).view(torch.uint8) for t in device.tensors]
    assert device.tensors
    whole = bytearray(codec.FramePlan(header, leaves, lengths).nbytes)
    codec.FramePlan(header, leaves, lengths).write_into(whole)
    assert same(expected, codec.decode(whole, device_buffers=received)); paths += 1
flat_plan = codec.plan_flat(flat)
assert flat_plan is not None
region = bytearray(flat_plan.nbytes)
flat_plan.write_into(region)
assert same(flat, codec.decode(region)); paths += 1
print(paths)
"""


def test_tensors_round_trip_through_every_codec_path_after_a_lazy_import() -> None:
    """In a process that has not imported torch: plain values and arrays leave it unloaded; a frame
    naming tensors loads it; then tensors (dtypes, 0-d, empty, non-contiguous, conjugate) round-trip
    through every encode and decode path: whole frame, copies, bytes, parts, pieces, raw address,
    device leaves, the cached flat plan."""
    import torch

    from omni_mesh import codec

    frame = bytes(
        codec.encode({"x": torch.arange(5, dtype=torch.int16), "h": torch.ones(2, 3, dtype=torch.bfloat16)})
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", _LAZY_CODEC], input=frame, capture_output=True, timeout=120, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert result.stdout.decode().split() == ["15"]


def test_the_launcher_sees_handlers_in_their_source_without_running_them(tmp_path: Path) -> None:
    """binds_handler finds a handler's module as import would, without running a package __init__
    (this one would fail), and reads its top-level names; what it cannot see is left to an import."""
    package = tmp_path / "pkg_light"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('a package __init__ ran')\n")
    (package / "handlers.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import json as alias_of_json\n"
        "async def step(inputs, ctx): return inputs\n"
        "class Built: pass\n"
        "assigned = step\n"
        "typed: int\n"
        "try:\n    from os import sep as in_try\nexcept ImportError:\n    in_except = None\n"
        "if TYPE_CHECKING:\n    from os import getcwd as only_for_types\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        for name in ("step", "Built", "assigned", "alias_of_json", "in_try", "in_except"):
            assert binds_handler("pkg_light.handlers", name), name
        for name in ("nope", "typed", "only_for_types"):
            assert not binds_handler("pkg_light.handlers", name), name
        assert not binds_handler("pkg_light.missing", "step") and not binds_handler("no_such_top_level", "x")
        assert "pkg_light" not in sys.modules  # nothing ran
    finally:
        sys.path.remove(str(tmp_path))
    # A package an editable install maps with a finder of its own (not on sys.path): found the same way.
    finder = _MappedPackage("pkg_light", package)
    sys.meta_path.insert(0, finder)
    try:
        assert binds_handler("pkg_light.handlers", "step") and not binds_handler("pkg_light.handlers", "nope")
        assert "pkg_light" not in sys.modules
    finally:
        sys.meta_path.remove(finder)


class _MappedPackage:
    """A meta path finder mapping one top-level package to a directory, as setuptools' editable
    installs do (`__editable___*_finder`)."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name, self.directory = name, directory

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != self.name:
            return None
        init = self.directory / "__init__.py"
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(self.directory)]
        )


def test_up_still_names_a_handler_its_module_lacks_and_starts_nothing(tmp_path: Path) -> None:
    """A name the source does not bind falls back to importing the module, whose error `up` reports."""
    shutil.copyfile(LIGHT_HANDLERS, tmp_path / LIGHT_HANDLERS.name)
    topology = {"name": "typo", "stages": [{"stage_id": 0, "name": "a", "handler": "light_handlers:numbrs"}]}
    path = write_topology(tmp_path, topology, handlers=False)
    with pytest.raises(ValueError) as caught:
        Launcher(load_topology(path), port=free_port()).check_handlers()
    assert str(caught.value) == (
        "stage 'a': cannot load handler 'light_handlers:numbrs': module 'light_handlers' has no attribute "
        "'numbrs' (nothing started)"
    )
    Launcher(
        load_topology(write_topology(tmp_path, TOPOLOGY, handlers=False)), port=free_port()
    ).check_handlers()
