"""A sharded channel's receiver on a real TP=2 CPU vLLM engine: each worker's ``VllmSink``
with ``slices=slices_of(its needs)``, fed only the box of each tensor it reads in part (one
tensor per load, so layers straddle loads), serves exactly what a whole-tensor load of the
same weights serves; a box one row short fails by the tensor's name."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_harness import PROMPTS, engine_outputs, make_llm, shutdown

from streamsync.testing.models import build_tiny_model, perturb

pytestmark = pytest.mark.vllm


def _sink_load(worker: Any, tensors: dict[str, torch.Tensor], form: str) -> dict[str, Any]:
    """On a worker: one sync of ``tensors`` through a ``VllmSink``, whole (``"whole"``), only
    the boxes this worker's needs name (``"boxes"``), or those boxes with one a row short
    (``"short"``, whose failure is returned, the sync aborted)."""
    from streamsync.boxes import slices_of
    from streamsync.errors import ReceiverFailedError
    from streamsync.vllm.sink import VllmSink, WorkerModels, model_instances
    from streamsync.vllm.slices import worker_needs

    models = WorkerModels(model_instances(worker), worker.vllm_config, worker.streamsync_state)
    slices = dict(slices_of(worker_needs(models))) if form != "whole" else {}
    short = None
    if form == "short":
        short = sorted(slices)[0]
        box, whole = slices[short]
        d = next(d for d, n in enumerate(whole) if box.stop[d] - box.start[d] < n)
        stop = (*box.stop[:d], box.stop[d] - 1, *box.stop[d + 1 :])
        slices[short] = (type(box)(box.start, stop), whole)
    sink = VllmSink(
        models.instances, vllm_config=models.vllm_config, state=models.state, slices=slices
    )
    sink.prepare()
    try:
        for name, tensor in tensors.items():
            if name in slices:
                box = slices[name][0]
                tensor = tensor[tuple(map(slice, box.start, box.stop))].clone()
            sink.load([(name, tensor)])
        missing = sink.finalize().missing
    except ReceiverFailedError as exc:
        sink.abort()
        return {"error": str(exc), "short": short}
    return {"boxed": sorted(slices), "missing": list(missing)}


@pytest.mark.parametrize("tied", [False, True], ids=["dense", "tied"])
def test_each_worker_loads_only_its_boxes(
    tied: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cloudpickle

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # a function over RPC
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    trainer = build_tiny_model(tmp_path, "dense", seed=0, tied=tied)
    weights = []
    for seed in (1, 2):
        perturb(trainer, seed=seed)
        weights.append({n: t.detach().clone() for n, t in trainer.named_parameters()})
    # What TP splits: each layer's q, o, gate, up and down projections and the vocabulary
    # (k and v are replicated: one kv head is fewer than two ranks).
    split = {
        n
        for n in weights[0]
        if any(f"{p}_proj." in n for p in ("q", "o", "gate", "up", "down"))
        or n in ("model.embed_tokens.weight", "lm_head.weight")
    }
    llm = make_llm(str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        first = llm.collective_rpc(_sink_load, args=(weights[0], "whole"))
        assert all(r == {"boxed": [], "missing": []} for r in first), first
        whole = engine_outputs(llm, PROMPTS)
        llm.collective_rpc(_sink_load, args=(weights[1], "whole"))
        other = engine_outputs(llm, PROMPTS)
        assert other.prompt_logprobs != whole.prompt_logprobs
        boxed = llm.collective_rpc(_sink_load, args=(weights[0], "boxes"))
        assert engine_outputs(llm, PROMPTS) == whole
        for result in boxed:
            assert result["missing"] == [], result
            assert set(result["boxed"]) == split, result
        failed = llm.collective_rpc(_sink_load, args=(weights[1], "short"))
        for result in failed:
            assert repr(result["short"]) in result["error"], result
            assert "received only" in result["error"], result
    finally:
        shutdown(llm)
