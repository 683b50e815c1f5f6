"""The synchronous face of a channel, derived from its async one in one place: a method
declared once with :class:`two_faced` is, read through a :class:`BlockingFace` (what ``with``
gives), the same call run to its end in a short-lived event loop on the caller's thread, so the
weights are read, and CUDA work issued, where the trainer runs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from types import MethodType
from typing import Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

import anyio
import anyio.lowlevel

from streamsync.engine.clients import EngineClient, LoopBoundClient
from streamsync.errors import ConfigError

T = TypeVar("T")
C = TypeVar("C")
P = ParamSpec("P")


def run_blocking(
    clients: Sequence[EngineClient],
    form: str,
    call: Callable[[], Awaitable[T]],
    *,
    instead: str | None = None,
) -> T:
    """``call()`` in an event loop of its own on this thread, for the blocking ``form`` of a
    channel into ``clients``; refused, naming the async form (``instead``; default
    ``await <form>``), where an event loop runs already, or where an engine is driven from
    the loop that created it."""
    instead = instead if instead is not None else f"await {form}"
    try:
        anyio.lowlevel.current_token()
    except RuntimeError:
        pass
    else:
        raise ConfigError(
            f"{form} blocks, and an event loop is running in this thread; use '{instead}'"
        )
    for client in clients:
        if isinstance(client, LoopBoundClient) and client.loop_bound:
            raise ConfigError(
                f"{form}: {type(client).__name__} is driven from the event loop that "
                f"created its engine; use '{instead}' on that loop"
            )
    return anyio.run(call)


class BlockingFace:
    """The synchronous face of a channel (``channel``): each :class:`two_faced` method of the
    channel, read through it, blocks until done, with no event loop in the caller."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel

    def _run(self, form: str, call: Callable[[], Awaitable[T]], instead: str | None = None) -> T:
        return run_blocking(self.channel.clients, form, call, instead=instead)


class two_faced(Generic[C, P, T]):
    """An async method of a channel, declared once: read on the channel, the coroutine
    method; read on its :class:`BlockingFace`, the blocking call of the channel's method of
    the same name (a subclass's override included), refused where an event loop runs."""

    def __init__(self, fn: Callable[Concatenate[C, P], Coroutine[Any, Any, T]]) -> None:
        self.fn = fn
        self.name = fn.__name__
        functools.update_wrapper(self, fn)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __call__(self, channel: C, *args: P.args, **kwargs: P.kwargs) -> Awaitable[T]:
        """The method of the class itself, unbound (``EngineChannel.update(channel, ...)``)."""
        return self.fn(channel, *args, **kwargs)

    @overload
    def __get__(self, face: None, owner: type) -> Self: ...
    @overload
    def __get__(self, face: BlockingFace, owner: type) -> Callable[P, T]: ...  # type: ignore[overload-overlap]
    @overload
    def __get__(self, face: C, owner: type) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, face: Any, owner: type) -> Any:
        if face is None:
            return self
        if not isinstance(face, BlockingFace):
            return MethodType(self.fn, face)
        method = getattr(face.channel, self.name)

        @functools.wraps(self.fn)
        def blocking(*args: Any, **kwargs: Any) -> Any:
            return face._run(f"sync.{self.name}(...)", partial(method, *args, **kwargs))

        blocking.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
        return blocking


class forwarded(Generic[T]):
    """A property of the channel, read through its :class:`BlockingFace`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, face: BlockingFace, owner: type) -> T:
        return getattr(face.channel, self.name)  # type: ignore[no-any-return]
