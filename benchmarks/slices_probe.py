"""Learn which slice of which checkpoint tensor each worker of a TP=2 CPU vLLM engine reads,
and prove it bit for bit. The research behind ``docs/design/sharded.md``.

Run from the repository root (two cores, a few minutes; figures in the design doc)::

    .venv/bin/python benchmarks/slices_probe.py [--kinds dense,tied,moe] [--dtype float32]

For each model kind it builds a tiny random-weight Qwen3 (:mod:`streamsync.testing.models`),
starts a CPU engine with ``tensor_parallel_size=2`` and runs :func:`learn_and_check` on each
worker through ``collective_rpc``:

1. **Learn.** vLLM's own bake, as ``sharded_rdt`` runs it at init: the model's layers go to
   meta in checkpoint layout (``initialize_layerwise_reload``), each loader is stamped with
   its module, and ``model.load_weights`` is driven with one ``FakeRDTTensor`` per checkpoint
   tensor. Each ``copy_`` records a scatter: the source's op chain and the destination's
   ``as_strided`` region. Fed one name at a time, so a loader the fakes cannot follow costs
   only that name (it would be sent whole). The model is restored afterwards.
2. **Describe.** Each op chain is replayed on an index tensor (``arange`` in the checkpoint
   tensor's shape): the flat source index each destination element reads. From it, a box
   (start, stop per dim) where the slice is one, and the union of elements the worker needs.
3. **Check.** The layers are materialised in checkpoint layout, the unwrapped loaders load
   the real checkpoint, and the result is kept; the layers are restored. A fresh tensor per
   parameter is filled only from the learned slices of the same checkpoint and compared bit
   for bit with what the loaders wrote, with the elements no slice covered counted.

The engine then generates, to show the probe left it serving.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

#: Model kinds: (``build_tiny_model`` kind, tied).
KINDS = {"dense": ("dense", False), "tied": ("dense", True), "moe": ("moe", False)}


def learn_and_check(worker: Any, path: str) -> dict[str, Any]:
    """On one worker: learn the slices, check them against its loaders; a plain summary."""
    import glob

    import torch
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.sharded_rdt_engine import (
        ShardedRDTWeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.meta import materialize_layer
    from vllm.model_executor.model_loader.reload.utils import get_layer_size, get_layer_tensors

    model = worker.model_runner.get_model()
    ckpt: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        ckpt.update(load_file(file))
    # Another step's weights than the engine's, so no slice can pass by matching old values.
    gen = torch.Generator().manual_seed(1)
    for t in ckpt.values():
        if t.is_floating_point():
            t.add_(torch.randn(t.shape, generator=gen).to(t.dtype), alpha=0.01)
    if not any(m in layerwise.LAYERWISE_INFO for m in model.modules()):
        layerwise.record_metadata_for_reloading(model)
    prefix_of = {m: p for p, m in model.named_modules()}
    # vLLM's engine class lends its bake helpers; nothing of its Ray side is touched.
    bake = object.__new__(ShardedRDTWeightTransferEngine)
    bake.model, bake.device = model, torch.device("cpu")
    bake._name_meta = {
        n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in ckpt.items()
    }

    # 1. Learn (the body of ShardedRDTWeightTransferEngine._bake, one name at a time).
    recorder, unlearned = BakeSink(), {}
    start = time.perf_counter()
    layerwise.initialize_layerwise_reload(model)
    bake._install_recording_stamps(model, recorder)
    try:
        for name, fake in bake._build_fake_weights(list(ckpt), recorder, bake.device):
            try:
                model.load_weights([(name, fake)])
            except NotImplementedError as exc:
                unlearned[name] = str(exc).splitlines()[0][:160]
    finally:
        bake._restore_after_dry_run(model)
    learn_s = time.perf_counter() - start
    scatters, partial = [], []
    for layer, copies in recorder.copies_by_layer.items():
        copied = sum(_numel(c.shape) for c in copies if c is not None)
        if any(c is None for c in copies) or copied < get_layer_size(layer):
            partial.append(prefix_of[layer])
            continue
        scatters.extend(copies)
    never_copied = sorted(set(ckpt) - recorder.copied_names - set(unlearned))

    # 2. Describe: the source elements each scatter reads.
    needed = {n: torch.zeros(t.numel(), dtype=torch.bool) for n, t in ckpt.items()}
    slices: dict[str, list[str]] = {}
    for sc in scatters:
        name, ops = sc.src
        index = _replay(torch.arange(ckpt[name].numel()).view(ckpt[name].shape), ops)
        needed[name][index.reshape(-1)] = True
        slices.setdefault(name, []).append(
            f"{_box(index, ckpt[name].shape)} -> {prefix_of[sc.layer]}.{sc.param_name}"
            f"[offset {sc.offset}, shape {tuple(sc.shape)}]"
        )

    # 3. Check: what the unwrapped loaders write in checkpoint layout, from the real tensors.
    layerwise.initialize_layerwise_reload(model)
    try:
        for layer in model.modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                materialize_layer(layer, info)
                # NaN where no loader writes, so a slice that claims such an element fails.
                for t in get_layer_tensors(layer).values():
                    if t.is_floating_point() and not t.is_meta:
                        t.data.fill_(float("nan"))
        bake._install_recording_stamps(model, BakeSink())
        model.load_weights(list(ckpt.items()))
        held = {
            (layer, name): t.detach().clone()
            for layer in model.modules()
            for name, t in get_layer_tensors(layer).items()
            if not t.is_meta
        }
    finally:
        bake._restore_after_dry_run(model)
    built: dict[tuple[Any, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for sc in scatters:
        want = held[(sc.layer, sc.param_name)]
        if (sc.layer, sc.param_name) not in built:
            built[(sc.layer, sc.param_name)] = (
                torch.empty_strided(want.shape, want.stride(), dtype=want.dtype),
                torch.empty_strided(want.shape, want.stride(), dtype=torch.bool).fill_(False),
            )
        fresh, covered = built[(sc.layer, sc.param_name)]
        fresh.as_strided(sc.shape, sc.stride, sc.offset).copy_(_replay(ckpt[sc.src[0]], sc.src[1]))
        covered.as_strided(sc.shape, sc.stride, sc.offset).fill_(True)
    mismatched, uncovered = [], []
    for (layer, pname), (fresh, covered) in built.items():
        want = held[(layer, pname)]
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.itemsize]
        if not torch.equal(fresh.view(bits)[covered], want.view(bits)[covered]):
            mismatched.append(f"{prefix_of[layer]}.{pname}")
        if not bool(covered.all()):
            uncovered.append(f"{prefix_of[layer]}.{pname} ({int((~covered).sum())} elements)")

    return {
        "rank": worker.rank,
        "learn_s": learn_s,
        "tensors": sum(bool(m.any()) for m in needed.values()),
        "slices": len(scatters),
        "needed": {n: int(m.sum()) for n, m in needed.items()},
        "itemsize": {n: t.itemsize for n, t in ckpt.items()},
        "numel": {n: t.numel() for n, t in ckpt.items()},
        "slice_list": slices,
        "unlearned": unlearned,
        "partial": partial,
        "never_copied": never_copied,
        "checked": len(built),
        "mismatched": mismatched,
        "uncovered": uncovered,
    }


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _replay(tensor: Any, ops: tuple[Any, ...]) -> Any:
    """A recorded op chain applied to ``tensor``, as the trainer side replays it."""
    for op, args, kwargs in ops:
        tensor = getattr(tensor, op)(*args, **dict(kwargs))
    return tensor


def _box(index: Any, shape: tuple[int, ...]) -> str:
    """``[a:b, c:d]`` when the source elements ``index`` reads form one box read once in
    row-major order (a slice a sender can cut with ``narrow``), else a general index map."""
    import torch

    flat = index.reshape(-1)
    coords = torch.stack(torch.unravel_index(flat, tuple(shape)), dim=-1)
    lo, hi = coords.min(0).values, coords.max(0).values + 1
    box = [(int(a), int(b)) for a, b in zip(lo, hi, strict=True)]
    ordered = flat.numel() == _numel(tuple(b - a for a, b in box)) and bool(
        (flat.diff() > 0).all() if flat.numel() > 1 else True
    )
    text = "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"
    return text if ordered else f"index map {flat.numel()} elements in {text}"


def run_kind(kind: str, dtype: str, verbose: bool) -> bool:
    """Build the model, start the engine, probe both workers and print the findings."""
    import torch
    from vllm import LLM, SamplingParams

    from streamsync.testing.models import build_tiny_model

    model_kind, tied = KINDS[kind]
    with tempfile.TemporaryDirectory(prefix=f"slices-{kind}-") as path:
        build_tiny_model(path, model_kind, tied=tied, dtype=getattr(torch, dtype))
        llm = LLM(
            model=path,
            dtype=dtype,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            block_size=32,
            max_model_len=256,
            max_num_seqs=4,
            enforce_eager=True,
            seed=0,
        )
        try:
            results = llm.collective_rpc(learn_and_check, args=(path,))
            prompt = {"prompt_token_ids": [5, 6, 7, 8]}
            out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
            serving = len(out[0].outputs[0].token_ids) == 4
        finally:
            llm.llm_engine.engine_core.shutdown()
    return report(kind, results, serving, verbose)


def report(kind: str, results: list[dict[str, Any]], serving: bool, verbose: bool) -> bool:
    """Print per worker what it reads; True when every learned slice checked bit-equal."""
    first = results[0]
    size = {n: first["numel"][n] * first["itemsize"][n] for n in first["numel"]}
    whole = sum(size.values())
    # A tensor every worker reads whole is replicated: any sender may send it once per worker.
    replicated = {n for n in size if all(r["needed"][n] == r["numel"][n] for r in results)}
    print(f"\n== {kind}: {len(size)} checkpoint tensors, {whole / 1024:.0f} KiB")
    ok = serving
    for r in results:
        need = sum(r["needed"][n] * r["itemsize"][n] for n in size)
        rep = sum(size[n] for n in replicated)
        print(
            f"worker {r['rank']}: learned in {r['learn_s']:.2f} s; reads {r['tensors']} "
            f"tensors through {r['slices']} slices; needs {need / 1024:.0f} KiB of "
            f"{whole / 1024:.0f} KiB ({need / whole:.1%}), of which replicated "
            f"{rep / 1024:.0f} KiB; sharded part {(need - rep) / max(whole - rep, 1):.1%} "
            f"of the sharded tensors"
        )
        print(
            f"  checked {r['checked']} parameters: {len(r['mismatched'])} mismatched, "
            f"{len(r['uncovered'])} not fully covered; unlearned {len(r['unlearned'])}, "
            f"partial modules {len(r['partial'])}, never copied {len(r['never_copied'])}"
        )
        for label in ("mismatched", "uncovered", "partial", "never_copied"):
            for item in r[label]:
                print(f"  {label}: {item}")
        for name, why in r["unlearned"].items():
            print(f"  unlearned: {name}: {why}")
        ok = ok and not r["mismatched"] and not r["uncovered"] and not r["unlearned"]
        if verbose:
            for name, lines in sorted(r["slice_list"].items()):
                for line in lines:
                    print(f"    {name} {line}")
    union = sum(size[n] for n in size if any(r["needed"][n] for r in results))
    print(f"engine serves after probing: {serving}; union of needs {union / whole:.1%}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="dense,tied", help=f"of {', '.join(KINDS)}")
    parser.add_argument("--dtype", default="float32", help="checkpoint and engine dtype")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every slice")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # a function over RPC
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, not a share of the host
    results = {kind: run_kind(kind, args.dtype, args.verbose) for kind in args.kinds.split(",")}
    print("\n" + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in results.items()))
    raise SystemExit(0 if all(results.values()) else 1)


if __name__ == "__main__":
    main()
