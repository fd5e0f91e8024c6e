"""The handler contract (omni_mesh.handlers): handlers written as users write them today (functions,
async generators, plain classes defining hooks by name) keep working; each hook is found and checked once
at load, and a hook that cannot be called as the runtime calls it stops the replica's start, naming the
stage and the hook, instead of failing requests later."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.meshkit import OMNI_MESH, running_mesh, wait_for, write_topology

from omni_mesh.handlers import BuiltFromStage, HandlerHooks, hooks_of
from omni_mesh.ports import free_port

HOOK_HANDLERS = Path(__file__).parent / "support" / "hook_handlers.py"


async def plain(inputs: dict, ctx: Any) -> dict:
    return inputs


async def streaming(inputs: dict, ctx: Any):  # noqa: ANN201 - an async generator, as users write one
    yield inputs


class Named:
    """Every hook by name, no base class."""

    def __init__(self) -> None:
        self.warmed = False

    async def warm(self) -> None:
        self.warmed = True

    def client_output(self, output: dict) -> dict:
        return {"client": output}

    def counters(self) -> dict[str, int]:
        return {"calls_total": 3}

    async def __call__(self, inputs: dict, ctx: Any) -> dict:
        return inputs


class Declared(HandlerHooks):
    """Hooks declared by subclassing the contract's base (as the engines do): only counters overridden."""

    def counters(self) -> dict[str, int | float]:
        return {"declared_total": 1}

    async def __call__(self, inputs: dict, ctx: Any) -> dict:
        return inputs


@pytest.mark.parametrize(
    "handler", [plain, streaming, lambda inputs, ctx: inputs], ids=["async", "asyncgen", "sync"]
)
async def test_a_handler_without_hooks_gets_the_defaults(handler: Any) -> None:
    hooks = hooks_of(handler, "stage 'a'")
    await hooks.warm()
    output = {"x": 1}
    assert hooks.client_output(output) is output and hooks.counters() == {}


async def test_a_plain_class_defining_each_hook_by_name_has_them_called() -> None:
    handler = Named()
    hooks = hooks_of(handler, "stage 'a'")
    await hooks.warm()
    assert handler.warmed
    assert hooks.client_output({"x": 1}) == {"client": {"x": 1}} and hooks.counters() == {"calls_total": 3}


def test_hooks_written_as_static_methods_or_with_optional_arguments_are_taken() -> None:
    class Static:
        @staticmethod
        def client_output(chunk: dict) -> dict:  # as the engines' thinker had it
            return {key: value for key, value in chunk.items() if key != "talker"}

        def counters(self, *, prefix: str = "static_") -> dict[str, int]:
            return {f"{prefix}total": 1}

    hooks = hooks_of(Static(), "stage 'a'")
    assert hooks.client_output({"text": "hi", "talker": 1}) == {"text": "hi"}
    assert hooks.counters() == {"static_total": 1}


async def test_a_subclass_of_the_hooks_base_is_its_own_hooks_with_the_defaults_it_does_not_override() -> None:
    handler = Declared()
    hooks = hooks_of(handler, "stage 'a'")
    await hooks.warm()
    assert hooks is handler and hooks.counters() == {"declared_total": 1} and hooks.client_output(7) == 7


def test_from_stage_is_what_marks_a_class_built_per_replica() -> None:
    assert isinstance(Named, BuiltFromStage) is False
    assert isinstance(
        type("WithFromStage", (), {"from_stage": classmethod(lambda cls, options: cls())}), BuiltFromStage
    )


class SyncWarm:
    def warm(self) -> None: ...


class NoArgOutput:
    def client_output(self) -> dict:
        return {}


class CountersValue:
    counters = {"calls_total": 1}  # a dict, not a method


class SyncWarmOverride(HandlerHooks):
    def warm(self) -> None:  # type: ignore[override]
        ...


@pytest.mark.parametrize(
    ("handler", "hook", "problem"),
    [
        (SyncWarm(), "warm", "is not a coroutine function (async def)"),
        (SyncWarmOverride(), "warm", "is not a coroutine function (async def)"),
        (NoArgOutput(), "client_output", "cannot be called so (too many positional arguments)"),
        (CountersValue(), "counters", "is a dict, not a method"),
    ],
    ids=["sync-warm", "sync-warm-override", "client-output-without-argument", "counters-not-callable"],
)
def test_a_hook_that_cannot_be_called_as_the_runtime_calls_it_is_refused_naming_stage_and_hook(
    handler: object, hook: str, problem: str
) -> None:
    with pytest.raises(TypeError) as refused:
        hooks_of(handler, "stage 'talker'")
    message = str(refused.value)
    assert message.startswith(
        f"stage 'talker': handler {type(handler).__qualname__} has a `{hook}` that {problem}"
    )
    assert f"a handler's {hook} hook is `" in message, message


def test_todays_handlers_run_in_a_mesh_with_their_hooks(tmp_path: Path) -> None:
    """A class with every hook by name (final and feeding on), an async generator, an async function
    reading a stream, a sync function: as users write them, with no import of omni_mesh."""
    shutil.copyfile(HOOK_HANDLERS, tmp_path / HOOK_HANDLERS.name)
    topology = {
        "name": "hooks",
        "stages": [
            {
                "stage_id": 0,
                "name": "hooked",
                "handler": "hook_handlers:Hooked",
                "engine_args": {"model": "m1"},
                "final_output": True,
            },
            {"stage_id": 1, "name": "gen", "handler": "hook_handlers:count_up", "engine_input_source": [0]},
            {"stage_id": 2, "name": "total", "handler": "hook_handlers:total", "engine_input_source": [1]},
            {
                "stage_id": 3,
                "name": "plain",
                "handler": "hook_handlers:echo",
                "engine_input_source": [2],
                "final_output": True,
            },
        ],
    }
    with running_mesh(tmp_path, topology) as mesh:
        outputs = mesh.ok({"n": 4}, params={"p": 1})["outputs"]
        # client_output kept the secret out of the client's answer, and downstream got it all the same
        assert outputs["hooked"] == {"warmed": True, "tag": "m1", "n": 4}
        assert outputs["plain"] == {
            "echo": {"sum": 6, "secrets": ["for-b-4"], "same_request": True, "remaining_s": True},
            "params": {"p": 1},
            "replica": True,
        }

        def counted() -> dict | None:
            replica = mesh.replica("hooked")
            return replica if replica and replica.get("counters", {}).get("hooked_calls_total") == 1 else None

        wait_for(counted, 10, "the hooked stage's counters in /v1/stages (heartbeat)")


@pytest.mark.parametrize(
    ("handler", "hook"), [("SyncWarm", "warm"), ("NoArgOutput", "client_output")], ids=["sync-warm", "output"]
)
def test_a_handler_with_a_broken_hook_fails_its_replicas_start_naming_the_hook(
    tmp_path: Path, handler: str, hook: str
) -> None:
    shutil.copyfile(HOOK_HANDLERS, tmp_path / HOOK_HANDLERS.name)
    stages = [{"stage_id": 0, "name": "broken", "handler": f"hook_handlers:{handler}"}]
    path = write_topology(tmp_path, {"name": f"hook-{hook}", "stages": stages}, handlers=False)
    done = subprocess.run(
        [str(OMNI_MESH), "up", str(path), "--port", str(free_port())],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, (done.returncode, done.stderr)
    failed = [line for line in done.stderr.splitlines() if "failed to start" in line]
    assert failed and all(f"has a `{hook}` that" in line for line in failed), done.stderr
    assert all(f"stage 'broken': handler {handler}" in line for line in failed), done.stderr
