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
   only that name (it would be sent whole). A module recorded short of its size (a loader
   that fills padding) is kept, as the receiver runs that loader. The model is restored
   afterwards.
2. **Describe.** Each op chain is replayed on an index tensor (``arange`` in the checkpoint
   tensor's shape): the flat source index each destination element reads. From it, a box
   (start, stop per dim) where the slice is one, and the union of elements the worker needs.
3. **Check.** The layers are materialised in checkpoint layout and filled with NaN, the
   unwrapped loaders load a checkpoint other than the engine's, and the result is kept; the
   layers are restored. A fresh tensor per parameter is filled only by replaying the learned
   slices on what the worker would receive (its needed elements, NaN elsewhere) and compared
   bit for bit with what the loaders wrote; elements no slice covers must be the loader's
   own zero fill.
4. **Receive.** Three layerwise reloads as streamsync's ``LayerwiseReload`` lifecycle runs
   them (``load_weights``, then vLLM processes each layer into its kernel layout): of the
   whole tensors, of zeros, and of each tensor a worker reads only in part as a
   :class:`BoxTensor` (the whole tensor's shape around only the received box). After each,
   the engine's greedy tokens and prompt logprobs: the boxes' must equal the whole
   tensors' exactly, and the zeros' must differ. (On CPU, vLLM keeps linear weights only
   in its packed GEMM handles, so the outputs are the comparison to make.)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

#: Model kinds: (``build_tiny_model`` kind, tied).
KINDS = {
    "dense": ("dense", False, None),
    "tied": ("dense", True, None),
    "moe": ("moe", False, None),
    # A vocabulary vLLM pads (to a multiple of 64): the last worker's padded rows are filled.
    "padded": ("dense", False, 500),
    # 16 layers, 200M parameters: what learning costs on a model of some size.
    "dense-400m": ("dense-400m", False, None),
}


def learn_and_check(worker: Any, path: str) -> dict[str, Any]:
    """On one worker: learn the slices, check them against its loaders; a plain summary."""
    ckpt, bake, learned, needed = _learned(worker, path)
    prefix_of = {m: p for p, m in bake.model.named_modules()}
    slices: dict[str, list[str]] = {}
    for sc in learned["scatters"]:
        name, ops = sc.src
        index = _replay(torch.arange(ckpt[name].numel()).view(ckpt[name].shape), ops)
        slices.setdefault(name, []).append(
            f"{_box(index, ckpt[name].shape)} -> {prefix_of[sc.layer]}.{sc.param_name}"
            f"[offset {sc.offset}, shape {tuple(sc.shape)}]"
        )
    # What the worker would receive: its needed elements; NaN (or -1) everywhere else.
    received = {}
    for n, t in ckpt.items():
        flat = t.reshape(-1).clone()
        flat[~needed[n]] = float("nan") if t.is_floating_point() else -1
        received[n] = flat.view(t.shape)
    return {
        "rank": worker.rank,
        "learn_s": learned["seconds"],
        "tensors": sum(bool(m.any()) for m in needed.values()),
        "slices": len(learned["scatters"]),
        "needed": {n: int(m.sum()) for n, m in needed.items()},
        "itemsize": {n: t.itemsize for n, t in ckpt.items()},
        "numel": {n: t.numel() for n, t in ckpt.items()},
        "slice_list": slices,
        "unlearned": learned["unlearned"],
        "partial": learned["partial"],
        "never_copied": learned["never_copied"],
        **_check(learned["scatters"], _loaded(bake, ckpt), received, prefix_of),
    }


def reload_from(worker: Any, path: str, form: str) -> int:
    """A layerwise reload, as streamsync's ``LayerwiseReload`` lifecycle runs it
    (``load_weights``, then vLLM processes each layer into its kernel layout), of the probe's
    checkpoint as ``"whole"`` tensors, as ``"zeros"``, or as ``"boxes"``: each tensor the
    worker reads only in part as a :class:`BoxTensor` holding just that part. The number of
    tensors given as boxes."""
    from vllm.model_executor.model_loader.reload import layerwise

    ckpt, bake, _, needed = _learned(worker, path)
    tensors = {n: torch.zeros_like(t) if form == "zeros" else t for n, t in ckpt.items()}
    boxed = 0
    if form == "boxes":
        for n, t in ckpt.items():
            box = _bounding_box(needed[n].view(t.shape))
            if box is not None:
                tensors[n], boxed = _box_tensor(n, t, box), boxed + 1
    layerwise.initialize_layerwise_reload(bake.model)
    bake.model.load_weights(list(tensors.items()))
    layerwise.finalize_layerwise_reload(bake.model, worker.model_config)
    return boxed


def _learned(worker: Any, path: str) -> tuple[dict[str, Any], Any, dict[str, Any], Any]:
    """The probe's checkpoint (another step's weights than the engine's, so no slice passes
    by matching old values), vLLM's bake helpers bound to the worker's model, what they
    learn, and per checkpoint tensor the flat mask of the elements this worker reads."""
    import glob

    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.sharded_rdt_engine import (
        ShardedRDTWeightTransferEngine,
    )
    from vllm.model_executor.model_loader.reload import layerwise

    model = worker.model_runner.get_model()
    ckpt: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        ckpt.update(load_file(file))
    gen = torch.Generator().manual_seed(1)
    for t in ckpt.values():
        if t.is_floating_point():
            t.add_(torch.randn(t.shape, generator=gen).to(t.dtype), alpha=0.01)
    if not any(m in layerwise.LAYERWISE_INFO for m in model.modules()):
        layerwise.record_metadata_for_reloading(model)
    # vLLM's engine class lends its bake helpers; nothing of its Ray side is touched.
    bake = object.__new__(ShardedRDTWeightTransferEngine)
    bake.model, bake.device = model, torch.device("cpu")
    bake._name_meta = {
        n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in ckpt.items()
    }
    learned = _learn(bake, ckpt, {m: p for p, m in model.named_modules()})
    needed = {n: torch.zeros(t.numel(), dtype=torch.bool) for n, t in ckpt.items()}
    for sc in learned["scatters"]:
        name, ops = sc.src
        index = _replay(torch.arange(ckpt[name].numel()).view(ckpt[name].shape), ops)
        needed[name][index.reshape(-1)] = True
    return ckpt, bake, learned, needed


def _learn(bake: Any, ckpt: dict[str, Any], prefix_of: dict[Any, str]) -> dict[str, Any]:
    """The body of ``ShardedRDTWeightTransferEngine._bake``, one name at a time and with the
    model restored whatever happens: the scatters of every module whose copies were all
    attributed, the names a loader refused (``_UnsupportedFakeOp``), the modules recorded
    short of their size (vLLM drops them; here they are kept, because the receiver runs the
    loader, which writes the rest itself), and the names no loader copied (another rank's
    experts)."""
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.utils import get_layer_size

    model, recorder, unlearned = bake.model, BakeSink(), {}
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
    scatters, partial = [], []
    for layer, copies in recorder.copies_by_layer.items():
        copied = sum(_numel(c.shape) for c in copies if c is not None)
        if any(c is None for c in copies):
            unlearned[prefix_of[layer]] = "a copy_ outside a stamped loader"
            continue
        if copied < get_layer_size(layer):
            partial.append(f"{prefix_of[layer]} ({get_layer_size(layer) - copied} elements)")
        scatters.extend(copies)
    never_copied = sorted(set(ckpt) - recorder.copied_names - set(unlearned))
    return {
        "seconds": time.perf_counter() - start,
        "scatters": scatters,
        "unlearned": unlearned,
        "partial": partial,
        "never_copied": never_copied,
    }


def _loaded(bake: Any, ckpt: dict[str, Any]) -> dict[tuple[Any, str], Any]:
    """What the unwrapped loaders write from ``ckpt``, in checkpoint layout (before vLLM
    processes a layer into its kernel layout), into NaN-filled layers; the model restored."""
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.meta import materialize_layer
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    model = bake.model
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
        return {
            (layer, name): t.detach().clone()
            for layer in model.modules()
            for name, t in get_layer_tensors(layer).items()
            if not t.is_meta
        }
    finally:
        bake._restore_after_dry_run(model)


def _check(
    scatters: list[Any],
    held: dict[tuple[Any, str], Any],
    received: dict[str, Any],
    prefix_of: dict[Any, str],
) -> dict[str, Any]:
    """Rebuild each parameter from the scatters replayed on ``received`` alone and compare
    it bit for bit with ``held``: the parameters that differ and those not fully covered."""
    import torch

    built: dict[tuple[Any, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for sc in scatters:
        want = held[(sc.layer, sc.param_name)]
        if (sc.layer, sc.param_name) not in built:
            built[(sc.layer, sc.param_name)] = (
                torch.empty_strided(want.shape, want.stride(), dtype=want.dtype),
                torch.empty_strided(want.shape, want.stride(), dtype=torch.bool).fill_(False),
            )
        fresh, covered = built[(sc.layer, sc.param_name)]
        source = _replay(received[sc.src[0]], sc.src[1])
        fresh.as_strided(sc.shape, sc.stride, sc.offset).copy_(source)
        covered.as_strided(sc.shape, sc.stride, sc.offset).fill_(True)
    mismatched, uncovered, filled = [], [], []
    for (layer, pname), (fresh, covered) in built.items():
        want = held[(layer, pname)]
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.itemsize]
        if not torch.equal(fresh.view(bits)[covered], want.view(bits)[covered]):
            mismatched.append(f"{prefix_of[layer]}.{pname}")
        if not bool(covered.all()):
            # Elements the loader wrote as zeros with no slice behind them (padding) are
            # its own fill, which it writes again on the worker.
            rest = want[~covered]
            label = filled if not rest.is_floating_point() or bool((rest == 0).all()) else uncovered
            label.append(f"{prefix_of[layer]}.{pname} ({rest.numel()} elements)")
    return {
        "checked": len(built),
        "mismatched": mismatched,
        "uncovered": uncovered,
        "filled": filled,
    }


def _bounding_box(mask: Any) -> tuple[tuple[int, int], ...] | None:
    """The box of the ``True`` elements when they fill it and it is not the whole tensor."""
    found = mask.nonzero()
    if not len(found):
        return None
    lo, hi = found.min(0).values.tolist(), (found.max(0).values + 1).tolist()
    box = tuple(zip(lo, hi, strict=True))
    fills = len(found) == _numel(tuple(b - a for a, b in box))
    return (
        box if fills and any(b - a < n for (a, b), n in zip(box, mask.shape, strict=True)) else None
    )


def _box_tensor(name: str, whole: Any, box: tuple[tuple[int, int], ...]) -> Any:
    """A stand-in of ``whole``'s shape that holds only ``box`` of it, as a worker would
    receive it."""
    index = tuple(slice(a, b) for a, b in box)
    return BoxTensor(name, whole.shape, tuple(a for a, _ in box), whole[index].clone())


class BoxTensor(torch.Tensor):
    """A checkpoint tensor of which only a box was received: ``narrow``, an int index or
    ``unbind`` on dim 0 inside the box, and ``unsqueeze``, answer with the received data;
    shape queries with the whole tensor's; anything else fails by name rather than read
    bytes never sent."""

    _name: str
    _start: tuple[int, ...]
    _data: torch.Tensor

    @staticmethod
    def __new__(cls, name: str, shape: Any, start: tuple[int, ...], data: Any) -> Any:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=data.dtype)
        t._name, t._start, t._data = name, start, data
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self = args[0] if args else None
        if isinstance(self, cls) and func is torch.Tensor.narrow:
            dim, start, length = (*args[1:], *kwargs.values())
            return self._narrowed(dim % self.dim(), int(start), int(length))
        if isinstance(self, cls) and func is torch.Tensor.__getitem__ and type(args[1]) is int:
            return self._row(args[1] % self.shape[0])
        if isinstance(self, cls) and func is torch.Tensor.unbind and not args[1:] and not kwargs:
            return tuple(self._row(i) for i in range(self.shape[0]))
        if isinstance(self, cls) and func is torch.Tensor.unsqueeze:
            dim = (*args[1:], *kwargs.values())[0] % (self.dim() + 1)
            shape = torch.Size([*self.shape[:dim], 1, *self.shape[dim:]])
            start = (*self._start[:dim], 0, *self._start[dim:])
            return cls(self._name, shape, start, self._data.unsqueeze(dim))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _row(self, i: int) -> Any:
        row = self._narrowed(0, i, 1)
        if isinstance(row, BoxTensor):
            return BoxTensor(self._name, self.shape[1:], self._start[1:], row._data[0])
        return row[0]

    def _narrowed(self, dim: int, start: int, length: int) -> Any:
        low = start - self._start[dim]
        if low < 0 or low + length > self._data.shape[dim]:
            have = f"{self._start[dim]}:{self._start[dim] + self._data.shape[dim]}"
            raise IndexError(
                f"{self._name}: elements {start}:{start + length} of dim {dim} were not "
                f"received (this worker holds {have})"
            )
        data = self._data.narrow(dim, low, length)
        shape = torch.Size([*self.shape[:dim], length, *self.shape[dim + 1 :]])
        if data.shape == shape:
            return data
        starts = tuple(0 if d == dim else s for d, s in enumerate(self._start))
        return BoxTensor(self._name, shape, starts, data)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = next(a._name for a in args if isinstance(a, cls))
        raise NotImplementedError(f"{name}: {func} on a received slice")


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

    model_kind, tied, vocab = KINDS[kind]
    with tempfile.TemporaryDirectory(prefix=f"slices-{kind}-") as path:
        build_tiny_model(path, model_kind, tied=tied, dtype=getattr(torch, dtype))
        if vocab is not None:
            _cut_vocab(path, vocab)
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
            outputs, boxed = {}, []
            for form in ("whole", "zeros", "boxes"):
                boxed = llm.collective_rpc(reload_from, args=(path, form))
                outputs[form] = _outputs(llm, SamplingParams)
        finally:
            llm.llm_engine.engine_core.shutdown()
    for r, n in zip(results, boxed, strict=True):
        r["boxed"] = n
    print(f"\n== {kind}")
    for form, (tokens, logprobs) in outputs.items():
        print(f"after a reload from {form}: tokens {tokens[0]}, prompt logprobs {logprobs[0][:3]}")
    same = outputs["boxes"] == outputs["whole"] and outputs["zeros"] != outputs["whole"]
    print(f"from boxes == from whole tensors, exactly (and zeros differ): {same}")
    return report(results, verbose) and same


def _cut_vocab(path: str, vocab: int) -> None:
    """Keep the first ``vocab`` rows of the saved model's embedding and output head."""
    import json

    from safetensors.torch import load_file, save_file

    (file,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(path, file))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = tensors[name][:vocab].clone()
    save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config.update(vocab_size=vocab, eos_token_id=vocab - 1, bos_token_id=vocab - 1)
    config.update(pad_token_id=vocab - 1)
    config_file.write_text(json.dumps(config))


#: Prompts whose greedy tokens and prompt logprobs compare engine states.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [300, 200, 100, 50, 25]]


def _outputs(llm: Any, sampling: Any) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and prompt logprobs of :data:`PROMPTS`."""
    params = sampling(max_tokens=4, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(r.outputs[0].token_ids) for r in out]
    logprobs = [[next(iter(d.values())).logprob for d in r.prompt_logprobs[1:]] for r in out]
    return tokens, logprobs


def report(results: list[dict[str, Any]], verbose: bool) -> bool:
    """Print per worker what it reads; True when every learned slice checked bit-equal."""
    first = results[0]
    size = {n: first["numel"][n] * first["itemsize"][n] for n in first["numel"]}
    whole = sum(size.values())
    # A tensor every worker reads whole is replicated: any sender may send it once per worker.
    replicated = {n for n in size if all(r["needed"][n] == r["numel"][n] for r in results)}
    print(f"{len(size)} checkpoint tensors, {whole / 1024:.0f} KiB")
    ok = True
    for r in results:
        need = sum(r["needed"][n] * r["itemsize"][n] for n in size)
        rep = sum(size[n] for n in replicated)
        print(
            f"worker {r['rank']}: learned in {r['learn_s']:.2f} s; reads {r['tensors']} "
            f"tensors through {r['slices']} slices; needs {need / 1024:.0f} KiB of "
            f"{whole / 1024:.0f} KiB ({need / whole:.1%}), of which replicated "
            f"{rep / 1024:.0f} KiB; {need / ((whole - rep) / len(results) + rep):.3f} x "
            f"(model - replicated) / TP + replicated"
        )
        print(
            f"  checked {r['checked']} parameters: {len(r['mismatched'])} mismatched, "
            f"{len(r['uncovered'])} not fully covered; unlearned {len(r['unlearned'])}, "
            f"partial modules {len(r['partial'])}, never copied {len(r['never_copied'])}"
        )
        print(f"  the reload from boxes gave {r['boxed']} tensors as boxes, the rest whole")
        for label in ("mismatched", "uncovered", "partial", "filled", "never_copied"):
            for item in r[label]:
                print(f"  {label}: {item}")
        for name, why in r["unlearned"].items():
            print(f"  unlearned: {name}: {why}")
        ok = ok and not any(r[k] for k in ("mismatched", "uncovered", "unlearned"))
        if verbose:
            for name, lines in sorted(r["slice_list"].items()):
                for line in lines:
                    print(f"    {name} {line}")
    union = sum(size[n] for n in size if any(r["needed"][n] for r in results))
    print(f"union of the workers' needs: {union / whole:.1%} of the model")
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
