"""Suite-wide set-up.

The shared helpers live in tests/support/ (a package: `from support.meshkit import ...`).

Mooncake's native library crashes the process when it loads after openYuanrong's yr.datasystem; the
suite exercises both in one pytest process, so it loads yr.datasystem only through
`omni_mesh.connectors.backends.load`, which keeps the safe order (the rule lives there alone).

The modules that need a datasystem worker share one (`datasystem_worker`, tests/support/shared_worker.py):
they run one after another, and the worker stops after the last test that names the fixture.

`no_segment_left` fails a test that leaves this run's shared-memory segments behind; the modules
that make segments opt into it (`pytestmark = pytest.mark.usefixtures("no_segment_left")`). Each
pytest process keeps its segments (and its children's) in a directory of its own (`SEGMENT_DIR`).
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# Before anything imports omni_mesh (shm_segments reads it once): this pytest process and every process
# it starts keep their segments in a directory of their own on /dev/shm's filesystem (the same
# shm_domain). A get by key flags every pool it can see, and reapers and leak checks list what they
# see, so two xdist workers sharing /dev/shm would disturb each other's counts.
SEGMENT_DIR = Path(tempfile.mkdtemp(prefix="omni-mesh-tests-", dir="/dev/shm"))
os.environ["OMNI_MESH_SHM_DIR"] = str(SEGMENT_DIR)

import pytest  # noqa: E402
from support.shared_worker import SharedWorker  # noqa: E402

# ---------------------------------------------------------------------- one datasystem worker

WORKER_FIXTURE = "datasystem_worker"
_SHARED_WORKER = SharedWorker()
_LAST_WORKER_USER: list[pytest.Item] = []  # the last test of the last module that uses the worker


@pytest.fixture(scope="session")
def datasystem_worker() -> Iterator[SharedWorker]:
    """The session's shared worker: `datasystem_worker.get()` starts it on first use."""
    yield _SHARED_WORKER
    _SHARED_WORKER.stop()


def _uses_worker(item: pytest.Item) -> bool:
    return WORKER_FIXTURE in getattr(item, "fixturenames", ())


# ---------------------------------------------------------------------- the order files run in

#: The files that take longest, longest first (a two-worker run on the 2-vCPU VM, 2026-12-03, a cold
#: Docker cache: 263, 155, 77, 71, 58, 52, 47, 46, 45, 45, 43 s of 1238; re-ranked 2026-12-04 from the
#: slowest tests of a warm-cache run, the new files of issues 27-30 among them; re-ranked 2026-12-06 from the
#: per-file sums of `--durations=0` with the engine, media, serve and first-hour files). `make test` hands
#: whole files to two workers in collection order (`--dist loadfile --no-loadscope-reorder`): started
#: first, they run beside the many short files instead of after them (xdist's own order, most tests
#: first, left the one-test Docker file to run alone at the end).
LONGEST_FIRST = (
    "test_engines_qwen2_5_omni.py",
    "test_bench.py",
    "test_scaling.py",
    "test_engines_media_mesh.py",
    "test_docker_compose.py",
    "test_bench_engines.py",
    "test_compose.py",
    "test_control_reconnect.py",
    "test_first_hour.py",
    "test_large_requests.py",
    "test_shared_memory.py",
    "test_chaos.py",
    "test_mesh_e2e.py",
    "test_connector_contract.py",
    "test_serve.py",
    "test_engines_batching.py",
    "test_thinker_batch.py",
    "test_bounded_answers.py",
    "test_mooncake.py",
    "test_control_plane_security.py",
    "test_autoscale_oscillation.py",
    "test_vllm_omni_example.py",
    "test_mixed_connectors_e2e.py",
    "test_autoscale_drain.py",
    "test_rest_front_door.py",
    "test_engines_qwen3_omni.py",
    "test_multihost.py",
    "test_listening_sockets.py",
    "test_prefill_mesh.py",
    "test_launcher_front_door.py",
    "test_autoscale_faults.py",
)


def _file_rank(item: pytest.Item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (a stable sort: each file's tests keep their order). Then the modules
    that use the worker one after another, from where the first of them stands, so it idles through
    no other module; remember their last test (after its teardown, every module fixture built on the
    worker is gone too)."""
    items.sort(key=_file_rank)
    modules = {item.path for item in items if _uses_worker(item)}
    if not modules:
        return
    first = next(i for i, item in enumerate(items) if item.path in modules)
    users = [item for item in items if item.path in modules]
    others = [item for item in items if item.path not in modules]
    items[:] = others[:first] + users + others[first:]
    _LAST_WORKER_USER[:] = users[-1:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)  # the item's fixtures, and its module's when it is the module's last, are gone
    finally:
        if _LAST_WORKER_USER and item is _LAST_WORKER_USER[0]:
            _SHARED_WORKER.stop()


# ---------------------------------------------------------------------- shared memory left behind


@pytest.fixture
def no_segment_left() -> Iterator[None]:
    yield
    from support.shm_kit import our_segments  # here, not at the top: it imports torch and the connectors

    gc.collect()
    assert our_segments() == {}, "a test left shared-memory segments behind"


def _segments_here() -> set[str]:
    return {p.name for p in SEGMENT_DIR.iterdir()} if SEGMENT_DIR.is_dir() else set()


@pytest.fixture(scope="module", autouse=True)
def no_segment_left_by_the_module() -> Iterator[None]:
    """Every test file ends with no new segment in this process's directory (a stage, peer or connector
    of its own left one): an error of the file's last test, named, instead of a line at the end of the
    run. Torn down after the module's other fixtures; processes they stopped get a moment to unlink."""
    before = _segments_here()
    yield
    gc.collect()
    deadline = time.monotonic() + 5.0
    while (left := _segments_here() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
        gc.collect()
    assert not left, f"this test file left shared-memory segments in {SEGMENT_DIR}: {sorted(left)}"


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove this process's segment directory; what is still in it is a leak no test caught."""
    left = sorted(p.name for p in SEGMENT_DIR.iterdir()) if SEGMENT_DIR.is_dir() else []
    shutil.rmtree(SEGMENT_DIR, ignore_errors=True)
    if left:
        print(f"\nerror: segments left in {SEGMENT_DIR} at the end of the run: {left}", file=sys.stderr)


@pytest.fixture
def keys() -> Iterator[object]:
    """This process's mesh keys while the test runs (connectors read them when they are built): a
    fresh pair, reset after it. Modules that need another kind of `keys` define their own."""
    from omni_mesh.security import MeshKeys, reset_mesh_keys, set_mesh_keys

    mesh = MeshKeys.generate()
    set_mesh_keys(mesh)
    yield mesh
    reset_mesh_keys()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module's tests (the parts' equality checks: the order of float sums
    fixed, and no oversubscription beside the other worker), restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
