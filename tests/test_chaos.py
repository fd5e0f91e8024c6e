"""`omni-mesh bench chaos` as a user runs it, shortened: replicas SIGKILLed under checked load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from omni_mesh.bench import chaos
from omni_mesh.connectors.shm.segments import (
    ProcessIdentity,
    create_segment,
    new_token,
    segment_name,
    unlink_segment,
)


def test_a_short_chaos_soak_keeps_every_invariant() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omni_mesh.cli", "bench", "chaos", "--duration", "20", "--kill-every", "2", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    result = json.loads(done.stdout)
    assert chaos.broken(result) == [] and done.returncode == 0, chaos.report(result)
    assert result["wrong"] == 0 and result["late"] == 0 and result["leftover_segments"] == []
    assert result["kills"] >= 3, result["kill_log"]
    assert result["succeeded"] >= 0.8 * result["sent"] > 0, result["failed"]
    assert result["most_segments_held"] > 0  # the mesh did make segments: "none left" means something


def test_the_soak_checks_outputs_and_segments_for_real() -> None:
    """The invariants are not vacuous: a wrong stage order and a leftover segment are caught."""
    right = chaos.expected_output(10, 4, ["a", "b"], {"a": 1, "b": 2})
    assert right["head"] == [44.0, 48.0, 52.0] and right["sum"] == 44 + 48 + 52 + 56  # 4 (10 + j) + 4
    assert chaos.expected_output(10, 4, ["b", "a"], {"a": 1, "b": 2})["head"] != right["head"]
    name = segment_name(ProcessIdentity.current(), new_token())
    create_segment(name, 4096, populate=False).close()
    try:
        assert chaos.leftover_segments({os.getpid()}) == [name]
        assert chaos.leftover_segments({os.getpid() + 1}) == []
    finally:
        unlink_segment(name)
