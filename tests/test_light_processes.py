"""Light processes (issue 27): torch is loaded only by a process that holds a tensor.

The coordinator, the launcher and stages whose handlers hold no tensor never load it; neither do
`validate`, `status` and `export`. Checked in the real processes: /proc/PID/maps of each process of a
running mesh (a loaded torch maps libtorch), `python -X importtime` of the CLI commands. Each check
has its positive control (a stage or a command that does load torch), so it can fail.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.meshkit import Mesh, running_mesh

from omni_mesh.procinfo import descendants

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
