"""``streamsync bench --lora``: a LoRA adapter sync into a real vLLM engine against a full sync
of the same model.

The demo's model (``dense-400m`` of :mod:`streamsync.testing.models`: a Qwen3 of about 400
MiB in bf16, random weights, built locally) carries a peft LoRA adapter of rank ``--rank`` on
q/k/v/o/gate/up/down, and an in-process vLLM engine serves it in fp32 with
``enable_lora=True``. One :class:`~streamsync.vllm.WeightSync` over ``shm://`` (``cast(float32)``
fused into packing, what the demo sends) alternates, ``runs`` times after a warm-up of each:

* **full**: ``sync.update(peft_model)``, every base weight (what a user without adapter
  syncs sends each step, merged or not);
* **adapter**: ``sync.update_lora("policy", peft_model)``, the adapter's tensors only, checked
  and built on the worker and installed through vLLM's ``add_lora``.

The figures are bytes and seconds of each (medians) and their ratios (adapter / full).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamsync.adapters import cast

#: The model the comparison uses (the demo's).
KIND = "dense-400m"
#: Targets of the adapter sync against the full sync (at rank 8).
BYTES_TARGET = 1 / 20
SECONDS_TARGET = 1 / 10
_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_lora_bench(
    *,
    rank: int,
    runs: int,
    timeout: float,
    progress: Callable[[str], None] | None = None,
    kind: str = KIND,
) -> dict[str, Any]:
    """Run the comparison (``kind``: the model of :mod:`streamsync.testing.models`, the
    demo's by default); returns plain data (the ``--json``)."""
    note = progress or (lambda label: None)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from peft import LoraConfig, get_peft_model

    from streamsync.cli.verify import make_llm
    from streamsync.testing.models import build_tiny_model
    from streamsync.vllm import WeightSync

    with tempfile.TemporaryDirectory(prefix="streamsync-bench-lora-") as tmp:
        note(f"lora: building {kind} with a rank-{rank} adapter")
        base = build_tiny_model(Path(tmp) / "model", kind, seed=0, dtype=torch.bfloat16)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=_TARGETS, lora_dropout=0.0)
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.01)
        note("lora: starting the engine")
        max_rank = min(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)
        llm = make_llm(
            str(Path(tmp) / "model"), dtype="float32", enable_lora=True, max_lora_rank=max_rank
        )
        full_s: list[float] = []
        adapter_s: list[float] = []
        try:
            endpoint = f"shm://streamsync-bench-lora-{os.getpid()}"
            with WeightSync(llm, endpoint, pipeline=cast(torch.float32), timeout=timeout) as sync:
                note("lora: warm-up")
                full = sync.update(model)
                adapter = sync.update_lora("policy", model)
                for i in range(runs):
                    note(f"lora: run {i + 1} of {runs}")
                    start = time.perf_counter()
                    full = sync.update(model)
                    full_s.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    adapter = sync.update_lora("policy", model)
                    adapter_s.append(time.perf_counter() - start)
                    if not full.complete or full.missing or adapter.lora is None:
                        raise RuntimeError(f"sync incomplete: missing {full.missing[:5]}")
        finally:
            with contextlib.suppress(Exception):  # best effort at exit
                llm.llm_engine.engine_core.shutdown()
    med_full, med_adapter = statistics.median(full_s), statistics.median(adapter_s)
    return {
        "model": kind,
        "rank": rank,
        "runs": runs,
        "full_bytes": full.nbytes,
        "adapter_bytes": adapter.nbytes,
        "adapter_tensors": adapter.tensors,
        "full_s": full_s,
        "adapter_s": adapter_s,
        "full_median_s": med_full,
        "adapter_median_s": med_adapter,
        "bytes_ratio": adapter.nbytes / full.nbytes,
        "seconds_ratio": med_adapter / med_full,
        "targets": {"bytes": BYTES_TARGET, "seconds": SECONDS_TARGET},
    }


def format_lora_table(data: dict[str, Any]) -> str:
    """The comparison as a Markdown table."""

    def verdict(ratio: float, target: float, what: str) -> str:
        met = "met" if ratio <= target else "MISSED"
        return f"{ratio:.4f} (target <= {target:.2f}: {met}): {what} {ratio:.1%} of a full sync's"

    return "\n".join(
        [
            f"LoRA adapter sync into vLLM: {data['model']} with a rank-{data['rank']} adapter on "
            f"q/k/v/o/gate/up/down, fp32 on the wire, median of {data['runs']} runs after a "
            "warm-up, alternating with a full sync of the same model over one channel (shm)",
            "",
            "| sync | tensors | MiB | seconds |",
            "|---|---:|---:|---:|",
            f"| full | | {data['full_bytes'] / 2**20:.1f} | {data['full_median_s']:.3f} |",
            f"| adapter | {data['adapter_tensors']} | {data['adapter_bytes'] / 2**20:.2f} "
            f"| {data['adapter_median_s']:.4f} |",
            "",
            "bytes adapter/full: "
            + verdict(data["bytes_ratio"], data["targets"]["bytes"], "the adapter's sync moves")
            + " bytes",
            "seconds adapter/full: "
            + verdict(data["seconds_ratio"], data["targets"]["seconds"], "the adapter's sync takes")
            + " time",
        ]
    )
