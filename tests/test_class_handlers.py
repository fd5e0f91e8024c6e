"""A handler may be a class built once per replica from its stage's settings (`from_stage`), with an
async `warm()` the replica awaits before it reports ready: no request ever finds it cold."""

from __future__ import annotations

from pathlib import Path

from support.meshkit import running_mesh


def test_a_class_handler_is_built_from_its_stage_and_warmed_before_ready(tmp_path: Path) -> None:
    topology = {
        "name": "warmed",
        "stages": [
            {"stage_id": 0, "name": "a", "handler": "mesh_handlers:Warmed", "engine_args": {"model": "m"}},
        ],
    }
    with running_mesh(tmp_path, topology) as mesh:
        outputs = mesh.ok({"x": 1})["outputs"]
    assert outputs == {"warmed": True, "engine_args": {"model": "m"}}
