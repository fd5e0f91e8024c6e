"""The stage handler contract: what a stage runs for each request (`Handler`), what it is given
(`HandlerContext`), and the optional hooks a handler may have (`HandlerHooks`), found and checked once
when the replica loads its handler (`hooks_of`), never looked up per request.

A handler is any callable `handler(inputs, ctx)` returning an output, an awaitable of one (`async def`),
or an async iterator of chunks (an async generator: the output streams downstream). It may be a class
built once per replica from its stage's settings (`BuiltFromStage`), whose instances are the callable.
A handler declares hooks by subclassing `HandlerHooks` (the engines do), or simply by defining methods of
the same names and signatures (plain classes users already have keep working): `hooks_of` checks them at
load and fails the replica's start with an error naming the stage and the hook.

A handler says the request, not the stage, is at fault by raising `omni_mesh.errors.InvalidInput` (422);
any other exception fails the request as the stage's (500).

Torch-free, imports nothing of the runtime: `stage/`, `engines/` and `topology/` all import it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


class HandlerContext(Protocol):
    """What a handler knows about the request it works on (`omni_mesh.stage.StageContext` is the runtime's)."""

    request_id: str
    params: dict  # the request's `params`
    stage: str  # this stage's name
    replica: str  # this replica's id
    stream: bool  # the client reads the final output as a stream

    def remaining(self) -> float:
        """Seconds left before the request's deadline."""
        ...

    def empty(self, shape: tuple[int, ...] | list[int], dtype: Any) -> Any:
        """An output tensor already in the memory of the stage's first outgoing edge (a put of it copies
        nothing); do not write into it after returning it."""
        ...


class Handler(Protocol):
    """`handler(inputs, ctx)`: an output, an awaitable of one, or an async iterator of chunks."""

    def __call__(self, inputs: Any, ctx: HandlerContext, /) -> Any: ...


@runtime_checkable
class BuiltFromStage(Protocol):
    """A handler class built once per replica from its stage's other keys (`engine_args`, `runtime`, ...)."""

    @classmethod
    def from_stage(cls, options: dict) -> Handler: ...


class HandlerHooks:
    """The hooks a handler may have, with what the runtime does when one is absent (these defaults).

    Subclass it to declare hooks; a handler that does not may define any of them with the same name and
    signature (`hooks_of`)."""

    async def warm(self) -> None:
        """Load what requests need (a model), awaited before the replica reports ready."""

    def client_output(self, output: Any) -> Any:
        """What a client reads of a final stage's output (or chunk): a final stage that feeds another one
        too keeps what only downstream needs (an engine's hidden states) out of the answer."""
        return output

    def counters(self) -> dict[str, int | float]:
        """The handler's own numbers, sent with every heartbeat (cheap: it runs on the event loop);
        names as Prometheus' (`encoder_cache_hits_total`): omni_mesh.stage.counters."""
        return {}


#: Each hook, for the checks at load: its signature as the error tells it, whether it must be `async def`,
#: and the positional arguments the runtime calls it with.
_HOOKS: dict[str, tuple[str, bool, tuple[Any, ...]]] = {
    "warm": ("async def warm(self) -> None", True, ()),
    "client_output": ("def client_output(self, output) -> output", False, (None,)),
    "counters": ("def counters(self) -> dict[str, int | float]", False, ()),
}


class _NamedHooks(HandlerHooks):
    """The hooks of a handler that does not subclass HandlerHooks, as it defines them."""

    def __init__(self, found: dict[str, Callable[..., Any]]) -> None:
        self._found = found

    async def warm(self) -> None:
        if "warm" in self._found:
            await self._found["warm"]()

    def client_output(self, output: Any) -> Any:
        return self._found["client_output"](output) if "client_output" in self._found else output

    def counters(self) -> dict[str, int | float]:
        return self._found["counters"]() if "counters" in self._found else {}


def hooks_of(handler: object, where: str) -> HandlerHooks:
    """The handler's hooks, each checked (callable, `async def` where it must be, takes what it is given);
    TypeError naming `where` (the stage) and the hook otherwise."""
    found: dict[str, Callable[..., Any]] = {}
    for name, (expected, is_async, args) in _HOOKS.items():
        hook = getattr(handler, name, None)  # once, at load: the runtime calls the hooks returned
        if hook is None:
            continue
        problem = _hook_problem(hook, args, is_async)
        if problem:
            raise TypeError(
                f"{where}: handler {_describe(handler)} has a `{name}` that {problem}; "
                f"a handler's {name} hook is `{expected}` (omni_mesh.handlers.HandlerHooks)"
            )
        found[name] = hook
    return handler if isinstance(handler, HandlerHooks) else _NamedHooks(found)


def _hook_problem(hook: Any, args: tuple[Any, ...], is_async: bool) -> str | None:
    if not callable(hook):
        return f"is a {type(hook).__name__}, not a method"
    if is_async and not inspect.iscoroutinefunction(hook):
        return "is not a coroutine function (async def)"
    try:
        inspect.signature(hook).bind(*args)
    except TypeError as exc:
        return f"cannot be called so ({exc})"
    except ValueError:  # no signature to read (a builtin): it is taken as it is
        return None
    return None


def _describe(handler: object) -> str:
    return getattr(handler, "__qualname__", None) or type(handler).__qualname__  # a function, or an instance
