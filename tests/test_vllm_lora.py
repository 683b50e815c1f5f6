"""LoRA adapter syncs into the CPU build of vLLM (``enable_lora=True``): only the adapter moves,
from memory, and the engine serves it under its name.

The trainer is a peft model on a tiny Qwen3, its adapter on q/k/v/o/gate/up/down. After every
adapter sync the engine's prompt logprobs with the adapter match the peft model's within
1e-4 (and its greedy tokens are the peft model's), and without it the base model's. Prefix
caching is on (32-token blocks) and a prompt longer than two blocks is asked with the adapter
every round, so KV cached under an old version would show. Bad adapters fail by name before
anything is installed, with the previous version still serving.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import extra
from vllm_harness import (
    LONG_PROMPT,
    PROMPTS,
    TRAINER,
    Outputs,
    cached_greedy,
    engine_outputs,
    make_llm,
    outputs_from,
    reference_outputs,
    sampling,
    shutdown,
)

import streamsync as ss
from streamsync.testing.models import build_tiny_model

pytestmark = pytest.mark.vllm

peft = extra("peft", "lora")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALL = [*PROMPTS, LONG_PROMPT]
LORA_TOL = 1e-4
BASE_TOL = 1e-5


def make_peft(base: torch.nn.Module, *, r: int = 8, seed: int = 1) -> Any:
    """A peft model on a copy of ``base`` with a LoRA adapter of rank ``r`` that changes its
    outputs (peft starts B at zero)."""
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    train_adapter(model, seed=seed)
    model.eval()
    return model


@torch.no_grad()
def train_adapter(model: Any, *, seed: int, scale: float = 0.05) -> None:
    """A stand-in for a training step of the adapter only."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.add_(torch.randn(param.shape, generator=gen) * scale)


@torch.no_grad()
def train_base(model: Any, *, seed: int, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_" not in name:
            param.add_(torch.randn(param.shape, generator=gen) * scale)


def outputs(llm: Any, prompts: list[list[int]] = ALL, *, lora_request: Any = None) -> Outputs:
    """:func:`engine_outputs`, one prompt at a time: vLLM 0.32's LoRA logits on CPU fail
    (``bgmv_shrink``: an einsum over the batch's requests against the prompt's tokens) when
    a batch of several requests asks for prompt logprobs."""
    parts = [engine_outputs(llm, [p], lora_request=lora_request) for p in prompts]
    return Outputs(
        [t for part in parts for t in part.tokens],
        [lp for part in parts for lp in part.prompt_logprobs],
    )


def greedy(llm: Any, prompts: list[list[int]], lora_requests: list[Any]) -> list[list[int]]:
    """Greedy tokens of one batch, each prompt with its own adapter (no prompt logprobs)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(requests, params, use_tqdm=False, lora_request=lora_requests)
    return [list(o.outputs[0].token_ids) for o in outs]


def base_outputs(model: Any, prompts: list[list[int]] = ALL) -> Outputs:
    with model.disable_adapter():
        return reference_outputs(model, prompts)


def assert_close(got: Outputs, want: Outputs, tol: float) -> None:
    assert got.tokens == want.tokens
    diff = got.max_logprob_diff(want)
    assert diff <= tol, f"max |logprob difference| {diff:.3g} > {tol}"


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone()
        for k, v in peft.get_peft_model_state_dict(model, save_embedding_layers=False).items()
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, torch.nn.Module]]:
    path = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(path, "dense", seed=0)
    llm = make_llm(
        str(path),
        enable_lora=True,
        max_lora_rank=16,
        max_loras=2,
        enable_prefix_caching=True,
        block_size=32,
    )
    yield llm, base
    shutdown(llm)


def test_an_adapter_updated_three_times_serves_the_peft_model(
    engine: tuple[Any, torch.nn.Module],
) -> None:
    from streamsync.vllm import WeightSync

    llm, base = engine
    model = make_peft(base, seed=1)
    endpoint = "zmq+tcp://127.0.0.1:0"  # bound when the channel opens
    with WeightSync(llm, endpoint, bucket_bytes=256 << 10, delta=True) as sync:
        # The peft model's base syncs as the plain model would (its own names, no adapter).
        train_base(model, seed=5)
        report = sync.update(model)
        assert report.instances["worker0.main"].missing == ()
        full_bytes = report.nbytes
        want_base = base_outputs(model)
        assert_close(outputs(llm), want_base, BASE_TOL)
        before = want_base.tokens
        changed = False
        for step in range(3):
            train_adapter(model, seed=10 + step)
            want = reference_outputs(model, ALL)
            changed |= want.tokens != before
            report = sync.update_lora("policy", model)
            assert report.complete and report.lora is not None
            assert report.lora.name == "policy" and report.lora.rank == 8
            assert report.lora.in_flight == 0
            assert report.tensors == 2 * len(TARGETS) * 2  # A and B, 7 modules, 2 layers
            sent = sum(t.numel() * t.element_size() for t in adapter_tensors(model).values())
            assert report.nbytes == sent < full_bytes / 10  # only the adapter moved
            request = sync.lora_request("policy")
            assert request.lora_path == report.lora.path
            assert_close(outputs(llm, lora_request=request), want, LORA_TOL)
            assert_close(outputs(llm), want_base, BASE_TOL)
            # The long prompt through the prefix cache: this version's KV, then a hit on it.
            tokens, _ = cached_greedy(llm, [LONG_PROMPT], lora_request=request)
            assert tokens == [want.tokens[-1]], f"step {step}: stale KV served"
            tokens, cached = cached_greedy(llm, [LONG_PROMPT], lora_request=request)
            assert tokens == [want.tokens[-1]] and cached >= 64
            before = want.tokens
        assert changed, "the adapter steps did not change the greedy tokens: nothing was shown"
        # The adapter syncs left the base where it was: the next weight sync is a delta on it.
        train_base(model, seed=6)
        report = sync.update(model)
        assert report.delta is not None and report.delta.base is not None, report.delta
        assert_close(outputs(llm), base_outputs(model), BASE_TOL)
        assert_close(
            outputs(llm, lora_request=sync.lora_request("policy")),
            reference_outputs(model, ALL),
            LORA_TOL,
        )
        sync.remove_lora("policy")
        assert sync.channel.loras == ()


def test_a_staged_adapter_serves_only_after_its_commit(
    engine: tuple[Any, torch.nn.Module],
) -> None:
    """``stage_lora`` leaves the engine serving the installed version bit-identically;
    ``commit_lora`` installs the staged one, which then serves the peft model's outputs."""
    from streamsync.vllm import WeightSync

    llm, base = engine
    model = make_peft(base, seed=3)
    with WeightSync(llm, "zmq+tcp://127.0.0.1:0", bucket_bytes=256 << 10) as sync:
        sync.update(model)  # the engine's base is this peft model's
        first = sync.update_lora("staged", model)
        assert first.lora is not None
        served = outputs(llm, lora_request=sync.lora_request("staged"))
        assert_close(served, reference_outputs(model, ALL), LORA_TOL)
        train_adapter(model, seed=30)
        want = reference_outputs(model, ALL)
        assert want.tokens != served.tokens  # the new version changes the greedy tokens
        staged = sync.stage_lora("staged", model)
        assert staged.complete and staged.lora is None
        assert sync.lora_request("staged").lora_path == first.lora.path
        assert outputs(llm, lora_request=sync.lora_request("staged")) == served
        committed = sync.commit_lora("staged")
        assert committed.lora is not None and committed.sync_id == staged.sync_id
        assert sync.lora_request("staged").lora_path == committed.lora.path != first.lora.path
        assert_close(outputs(llm, lora_request=sync.lora_request("staged")), want, LORA_TOL)
        with pytest.raises(ss.ConfigError, match="no version of it is staged"):
            sync.commit_lora("staged")
        sync.remove_lora("staged")


def test_two_adapters_side_by_side_and_the_engines_limit(
    engine: tuple[Any, torch.nn.Module],
) -> None:
    from streamsync.vllm import WeightSync

    llm, base = engine
    first = make_peft(base, seed=2)
    second = make_peft(base, seed=3)
    third = make_peft(base, seed=4)
    with WeightSync(llm, "zmq+tcp://127.0.0.1:0") as sync:
        sync.update(first)  # the base both adapters were trained on
        sync.update_lora("first", first)
        sync.update_lora("second", second)
        want = {"first": reference_outputs(first, ALL), "second": reference_outputs(second, ALL)}
        assert want["first"].tokens != want["second"].tokens
        # One batch, each prompt with its own adapter.
        names = ["first", "second", "first", "second"]
        got = greedy(llm, ALL, [sync.lora_request(n) for n in names])
        assert got == [want[n].tokens[i] for i, n in enumerate(names)]
        for name in ("first", "second"):
            assert_close(outputs(llm, lora_request=sync.lora_request(name)), want[name], LORA_TOL)
        # max_loras=2: a third name is refused by name, and both keep serving.
        with pytest.raises(ss.LoraError, match=r"'third' would be adapter 3 .* holds 2"):
            sync.update_lora("third", third)
        for name in ("first", "second"):
            outs = outputs(llm, lora_request=sync.lora_request(name))
            assert_close(outs, want[name], LORA_TOL)
        sync.remove_lora("second")
        assert sync.channel.loras == ("first",)
        with pytest.raises(ss.ConfigError, match="no LoRA adapter 'second'"):
            sync.lora_request("second")
        sync.update_lora("third", third)
        assert_close(
            outputs(llm, lora_request=sync.lora_request("third")),
            reference_outputs(third, ALL),
            LORA_TOL,
        )
        assert_close(
            outputs(llm, lora_request=sync.lora_request("first")),
            want["first"],
            LORA_TOL,
        )
        sync.remove_lora("first")
        sync.remove_lora("third")


def test_bad_adapters_fail_by_name_and_the_previous_one_keeps_serving(
    engine: tuple[Any, torch.nn.Module],
) -> None:
    from streamsync.vllm import WeightSync

    llm, base = engine
    model = make_peft(base, seed=6)
    config = model.peft_config["default"]
    with WeightSync(llm, "zmq+tcp://127.0.0.1:0") as sync:
        sync.update(model)
        sync.update_lora("policy", model)
        want = reference_outputs(model, ALL)
        good = adapter_tensors(model)
        q_a = next(k for k in good if "layers.0.self_attn.q_proj.lora_A" in k)
        q_b = q_a.replace("lora_A", "lora_B")
        cases: list[tuple[str, Any, Any]] = [
            # A rank above the engine's max_lora_rank (16).
            ("greater than max_lora_rank", make_peft(base, r=32, seed=7), None),
            # A module the engine's model has no LoRA layer for.
            (
                r"no LoRA layer for: 'model.layers.0.self_attn.rope_proj'",
                {
                    **good,
                    q_a.replace("q_proj", "rope_proj"): good[q_a],
                    q_b.replace("q_proj", "rope_proj"): good[q_b],
                },
                config,
            ),
            # Shapes of another base model: q_proj's A over 64 inputs, not 128.
            (
                r"'model.layers.0.self_attn.qkv_proj' \(slice 0\).* do not fit",
                {**good, q_a: good[q_a][:, :64].contiguous()},
                config,
            ),
            # lora_A and the config disagree on the rank.
            (
                "lora_A has rank 4, but the adapter's config gives it r=8",
                {**good, q_a: good[q_a][:4].contiguous(), q_b: good[q_b][:, :4].contiguous()},
                config,
            ),
        ]
        for match, adapter, cfg in cases:
            train_adapter(model, seed=99)  # the trainer moved on; the engine must not
            with pytest.raises(ss.LoraError, match=match):
                sync.update_lora("policy", adapter, config=cfg)
            got = outputs(llm, lora_request=sync.lora_request("policy"))
            assert_close(got, want, LORA_TOL)
        assert sync.channel.loras == ("policy",)
        sync.remove_lora("policy")


def test_an_engine_without_lora_is_told_by_name(tmp_path: Path) -> None:
    from streamsync.engine.blocking import run_blocking
    from streamsync.engine.channel import EngineChannel
    from streamsync.vllm import WeightSync

    base = build_tiny_model(tmp_path, "dense", seed=0)
    model = make_peft(base, seed=1)
    llm = make_llm(str(tmp_path))
    try:
        with WeightSync(llm, "zmq+tcp://127.0.0.1:0") as sync:
            with pytest.raises(ss.LoraError, match="enable_lora=True"):
                sync.update_lora("policy", model)
            # The workers say the same where the trainer cannot ask (over a server).
            channel = sync.channel
            with pytest.raises(ss.LoraError, match="enable_lora=True"):
                run_blocking(
                    channel.clients,
                    "update_lora",
                    lambda: EngineChannel.update_lora(channel, "p", model),
                )
            assert channel.loras == ()
            report = sync.update(model)  # the channel still syncs weights
            assert report.complete
    finally:
        shutdown(llm)


def test_tensor_parallel_engine_serves_each_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamsync.vllm import WeightSync

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    base = build_tiny_model(tmp_path, "dense", seed=0)
    model = make_peft(base, seed=1)
    llm = make_llm(
        str(tmp_path),
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        enable_lora=True,
        max_lora_rank=8,
        enable_prefix_caching=True,
        block_size=32,
    )
    try:
        with WeightSync(llm, f"shm://lora-tp-{os.getpid()}") as sync:
            train_base(model, seed=3)
            report = sync.update(model)
            assert report.receivers == 2
            assert all(r.missing == () for r in report.instances.values()), report
            for step in range(3):
                train_adapter(model, seed=30 + step)
                want = reference_outputs(model, ALL)
                report = sync.update_lora("policy", model)
                assert sorted(report.instances) == ["worker0", "worker1"]
                request = sync.lora_request("policy")
                assert_close(outputs(llm, lora_request=request), want, LORA_TOL)
                tokens, _ = cached_greedy(llm, [LONG_PROMPT], lora_request=request)
                assert tokens == [want.tokens[-1]]
            assert_close(outputs(llm), base_outputs(model), BASE_TOL)
            # Each worker checks the slices it will hold: A of o_proj (row parallel) is
            # split across the workers, A of q_proj (column parallel) is not.
            good = adapter_tensors(model)
            config = model.peft_config["default"]
            for module in ("self_attn.q_proj", "self_attn.o_proj"):
                key = next(k for k in good if f"layers.1.{module}.lora_A" in k)
                bad = {**good, key: good[key][:, :64].contiguous()}
                with pytest.raises(ss.LoraError, match="do not fit"):
                    sync.update_lora("policy", bad, config=config)
                assert_close(outputs(llm, lora_request=request), want, LORA_TOL)
    finally:
        shutdown(llm)


def test_the_server_receives_adapters_with_no_disk(tmp_path: Path) -> None:
    """vLLM's OpenAI server with the streamsync backend and runtime LoRA updates: the native
    trainer engine sends the base, then three adapter versions; completions name the adapter
    as vLLM's server does (``"model": name``). A bad adapter fails by name and the previous
    version keeps serving."""
    from server_harness import start_server, stop_server, trainer_engine

    base = build_tiny_model(tmp_path / "model", "dense", seed=0)
    model = make_peft(base, seed=1)
    server = start_server(
        tmp_path / "model",
        tmp_path,
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--max-loras",
        "2",
        "--enable-prefix-caching",
        "--block-size",
        "32",
        env_extra={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    engine = None
    try:
        engine = trainer_engine(server, None)
        train_base(model, seed=2)
        server.post("pause", params={"mode": "keep"})
        engine.send_weights(model)  # the peft model's base, under the base checkpoint's names
        server.post("resume")
        want_base = base_outputs(model).tokens
        assert server.greedy_tokens(ALL) == want_base
        for step in range(3):
            train_adapter(model, seed=40 + step)
            want = reference_outputs(model, ALL).tokens
            report = engine.send_lora("policy", model)
            assert report is not None and report.lora is not None
            assert report.lora.name == "policy" and report.lora.path.startswith("/streamsync-lora/")
            assert "policy" in {m["id"] for m in server.get("v1/models")["data"]}
            assert server.greedy_tokens(ALL, model="policy") == want, f"step {step}"
            assert server.greedy_tokens(ALL) == want_base
        with pytest.raises(ss.LoraError, match="greater than max_lora_rank"):
            engine.send_lora("policy", make_peft(base, r=32, seed=9))
        assert server.greedy_tokens(ALL, model="policy") == want
        engine.remove_lora("policy")
        assert "policy" not in {m["id"] for m in server.get("v1/models")["data"]}
    finally:
        if engine is not None:
            engine.shutdown()
        stop_server(server)


@pytest.mark.slow
def test_an_async_llm_in_its_own_process_serves_each_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's default multi-process ``AsyncLLM``, from its event loop: ``add_lora`` crosses
    to the engine core, and the adapter to the worker over the transport."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from streamsync.vllm import WeightSync

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    base = build_tiny_model(tmp_path / "model", "dense", seed=0)
    model = make_peft(base, seed=1)
    args = AsyncEngineArgs(
        model=str(tmp_path / "model"),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=4,
        seed=0,
        enable_lora=True,
        max_lora_rank=8,
        worker_extension_cls="streamsync.vllm.WorkerExtension",
    )

    async def start() -> Any:
        return AsyncLLM.from_engine_args(args)

    llm = TRAINER.run(start, timeout=300)

    async def generate(lora_request: Any) -> Outputs:
        import uuid

        results = []
        for prompt in ALL:
            final = None
            request = {"prompt_token_ids": prompt}
            async for out in llm.generate(
                request, sampling(), str(uuid.uuid4()), lora_request=lora_request
            ):
                final = out
            results.append(final)
        return outputs_from(results)

    async def steps() -> None:
        async with WeightSync(llm, f"shm://lora-async-{os.getpid()}") as sync:
            await sync.update(model)
            assert_close(await generate(None), base_outputs(model), BASE_TOL)
            for step in range(2):
                train_adapter(model, seed=60 + step)
                report = await sync.update_lora("policy", model)
                assert report.lora is not None and report.lora.in_flight == 0
                got = await generate(sync.lora_request("policy"))
                assert_close(got, reference_outputs(model, ALL), LORA_TOL)

    try:
        TRAINER.run(steps, timeout=600)
    finally:
        import gc

        llm.shutdown()
        llm = None
        gc.collect()


def test_a_workers_store_answers_its_own_engines_loads_only_while_it_lives() -> None:
    # Two workers in one process (in-process engines): each store answers vLLM's loader for
    # its own LoRA layers, the other's loads go on to vLLM (which finds nothing on disk),
    # and a store gone with its worker answers nothing. Nothing is written onto vLLM's
    # managers: they are plain objects here with only what vLLM's loader reads.
    import gc
    from types import SimpleNamespace

    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager

    from streamsync.lora import lora_id, version_path
    from streamsync.vllm.lora import LoraEngine, LoraStore, _Version

    def worker() -> tuple[Any, LoraStore, Any]:
        layers = SimpleNamespace(supported_lora_modules=[], packed_modules_mapping={})
        manager = SimpleNamespace(_adapter_manager=layers, max_position_embeddings=None)
        store = LoraStore(LoraEngine(layers, None, None, None))
        adapter = SimpleNamespace()
        store.stage("a", 3, _Version({}, {}, built=adapter), keep=())
        return manager, store, adapter

    (manager_1, store_1, adapter_1), (manager_2, store_2, adapter_2) = worker(), worker()
    request = LoRARequest("a", lora_id("a"), version_path("a", 3), load_inplace=True)
    assert WorkerLoRAManager._load_adapter(manager_1, request) is adapter_1
    assert WorkerLoRAManager._load_adapter(manager_2, request) is adapter_2
    assert adapter_1.id == adapter_2.id == lora_id("a")
    assert store_1.held() == store_2.held() == ["a"]
    assert vars(manager_1).keys() == {"_adapter_manager", "max_position_embeddings"}
    del store_2
    gc.collect()
    with pytest.raises(LoRAAdapterNotFoundError):
        WorkerLoRAManager._load_adapter(manager_2, request)
