"""Tied embeddings into the CPU build of vLLM, from every kind of source.

A Qwen3 with ``tie_word_embeddings=True`` (Qwen3-0.6B, Llama-3.2-1B, Gemma have this layout)
holds one parameter under two names, ``model.embed_tokens.weight`` and ``lm_head.weight``,
and each name's layer processes its own copy during a reload (the CPU build packs
``lm_head`` for its GEMM). ``named_parameters()`` (and FSDP2, and vLLM's ``ModuleSource``)
yield that parameter once; a state dict yields it twice; a user's generator may yield the
head first. Every source must leave the engine serving the trainer's weights.

Prefix caching is on with 32-token blocks, and a prompt longer than two blocks is asked
before and after every sync through the cache, so KV computed on old weights would show.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_harness import (
    LONG_PROMPT,
    PROMPTS,
    TRAINER,
    assert_matches,
    cached_greedy,
    engine_outputs,
    make_llm,
    reference_outputs,
    shutdown,
)

import streamsync as ss
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm

ALL = [*PROMPTS, LONG_PROMPT]


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, torch.nn.Module]]:
    path = tmp_path_factory.mktemp("tied")
    trainer = build_tiny_model(path, "dense", seed=0, tied=True)
    assert trainer.lm_head.weight is trainer.model.embed_tokens.weight
    llm = make_llm(str(path), enable_prefix_caching=True, block_size=32)
    yield llm, trainer
    shutdown(llm)


def push(llm: Any, weights: Any, tag: str) -> ss.SyncReport:
    from streamsync.vllm import update_weights

    async def main() -> ss.SyncReport:
        return await update_weights(
            llm,
            ss.named_tensors(weights),
            endpoint=f"shm://tied-{tag}-{os.getpid()}",
            bucket_bytes=256 << 10,
        )

    return TRAINER.run(main, timeout=300)


def sources(trainer: torch.nn.Module) -> dict[str, Any]:
    params = [(n, p.detach()) for n, p in trainer.named_parameters()]
    head = trainer.lm_head.weight.detach()
    return {
        "named_parameters": params,
        "state_dict": trainer.state_dict(),
        "head_first": [("lm_head.weight", head), *[p for p in params if "embed" not in p[0]]],
    }


def check_round(llm: Any, trainer: torch.nn.Module, source: str, seed: int) -> None:
    """One round: the long prompt through the cache (filling it), a perturbation, a sync
    from ``source``, then every prompt (the long one through the cache again) verified."""
    cached_greedy(llm, [LONG_PROMPT])
    perturb(trainer, seed=seed)
    want = reference_outputs(trainer, ALL)
    report = push(llm, sources(trainer)[source], f"{source}-{seed}")
    main = report.instances["worker0.main"]
    assert main.missing == () and "lm_head.weight" in main.loaded, main
    assert_matches(engine_outputs(llm, ALL), want)
    tokens, _ = cached_greedy(llm, [LONG_PROMPT])
    assert tokens == [want.tokens[-1]]


@pytest.mark.parametrize("source", ["named_parameters", "state_dict", "head_first"])
def test_tied_model_from_every_source(tied: tuple[Any, torch.nn.Module], source: str) -> None:
    llm, trainer = tied
    before = engine_outputs(llm, ALL)
    for step in range(3):
        check_round(llm, trainer, source, seed=10 * step + len(source))
    assert engine_outputs(llm, ALL).tokens != before.tokens  # the syncs changed something


def test_the_cache_is_consulted(tied: tuple[Any, torch.nn.Module]) -> None:
    """The long prompt asked twice without a sync between comes from cached blocks: the
    rounds above would have served stale KV had a sync not reset the cache."""
    llm, _ = tied
    cached_greedy(llm, [LONG_PROMPT])
    _, cached = cached_greedy(llm, [LONG_PROMPT])
    assert cached >= 64


def test_different_values_under_tied_names_fail_by_name(
    tied: tuple[Any, torch.nn.Module],
) -> None:
    llm, trainer = tied
    state = {k: v.clone() for k, v in trainer.state_dict().items()}
    state["lm_head.weight"] += 1.0
    with pytest.raises(
        ss.ReceiverFailedError,
        match=r"ties 'lm_head\.weight' to 'model\.embed_tokens\.weight'.*different values",
    ):
        push(llm, state, "untied")
    check_round(llm, trainer, "named_parameters", seed=77)  # serving, and takes the next


def test_a_layer_given_part_of_its_weights_fails_by_name(
    tied: tuple[Any, torch.nn.Module],
) -> None:
    """gate_proj without up_proj: vLLM would process the fused layer with the up half on
    fresh memory. The sync fails naming the missing shard before anything is processed."""
    llm, trainer = tied
    perturb(trainer, seed=78)
    partial = {k: v for k, v in trainer.state_dict().items() if "layers.0.mlp.up_proj" not in k}
    with pytest.raises(
        ss.ReceiverFailedError,
        match=r"layer 'model\.layers\.0\.mlp\.gate_up_proj'.*gate_up_proj\.weight \(shards 1\)",
    ):
        push(llm, partial, "partial")
    assert len(engine_outputs(llm, ALL).tokens) == len(ALL)  # still serving
    check_round(llm, trainer, "state_dict", seed=79)


def test_an_untied_model_is_not_tied_by_the_sink(tmp_path: Path) -> None:
    """The sink ties only what the engine ties: an untied model's head keeps its own
    values (the other real-engine tests sync untied models; this one checks the report)."""
    from streamsync.vllm.sink import tied_names

    model = build_tiny_model(tmp_path / "untied", "dense", seed=0)
    assert tied_names(model) == {}
    tied_model = build_tiny_model(tmp_path / "tied", "dense", seed=0, tied=True)
    assert tied_names(tied_model) == {
        "model.embed_tokens.weight": ("lm_head.weight",),
        "lm_head.weight": ("model.embed_tokens.weight",),
    }
