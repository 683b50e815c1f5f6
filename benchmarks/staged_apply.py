"""Where a staged commit's apply goes: the demo's model (``dense-400m``, bf16) in an
in-process CPU vLLM ``LLM``, staged and committed ``--rounds`` times; per round the commit's
seconds, vLLM's post-load processing of the linear layers (``process_weights_after_loading``)
and, inside it, the oneDNN repacking of their weights (``create_onednn_mm``), which is the CPU
build's and which a GPU engine's unquantized layers do not do. Timers wrap vLLM's functions
in this process only.

    .venv/bin/python benchmarks/staged_apply.py --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

SECONDS: dict[str, float] = defaultdict(float)


def timed(owner: Any, name: str, label: str) -> None:
    """Add the seconds of every call of ``owner.name`` to ``SECONDS[label]``."""
    fn: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds

    import vllm._custom_ops as ops
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    import streamsync as ss
    from streamsync.cli.verify import make_llm
    from streamsync.testing.models import build_tiny_model
    from streamsync.vllm import WeightSync

    tmp = tempfile.mkdtemp(prefix="staged-apply-")
    model = build_tiny_model(Path(tmp), "dense-400m", seed=0, dtype=torch.bfloat16)
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    llm = make_llm(tmp, dtype="bfloat16")
    timed(UnquantizedLinearMethod, "process_weights_after_loading", "linear post-load")
    timed(ops, "create_onednn_mm", "oneDNN repack")
    print(f"dense-400m, {nbytes / 2**20:.1f} MiB bf16, torch threads {torch.get_num_threads()}")
    print("| round | commit s | apply s | linear post-load s | of which oneDNN repack s |")
    print("|---:|---:|---:|---:|---:|")
    with WeightSync(llm, f"shm://staged-apply-{os.getpid()}") as sync:
        sync.update(ss.named_tensors(model))
        for r in range(rounds):
            sync.stage(ss.named_tensors(model))
            SECONDS.clear()
            start = time.perf_counter()
            report = sync.commit()
            commit = time.perf_counter() - start
            post, repack = SECONDS["linear post-load"], SECONDS["oneDNN repack"]
            apply = report.phases["apply"]
            print(f"| {r + 1} | {commit:.3f} | {apply:.3f} | {post:.3f} | {repack:.3f} |")


if __name__ == "__main__":
    main()
