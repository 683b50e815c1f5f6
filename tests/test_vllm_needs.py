"""What each worker of a real TP=2 CPU vLLM engine reads (``WeightSync(..., sharded=True)``):
each worker needs half of each TP-split tensor and all of each replicated one, the model is
left as it was by learning, and an engine given only each worker's boxes (NaN elsewhere)
serves the trainer's logprobs, so the boxes hold everything the loaders read."""

from __future__ import annotations

import os
import sys
import time
from math import prod
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_harness import (
    PROMPTS,
    assert_matches,
    engine_outputs,
    make_llm,
    reference_outputs,
    shutdown,
)

import streamsync as ss
from streamsync.facts import Needs
from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm


def _load_only_the_boxes(worker: Any, tensors: dict[str, torch.Tensor]) -> int:
    """On a worker: a layerwise reload of ``tensors`` with every element outside the boxes
    this worker learned set to NaN; the bytes it kept."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import layerwise

    needs = {n.name: n for n in worker.streamsync_state.needs["main"].needs}
    given, kept = {}, 0
    for name, tensor in tensors.items():
        masked = torch.full_like(tensor, float("nan"))
        need = needs.get(name)
        if need is not None:
            box = need.box
            index = (...,) if box is None else tuple(map(slice, box.start, box.stop))
            masked[index] = tensor[index]
            kept += masked[index].numel() * tensor.itemsize
        given[name] = masked
    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        layerwise.initialize_layerwise_reload(model)
        model.load_weights(list(given.items()))
        layerwise.finalize_layerwise_reload(model, worker.model_config)
    return kept


def _kept(worker: Any) -> int:
    """On a worker: the identity of the needs it keeps for its main model."""
    return id(worker.streamsync_state.needs["main"])


def _nbytes(shape: tuple[int, ...], itemsize: int = 4) -> int:
    return prod(shape) * itemsize


def test_each_worker_of_a_tp2_engine_says_what_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cloudpickle

    from streamsync.vllm import WeightSync

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # a function over RPC
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = build_tiny_model(tmp_path, "dense", seed=0)
    shapes = {n: tuple(p.shape) for n, p in trainer.state_dict().items()}
    llm = make_llm(str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        before = engine_outputs(llm, PROMPTS)
        start = time.perf_counter()
        llm.collective_rpc("streamsync_needs")  # learns
        learned_s = time.perf_counter() - start
        kept_first = llm.collective_rpc(_kept)
        after = engine_outputs(llm, PROMPTS)
        assert after.tokens == before.tokens and after.max_logprob_diff(before) == 0
        with WeightSync(llm, f"shm://needs-tp-{os.getpid()}", sharded=True) as sync:
            needs: dict[str, Needs] = dict(sync.needs)
            assert llm.collective_rpc(_kept) == kept_first  # the same layout: not learned again
            assert sorted(needs) == ["worker0.main", "worker1.main"]
            by_worker = [{n.name: n for n in needs[f"worker{w}.main"].needs} for w in (0, 1)]
            assert all(set(b) == set(shapes) for b in by_worker)
            assert needs["worker0.main"].layout != needs["worker1.main"].layout
            for name, shape in shapes.items():
                boxes = [b[name].box for b in by_worker]
                assert all(b[name].shape == shape and not b[name].why_whole for b in by_worker)
                if "norm" in name or "k_proj" in name or "v_proj" in name:
                    # Replicated: norms, and k/v as one kv head is fewer than two ranks.
                    assert boxes == [None, None], name
                    continue
                assert None not in boxes, name
                # Each worker half of it, the two together all of it.
                assert [prod(b.shape) for b in boxes] == [prod(shape) // 2] * 2, name  # type: ignore[union-attr]
                assert boxes[0] != boxes[1], name
            perturb(trainer, seed=1)
            tensors = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
            kept = llm.collective_rpc(_load_only_the_boxes, args=(tensors,))
            assert_matches(engine_outputs(llm, PROMPTS), reference_outputs(trainer, PROMPTS))
            perturb(trainer, seed=2)
            report = sync.update(ss.named_tensors(trainer))
            assert report.complete and report.receivers == 2
            assert_matches(engine_outputs(llm, PROMPTS), reference_outputs(trainer, PROMPTS))
    finally:
        shutdown(llm)
    whole = sum(_nbytes(s) for s in shapes.values())
    replicated = sum(
        _nbytes(s) for n, s in shapes.items() if all(b[n].box is None for b in by_worker)
    )
    for w, need in enumerate(kept):
        assert need == (whole - replicated) // 2 + replicated
        print(
            f"worker {w} needs {need / 1024:.0f} KiB of {whole / 1024:.0f} KiB "
            f"({need / whole:.1%}; replicated {replicated / 1024:.0f} KiB); "
            f"learned in {learned_s:.2f} s"
        )
