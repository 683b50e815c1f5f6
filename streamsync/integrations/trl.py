"""streamsync as the ``weight_transfer`` of TRL's ``AsyncGRPOTrainer``
(``trl.experimental.async_grpo``), against a vLLM server started with
``--weight-transfer-config '{"backend": "streamsync"}'`` and ``VLLM_SERVER_DEV_MODE=1``::

    from streamsync.integrations.trl import WeightTransfer

    trainer = AsyncGRPOTrainer(model=path, reward_funcs=reward, args=config,
                               train_dataset=dataset,
                               weight_transfer=WeightTransfer(config.vllm_server_base_url))
    trainer.train()

:class:`WeightTransfer` has the five methods of TRL's ``WeightTransferProtocol``
(``init_weight_transfer``; per sync ``pause`` → ``send_weights(iterator)`` → ``resume``;
``destroy``) on the backend's
:class:`~streamsync.vllm.native.trainer.StreamsyncTrainerEngine` over vLLM's own
``HTTPVLLMWeightSyncClient``. TRL itself is never imported here: the protocol is structural.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from streamsync._channel import DEFAULT_TIMEOUT
from streamsync._log import log
from streamsync._peft import is_peft_model
from streamsync.errors import ConfigError, PeerBrokenError
from streamsync.lora import check_lora_name
from streamsync.pipeline import AdapterLike
from streamsync.report import SyncReport
from streamsync.vllm.server import BACKEND, SERVER_FLAG, call
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES

__all__ = ["WeightTransfer"]


class WeightTransfer:
    """TRL's ``WeightTransferProtocol`` on the ``streamsync`` vLLM backend.

    Parameters:
        server_url: The vLLM server, as in ``AsyncGRPOConfig.vllm_server_base_url``
            (``http://host:port``).
        endpoint: The transport URL the trainer binds and the server's workers connect to;
            the default, ``zmq+tcp://127.0.0.1:0``, takes a free port on this machine (a
            server on another machine: ``zmq+tcp://*:PORT`` or this machine's address).
        pipeline: Adapters applied to TRL's stream on the trainer (``cast``, ``expand_moe``,
            ``quantize_fp8``, ...).
        secret: The channel's shared secret, sent to the workers in the init call (over
            HTTP, in clear); leave it ``None`` and set ``$STREAMSYNC_SECRET`` on both sides to
            keep it off the wire.
        delta: Delta syncs: after the first (full) sync, each ``send_weights`` moves only the
            elements that changed (``docs/delta.md``).
        staged: Staged syncs (``docs/staged.md``): ``pause`` and ``resume`` leave the server
            generating, and ``send_weights`` stages the version on every worker while it
            does, then commits it in a pause (``/pause?mode=keep``) that covers only the
            apply. Each worker holds a host copy of its weights while staging.
        bucket_bytes: Bytes per bucket (the transport's slot size).
        timeout: Seconds for each wait of a sync, and for the workers' connect.
        worker_options: :class:`~streamsync.engine.messages.WorkerOptions` fields for every
            sync (``lifecycle``, ``quirks``).
        server_timeout: Seconds ``init_weight_transfer`` waits for the server's ``/health``
            (TRL's ``vllm_server_timeout``).
        control_timeout: Seconds for ``/pause``, ``/resume`` and the server's other short
            routes.
        weight_sync_timeout: Seconds for the HTTP calls that last as long as a transfer (the
            server's ``/update_weights`` returns when its workers have applied it); TRL's
            ``weight_sync_timeout``.
    """

    def __init__(
        self,
        server_url: str,
        *,
        endpoint: str = "zmq+tcp://127.0.0.1:0",
        pipeline: AdapterLike | None = None,
        secret: str | None = None,
        delta: bool = False,
        staged: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
        worker_options: Mapping[str, Any] | None = None,
        server_timeout: float = 240.0,
        control_timeout: float = 300.0,
        weight_sync_timeout: float = 1800.0,
    ) -> None:
        if not isinstance(server_url, str) or not server_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"WeightTransfer(server_url={server_url!r}): use the vLLM server's base URL, "
                "http://HOST:PORT (AsyncGRPOConfig.vllm_server_base_url)"
            )
        #: The vLLM server's base URL.
        self.server_url = server_url.rstrip("/")
        #: What the workers are told at init (``StreamsyncInitInfo``'s fields).
        self.init_info: dict[str, Any] = dict(
            endpoint=endpoint,
            pipeline=pipeline,
            secret=secret,
            delta=delta,
            staged=staged,
            bucket_bytes=bucket_bytes,
            timeout=timeout,
            worker_options=worker_options,
        )
        self.server_timeout = server_timeout
        self.control_timeout = control_timeout
        self.weight_sync_timeout = weight_sync_timeout
        self._engine: Any = None  # a StreamsyncTrainerEngine
        self._adapter: _AdapterOnly | None = None

    def init_weight_transfer(self) -> None:
        """Wait for the server, check that it runs the ``streamsync`` backend, bind the
        transport and have every worker of the server connect (their count is the server's
        ``/get_world_size``). Called by the trainer once at train begin; again, it does
        nothing.

        Raises:
            PeerBrokenError: the server cannot be reached within ``server_timeout``.
            ConfigError: the server runs without ``VLLM_SERVER_DEV_MODE=1`` or another
                weight-transfer backend (the message names the flag), or, in adapter-only
                mode, without ``--enable-lora`` or with too few adapter slots.
        """
        if self._engine is not None:
            return
        self._wait_until_ready()
        config = self._server_config()
        if self._adapter is not None:
            self._adapter.check_server(config, self.server_url)
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        from streamsync.vllm.native import StreamsyncInitInfo
        from streamsync.vllm.native.trainer import StreamsyncTrainerEngine

        info = StreamsyncInitInfo(**self.init_info, rank=0)
        client = HTTPVLLMWeightSyncClient(self.server_url, timeout=self.weight_sync_timeout)
        self._engine = StreamsyncTrainerEngine.trainer_init(info, client=client)
        log(
            "trl.init_weight_transfer",
            server=self.server_url,
            endpoint=self._engine.channel.url,
            receivers=self._engine.receivers,
        )

    def pause(self) -> None:
        """Pause generation on the server (``/pause?mode=keep``: requests in flight wait;
        vLLM clears its prefix cache). Staged: nothing (``send_weights`` pauses only for its
        commit)."""
        if self.init_info["staged"]:
            return
        call(
            self.server_url, "POST", "pause", params={"mode": "keep"}, timeout=self.control_timeout
        )

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Stream ``iterator``'s ``(name, tensor)`` pairs through the pipeline into every
        worker of the server; returns once each has applied them (the sender's report is then
        :attr:`last_report`). In adapter-only mode the iterator is drained unsent and the
        trainer's LoRA adapter is sent instead.

        Raises:
            ConfigError: before ``init_weight_transfer`` or after ``destroy``.
            StreamsyncError: the sync failed: the worker's own error by class where it
                reached the trainer (``UnknownTensorError``, ``ShapeMismatchError``, ...),
                else the transport's or the server's.
        """
        engine = self._engine
        if engine is None:
            raise ConfigError(
                "WeightTransfer.send_weights: not initialised (init_weight_transfer() first, "
                "or after destroy())"
            )
        if self._adapter is not None:
            self._adapter.send(engine, iterator)
        else:
            engine.send_weights(iterator)
        log("trl.send_weights", server=self.server_url, summary=engine.last_report.summary())

    def resume(self) -> None:
        """Resume generation on the server (``/resume``). Staged: nothing (the commit
        resumed it)."""
        if self.init_info["staged"]:
            return
        call(self.server_url, "POST", "resume", timeout=self.control_timeout)

    def destroy(self) -> None:
        """Close the transport and the workers' receivers. Called by the trainer at train
        end; again, it does nothing."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    @property
    def last_report(self) -> SyncReport | None:
        """The sender's report of the last sync (bytes, seconds, delta and LoRA details)."""
        return None if self._engine is None else self._engine.last_report  # type: ignore[no-any-return]

    @property
    def served_adapter(self) -> str | None:
        """In adapter-only mode, the name the server serves the last adapter version under
        (``{name}-v{N}``, the ``"model"`` of a request); otherwise ``None``."""
        if self._adapter is None or not self._adapter.installed:
            return None
        return f"{self._adapter.name}-v{self._adapter.installed[-1]}"

    def adapter_only(self, trainer: Any, *, name: str = "trl-policy") -> None:
        """Make each sync of ``trainer`` (an ``AsyncGRPOTrainer`` with a peft model, built
        with ``weight_transfer=self``) move only its LoRA adapter, from memory: call it after
        building the trainer and before ``trainer.train()``. The server needs
        ``--enable-lora``, ``--max-lora-rank`` of at least the adapter's rank, ``--max-loras``
        of at least ``max_staleness + 2`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``.

        TRL only runs its own adapter mode (the adapter saved to a directory each sync, which
        the server reads) when it builds the weight transfer itself; with one passed in, it
        merges the adapter and asks for every parameter, and its rollout worker asks the
        server for the base model. So this sets one private field of TRL's rollout worker
        (the ``lora_name`` its requests use, which TRL sets itself in its adapter mode), and
        each ``send_weights`` then drains TRL's iterator unsent and installs the adapter as
        ``{name}-v{N}``, N the version the trainer is about to publish, as TRL's adapter
        mode names it; the version that falls out of ``max_staleness`` is removed at the
        next sync. Checked against TRL 1.16; one trainer process (no FSDP).

        Raises:
            ConfigError: the trainer's model is not a peft model, its ``weight_transfer`` is
                not this object, its rollout worker is not TRL's or has started, or ``name``
                cannot be an adapter's name.
        """
        model = trainer.accelerator.unwrap_model(trainer.model)
        if not is_peft_model(model):
            raise ConfigError(
                f"adapter_only: the trainer's model is a {type(model).__name__}, not a peft "
                "model; pass peft_config= to AsyncGRPOTrainer (full syncs need no call)"
            )
        if getattr(trainer, "weight_transfer", None) is not self:
            raise ConfigError(
                "adapter_only: the trainer's weight_transfer is not this WeightTransfer; "
                "build it with AsyncGRPOTrainer(..., weight_transfer=transfer)"
            )
        from streamsync.integrations import _trl_compat

        worker = getattr(trainer, "rollout_worker", None)
        loop_kwargs = _trl_compat.rollout_loop_kwargs(worker)
        if loop_kwargs is None:
            raise ConfigError(
                f"adapter_only: the trainer's rollout worker is a {type(worker).__name__}, not "
                "TRL's AsyncRolloutWorker (of TRL 1.16); a rollout worker of your own must ask "
                f"the server for model '{name}-v<trainer.model_version>' itself"
            )
        if _trl_compat.started(worker):
            raise ConfigError("adapter_only: call it before trainer.train()")
        check_lora_name(f"{name}-v1")
        loop_kwargs["lora_name"] = name
        self._adapter = _AdapterOnly(trainer, model, name)

    def _wait_until_ready(self) -> None:
        """Poll ``/health`` until the server answers, as TRL's own client does."""
        import requests

        deadline = time.monotonic() + self.server_timeout
        while True:
            try:
                if requests.get(f"{self.server_url}/health", timeout=5).status_code == 200:
                    return
                error = "it answers /health with an error"
            except requests.RequestException as exc:
                error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise PeerBrokenError(
                    f"the vLLM server at {self.server_url} cannot be reached within "
                    f"{self.server_timeout:g} s ({error}); check that it runs (started with "
                    f"VLLM_SERVER_DEV_MODE=1 and {SERVER_FLAG}) and that this machine reaches it"
                )
            time.sleep(1.0)

    def _server_config(self) -> dict[str, Any]:
        """The server's resolved ``vllm_config`` (``/server_info``), checked to run the
        ``streamsync`` backend."""
        response = call(
            self.server_url,
            "GET",
            "server_info",
            params={"config_format": "json"},
            timeout=self.control_timeout,
        )
        try:
            config = response.json()["vllm_config"]
            transfer = config.get("weight_transfer_config") or {}
            backend = transfer.get("backend") if isinstance(transfer, dict) else None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"the vLLM server at {self.server_url} answered /server_info without a "
                f"vllm_config ({exc!r}); is it a vLLM server?"
            ) from exc
        if backend != BACKEND:
            running = "no weight-transfer backend" if not transfer else f"backend {backend!r}"
            raise ConfigError(
                f"the vLLM server at {self.server_url} runs {running}, not 'streamsync': start "
                f"it with {SERVER_FLAG} (and VLLM_SERVER_DEV_MODE=1), with streamsync "
                "installed in its environment"
            )
        return config  # type: ignore[no-any-return]


class _AdapterOnly:
    """What :meth:`WeightTransfer.adapter_only` keeps: the trainer, its peft model, the
    adapter's base name and the versions installed."""

    def __init__(self, trainer: Any, model: Any, name: str) -> None:
        self.trainer = trainer
        self.model = model
        self.name = name
        self.installed: list[int] = []

    def check_server(self, config: Mapping[str, Any], url: str) -> None:
        """The server serves adapters, enough of them for TRL's staleness window."""
        lora = config.get("lora_config")
        if not lora:
            raise ConfigError(
                f"adapter_only: the vLLM server at {url} runs without LoRA: start it with "
                "--enable-lora --max-lora-rank R --max-loras N and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
            )
        # The server holds every version a request in flight may name, and the new one.
        needed = int(self.trainer.args.max_staleness) + 2
        if int(lora.get("max_loras", 0)) < needed:
            raise ConfigError(
                f"adapter_only: the vLLM server at {url} holds --max-loras "
                f"{lora.get('max_loras')} adapters; max_staleness="
                f"{self.trainer.args.max_staleness} needs {needed}: restart it with "
                f"--max-loras {needed}"
            )

    def send(self, engine: Any, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        # TRL's iterator is drained on every rank (under FSDP its gathers are collectives);
        # the adapter is read from the model, which TRL has merged: the LoRA tensors are
        # unchanged by a merge.
        for _ in iterator:
            pass
        version = int(self.trainer.model_version) + 1
        # Versions no request can name any more (TRL's window: max_staleness back).
        oldest = version - int(self.trainer.args.max_staleness) - 1
        for old in [v for v in self.installed if v < oldest]:
            engine.remove_lora(f"{self.name}-v{old}")
            self.installed.remove(old)
        engine.send_lora(f"{self.name}-v{version}", self.model)
        self.installed.append(version)
