"""vLLM engines hosted in Ray actors: :class:`RayActor`, how a
:class:`~streamsync.vllm.client.VllmClient` reaches an engine through its actor handle.

``WeightSync(handle, endpoint)`` takes the handle of an actor that holds a vLLM ``LLM`` (as
``ray.remote(LLM)`` makes it) or an ``AsyncLLM`` and exposes its methods (``collective_rpc``,
and for an ``AsyncLLM`` ``pause_generation``, ``resume_generation`` and
``reset_prefix_cache``), or a list of them. The workers' calls go through the actor's
``collective_rpc`` with plain values; what only the engine object itself can do (install a
LoRA adapter, set an ``LLM``'s weight version) runs inside the actor (Ray's
``__ray_call__``), by reference to a function of this module, or, for an actor holding an
``AsyncLLM``, through the methods it exposes (``add_lora(request)``, ``remove_lora(lora_id)``
as the ``AsyncLLM`` takes them). The weights go over the
channel's transport, never through Ray.

This module is imported only where a handle is given: importing streamsync never imports
Ray.
"""

from __future__ import annotations

from typing import Any

import ray
import ray.exceptions

from streamsync._channel import DEFAULT_TIMEOUT
from streamsync.engine.clients import PauseMode
from streamsync.errors import ConfigError, LoraError, PeerBrokenError, ReceiverFailedError

__all__ = ["node_address"]

_HELLO = "streamsync_hello"


def node_address() -> str:
    """This node's IP address as Ray knows it (what engine workers on other nodes reach)."""
    return str(ray.util.get_node_ip_address())


def _where(actor: Any) -> tuple[str, str, str]:
    """Inside the actor: its class, its id and its node's address."""
    actor_id = str(ray.get_runtime_context().get_actor_id() or "")
    return type(actor).__name__, actor_id[:12], node_address()


def _engine(actor: Any) -> Any:
    """Inside the actor: the object that takes adapters and weight versions (an ``LLM``'s
    engine, or an ``AsyncLLM``-like actor itself)."""
    return getattr(actor, "llm_engine", actor)


def _lora_config(actor: Any) -> bool | None:
    """Inside the actor: whether its engine serves LoRA adapters (``None``: cannot tell)."""
    config = getattr(_engine(actor), "vllm_config", None)
    return None if config is None else getattr(config, "lora_config", None) is not None


def _add_lora(actor: Any, name: str, lora_id: int, path: str) -> None:
    from streamsync.vllm.lora import lora_request

    _engine(actor).add_lora(lora_request(name, lora_id, path, load_inplace=True))


def _remove_lora(actor: Any, lora_id: int) -> None:
    _engine(actor).remove_lora(lora_id)


def _set_weight_version(actor: Any, version: str) -> None:
    _engine(actor).set_weight_version(version)


class RayActor:
    """A vLLM engine in a Ray actor, through its handle: asked once, when made, how many
    workers it has (its workers' hellos through ``collective_rpc``, which also checks that
    they carry the worker extension), and named in errors by its class, actor id and node.
    Calls are awaited from any event loop (the channel may run blocking)."""

    loop_bound = False

    def __init__(self, handle: Any, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.handle = handle
        actor_id = "(not answering)"
        try:
            cls, actor_id, node = ray.get(handle.__ray_call__.remote(_where), timeout=timeout)
            hellos = ray.get(handle.collective_rpc.remote(_HELLO), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise PeerBrokenError(
                f"Ray actor {actor_id} did not answer within {timeout:g} s"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise PeerBrokenError(f"Ray actor {actor_id} is gone: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            raise ConfigError(
                f"Ray actor {actor_id} cannot run streamsync on its workers ({exc.cause!r}): "
                'start its engine with worker_extension_cls="streamsync.vllm.WorkerExtension" '
                "and expose collective_rpc"
            ) from None
        #: How errors and reports name it: ``class actor <id> on <node>``.
        self.name = f"{cls} actor {actor_id} on {node}"
        #: The node's address (where its workers connect from).
        self.node = node
        self.workers = len(hellos)
        self._methods = {m for m in dir(handle) if not m.startswith("_")}

    def _has(self, method: str) -> bool:
        return method in self._methods

    async def _await(self, what: str, ref: Any) -> Any:
        try:
            return await ref
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise PeerBrokenError(f"{self.name} is gone ({what}): {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise ReceiverFailedError(
                f"{self.name}: {what} failed: {type(cause).__name__}: {cause}"
            ) from None

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        """Each worker's answer to ``method`` of the worker extension, by rank."""
        ref = self.handle.collective_rpc.remote(method, args=args)
        return list(await self._await(method, ref))

    async def _in_actor(self, what: str, fn: Any, *args: Any) -> Any:
        return await self._await(what, self.handle.__ray_call__.remote(fn, *args))

    async def reset_prefix_cache(self) -> bool:
        ref = self.handle.reset_prefix_cache.remote(True)
        return bool(await self._await("reset_prefix_cache", ref))

    async def pause(self, mode: PauseMode) -> None:
        # An actor holding an LLM runs one call at a time: no request generates while the
        # commit runs in it.
        if self._has("pause_generation"):
            ref = self.handle.pause_generation.remote(mode=mode, clear_cache=False)
            await self._await("pause_generation", ref)

    async def resume(self) -> None:
        if self._has("resume_generation"):
            await self._await("resume_generation", self.handle.resume_generation.remote())

    async def set_weight_version(self, version: str) -> None:
        if self._has("update_weight_version"):
            ref = self.handle.update_weight_version.remote(version)
            await self._await("update_weight_version", ref)
        else:
            await self._in_actor("set_weight_version", _set_weight_version, version)

    async def add_lora(self, name: str, lora_id: int, path: str) -> int | None:
        what = f"add_lora({name!r})"
        if self._has("add_lora"):  # an actor exposing its AsyncLLM's add_lora(request)
            from streamsync.vllm.lora import lora_request

            request = lora_request(name, lora_id, path, load_inplace=True)
            await self._await(what, self.handle.add_lora.remote(request))
        else:  # an LLM actor: its engine, inside it
            await self._in_actor(what, _add_lora, name, lora_id, path)
        return None  # the actor does not say which requests use it

    async def remove_lora(self, lora_id: int) -> None:
        if self._has("remove_lora"):
            await self._await("remove_lora", self.handle.remove_lora.remote(lora_id))
        else:
            await self._in_actor("remove_lora", _remove_lora, lora_id)

    def check_lora(self) -> None:
        """Refuse, by name, an engine started without LoRA (where the actor can tell)."""
        from streamsync.vllm.lora import NO_LORA

        if ray.get(self.handle.__ray_call__.remote(_lora_config)) is False:
            raise LoraError(f"{self.name}: {NO_LORA}")
