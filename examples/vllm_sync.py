"""Sync a trainer into a vLLM engine from synchronous code: one blocking call per step, no
event loop and no thread of yours.

A tiny random-weight Qwen3 and its tokenizer are built locally (no hub), vLLM is started on
them with streamsync's worker extension, and each step perturbs the trainer's weights (a
stand-in for a training step), syncs them over shared memory and checks that the engine's
greedy tokens now equal the trainer's.

Run: .venv/bin/python examples/vllm_sync.py [--steps 3] [--transport shm://policy]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from streamsync import named_tensors
from streamsync.cli.verify import engine_outputs, reference_outputs
from streamsync.testing.models import build_tiny_model, perturb
from streamsync.vllm import WeightSync


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--transport", default=f"shm://vllm-sync-example-{os.getpid()}")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: starts fast
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    with tempfile.TemporaryDirectory(prefix="vllm-sync-example-") as path:
        policy = build_tiny_model(path, "dense")  # the trainer's model, saved for vLLM to load
        llm = LLM(
            model=path,
            dtype="float32",
            max_model_len=256,
            enforce_eager=True,
            worker_extension_cls="streamsync.vllm.WorkerExtension",
        )
        with WeightSync(llm, args.transport) as sync:
            for step in range(1, args.steps + 1):
                perturb(policy, seed=step)
                report = sync.update(named_tensors(policy))
                same = engine_outputs(llm).tokens == reference_outputs(policy).tokens
                print(f"step {step}: {report.summary()} engine matches the trainer: {same}")
                assert same and report.complete
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
