"""Adapters: stages from an async iterable of items to an async iterator of items.

One form, after aiostream's ``pipable_operator``: an adapter is an async-generator function
whose first argument is its source, made pipeable by :func:`adapter`::

    @adapter
    async def select(source: AsyncIterable[NamedTensor], pred: Callable[[str], bool]):
        async for name, tensor in source:
            if pred(name):
                yield name, tensor

``select(pred)`` is then a :class:`Stage`: ``select(pred)(source)`` runs it and ``a | b``
composes (``a`` first, plain functions too) into a :class:`Chain`. A stage that stops early,
fails or is closed closes its source (:func:`reading`).

An adapter that decides from the engines a sync feeds (``expand_moe("auto")``) declares a
keyword-only parameter ``engines`` (a tuple of :class:`~streamsync.facts.EngineFacts`): an
engine's channel tells it them through :meth:`Adapter.for_engines` before it sends; run
anywhere else, it gets its default.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Concatenate, Generic, ParamSpec, TypeAlias, overload

import torch

from streamsync.errors import ConfigError
from streamsync.facts import EngineFacts

NamedTensor: TypeAlias = tuple[str, torch.Tensor]
AdapterLike: TypeAlias = Callable[[AsyncIterable[Any]], AsyncIterator[Any]]
P = ParamSpec("P")


@asynccontextmanager
async def reading(source: AsyncIterable[Any]) -> AsyncIterator[AsyncIterator[Any]]:
    """Iterate ``source`` and close it on the way out, however the way out is taken."""
    iterator = aiter(source)
    try:
        yield iterator
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


async def _guarded(stage: AdapterLike, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
    """``stage(source)``, closing the stage's output and then ``source`` however it ends."""
    async with reading(source) as items, reading(stage(items)) as out:
        async for item in out:
            yield item
            del item  # hold nothing of it while the consumer asks for the next one


class Adapter:
    """Base class of what composes with ``|``; a subclass written by hand works in
    ``__call__(source)`` and reads its source through :func:`reading` itself."""

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        raise NotImplementedError

    def fuse(self, following: Adapter) -> Adapter | None:
        """An adapter doing the work of ``self | following`` in one pass, if this adapter
        knows one; ``None`` otherwise."""
        return None

    def for_engines(self, engines: tuple[EngineFacts, ...]) -> Adapter:
        """This adapter as it runs in a sync that feeds ``engines`` (their facts, one per
        engine): a copy told them if it decides from them, else itself."""
        return self

    def __or__(self, other: AdapterLike) -> Chain:
        return Chain(self, other)

    def __ror__(self, other: AdapterLike) -> Chain:
        return Chain(other, self)


#: ``fuse(stage, following)``: an adapter doing ``stage | following`` in one pass, or None.
Fuse: TypeAlias = Callable[["Stage", Adapter], "Adapter | None"]


class Stage(Adapter):
    """What calling an :func:`adapter` function returns: ``op``, that function, and
    ``config``, the keyword arguments it runs with (also attributes, as in
    ``cast(torch.bfloat16).rule``, which its ``fuse`` reads)."""

    def __init__(self, op: Operator[Any], config: Mapping[str, Any], shown: str) -> None:
        self.op, self.config, self._shown = op, dict(config), shown

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        return _guarded(functools.partial(self.op.fn, **self.config), source)

    def fuse(self, following: Adapter) -> Adapter | None:
        return None if self.op.fuse is None else self.op.fuse(self, following)

    def for_engines(self, engines: tuple[EngineFacts, ...]) -> Adapter:
        if not self.op.takes_engines:
            return self
        return Stage(self.op, {**self.config, "engines": engines}, self._shown)

    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("config", {})  # absent while copy or pickle rebuild it
        if name in config:
            return config[name]
        raise AttributeError(f"a stage has no attribute or configuration {name!r}")

    def __repr__(self) -> str:
        return self._shown


class Operator(Generic[P]):
    """An adapter function made pipeable by :func:`adapter`: calling it returns a
    :class:`Stage`; ``isinstance(x, op)`` is true of the stages it made."""

    def __init__(
        self,
        fn: Callable[..., AsyncIterator[Any]],
        configure: Callable[P, Mapping[str, Any]] | None = None,
        fuse: Fuse | None = None,
    ) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.configure, self.fuse = fn, configure, fuse
        signature = inspect.signature(fn)
        engines = signature.parameters.get("engines")
        #: Whether ``fn`` decides from the engines a sync feeds (see :meth:`Stage.for_engines`).
        self.takes_engines = engines is not None and engines.kind is engines.KEYWORD_ONLY
        # What a caller passes: ``configure``'s parameters, or ``fn``'s after the source
        # but ``engines``, which a sync tells the stage.
        options = inspect.signature(configure) if configure is not None else signature
        params = list(options.parameters.values())
        if configure is None:
            params = [p for p in params[1:] if not (self.takes_engines and p.name == "engines")]
        self._options = options.replace(parameters=params)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        """The caller's arguments bound to the options; a :class:`ConfigError` naming a
        wrong argument and the valid ones."""
        valid = [
            p.name
            for p in self._options.parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in self._options.parameters.values())
        name = self.fn.__name__
        for key in kwargs:
            if key not in valid and not takes_any:
                close = difflib.get_close_matches(key, valid, n=1, cutoff=0.7)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"{name}(): unknown option {key!r}{hint}; valid: {', '.join(valid) or 'none'}"
                )
        try:
            return self._options.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"{name}(): {exc}; options: {', '.join(valid) or 'none'}") from None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Stage:
        bound = self._bind(args, kwargs)
        if self.configure is not None:
            config = dict(self.configure(*args, **kwargs))
        else:
            bound.apply_defaults()
            config = dict(bound.arguments)
        shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        return Stage(self, config, f"{self.fn.__name__}({shown})")

    def __instancecheck__(self, instance: object) -> bool:
        return isinstance(instance, Stage) and instance.op is self

    def __repr__(self) -> str:
        return f"<adapter {self.fn.__module__}.{self.fn.__qualname__}>"


@overload
def adapter(
    fn: Callable[Concatenate[AsyncIterable[Any], P], AsyncIterator[Any]], /
) -> Operator[P]: ...


@overload
def adapter(
    *, configure: Callable[P, Mapping[str, Any]], fuse: Fuse | None = None
) -> Callable[[Callable[..., AsyncIterator[Any]]], Operator[P]]: ...


def adapter(
    fn: Callable[..., AsyncIterator[Any]] | None = None,
    /,
    *,
    configure: Callable[..., Mapping[str, Any]] | None = None,
    fuse: Fuse | None = None,
) -> Any:
    """Make an async-generator function ``fn(source, ...)`` a pipeable adapter.

    ``@adapter``: the arguments after ``source`` are the configuration, bound (and refused
    with ``TypeError``) when the stage is made. ``@adapter(configure=check)``: the stage is
    made by calling ``check`` with the caller's arguments; it validates them, raising at
    once, and returns the keyword arguments ``fn`` is run with (so per-run work such as
    compiling a pattern or reading the environment happens once). ``fuse(stage, following)``
    may return one adapter doing ``stage | following`` in one pass (see :class:`Chain`).
    """
    if fn is not None:
        return Operator(fn)
    return lambda f: Operator(f, configure, fuse)


class Chain(Adapter):
    """Adapters applied in order; adjacent ones that can fuse are fused (unless
    ``fuse=False``). Nested chains are flattened to their original stages first, so fusing
    never depends on how a pipeline was grouped."""

    def __init__(self, *stages: AdapterLike, fuse: bool = True) -> None:
        self._fuse = fuse
        flat: list[AdapterLike] = []
        for stage in stages:
            if not callable(stage):
                raise TypeError(f"{stage!r} is not an adapter (a callable on an async iterable)")
            flat.extend(stage.parts if isinstance(stage, Chain) else (stage,))
        #: The stages as given, before fusing.
        self.parts: tuple[AdapterLike, ...] = tuple(flat)
        fused: list[AdapterLike] = []
        for stage in flat:
            if fuse and fused and isinstance(fused[-1], Adapter) and isinstance(stage, Adapter):
                merged = fused[-1].fuse(stage)
                if merged is not None:
                    fused[-1] = merged
                    continue
            fused.append(stage)
        #: The stages run, after fusing.
        self.stages: tuple[AdapterLike, ...] = tuple(fused)

    def for_engines(self, engines: tuple[EngineFacts, ...]) -> Chain:
        """The chain with each of its stages told ``engines`` (:meth:`Adapter.for_engines`)."""
        told = [s.for_engines(engines) if isinstance(s, Adapter) else s for s in self.parts]
        return Chain(*told, fuse=self._fuse)

    def __call__(self, source: AsyncIterable[Any]) -> AsyncIterator[Any]:
        stream: AsyncIterable[Any] = source
        for stage in self.stages:
            # A stage guards its own source; a plain function is guarded here.
            stream = stage(stream) if isinstance(stage, Adapter) else _guarded(stage, stream)
        return aiter(stream)

    def __repr__(self) -> str:
        return " | ".join(repr(s) for s in self.stages)
