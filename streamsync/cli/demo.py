"""Sync a trainer into a real vLLM engine on this CPU machine, step after step,
and verify every step.

Builds a random-weight Qwen3 of about 400 MiB (or loads --model DIR) and
starts vLLM on it. Each step perturbs the trainer's weights (a stand-in for a
training step), streams them through the default adapter chain over
--transport, and checks that the engine's greedy tokens equal the trainer's
and that its prompt logprobs match. With --engine fake, a vLLM-style fake
model in this process takes the engine's place, over memory:// (no vLLM
needed)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import msgspec
import torch

from streamsync.adapters import cast, expand_moe, split_buffers
from streamsync.sources import named_tensors
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES

LOGPROB_TOL = 1e-4


def add_parser(sub: Any) -> None:
    """Register the ``demo`` subcommand."""
    demo = sub.add_parser(
        "demo",
        help="sync a trainer into a real vLLM engine on CPU, several steps, verify each",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--steps", type=int, default=3, help="sync steps (default 3)")
    demo.add_argument(
        "--model",
        metavar="DIR",
        help="a Transformers model directory (default: build one, see --kind)",
    )
    demo.add_argument(
        "--kind",
        choices=["dense-400m", "dense", "moe"],
        default="dense-400m",
        help="the model to build: dense-400m (default; a Qwen3 of about 400 MiB in bf16, "
        "800 MiB per sync in the engine's fp32, built in seconds), or a tiny dense or moe one",
    )
    demo.add_argument(
        "--transport",
        metavar="URL",
        help="transport URL, e.g. zmq+tcp://127.0.0.1:5555 (default: shm://streamsync-demo-<pid>;"
        " memory://demo with --engine fake)",
    )
    demo.add_argument(
        "--bucket-bytes",
        type=int,
        default=DEFAULT_BUCKET_BYTES,
        metavar="BYTES",
        help=f"bucket size in bytes (default {DEFAULT_BUCKET_BYTES >> 20} MiB, the library's)",
    )
    demo.add_argument(
        "--verbose",
        action="store_true",
        help="show the engine's own logs and warnings (hidden by default)",
    )
    demo.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait on each sync (default 60)"
    )
    demo.add_argument("--json", metavar="PATH", help="write the per-step reports to PATH")
    demo.add_argument(
        "--engine",
        choices=["vllm", "fake"],
        default="vllm",
        help="vllm (default), or fake: a vLLM-style model in this process, no vLLM needed",
    )
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit status 1 if any step fails verification."""
    if args.engine == "fake":
        from streamsync.cli.demo_fake import demo_fake

        return demo_fake(args)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: starts fast
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with (
        tempfile.TemporaryDirectory(prefix="streamsync-demo-") as tmp,
        _engine_output(args.verbose) as progress,
    ):
        return _run(args, Path(tmp), progress)


@contextlib.contextmanager
def _engine_output(verbose: bool) -> Iterator[TextIO]:
    """Where the demo's progress bar goes. Unless ``verbose``, everything else written to
    stderr (the engine's C++ and Python warnings, its loaders' progress bars) goes to a
    temporary file instead, shown only if the demo fails."""
    if verbose:
        yield sys.stderr
        return
    sys.stderr.flush()
    saved = os.dup(2)
    progress = os.fdopen(os.dup(saved), "w")
    with tempfile.TemporaryFile() as hidden, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        os.dup2(hidden.fileno(), 2)
        failed = True
        try:
            yield progress
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            progress.close()
            if failed:
                hidden.seek(0)
                sys.stderr.write(hidden.read().decode(errors="replace"))


def _run(args: argparse.Namespace, tmp: Path, progress: TextIO) -> int:
    import anyio
    from tqdm import tqdm

    from streamsync.cli.verify import engine_outputs, make_llm, reference_outputs
    from streamsync.testing.models import build_tiny_model, perturb
    from streamsync.vllm import WeightSync

    steps = tqdm(total=args.steps + 2, desc="demo", unit="step", file=progress, leave=False)
    if args.model:
        from transformers import AutoModelForCausalLM

        path = Path(args.model)
        trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # eval mode
    else:
        path = tmp / "model"
        steps.set_description(f"building a {args.kind} model")
        trainer = build_tiny_model(path, args.kind, seed=0)
    steps.update()
    steps.set_description("starting vLLM")
    llm = make_llm(str(path), dtype="float32")
    steps.update()
    endpoint = args.transport or f"shm://streamsync-demo-{os.getpid()}"
    model_type = getattr(trainer.config, "model_type", None)
    # The default chain: experts expanded when the installed vLLM needs it, buffers declared
    # so the engine applies them in place, floating weights cast to the engine's dtype.
    pipeline = expand_moe(model_type=model_type) | split_buffers(trainer) | cast(torch.float32)
    _say(f"streamsync demo: {path.name} ({model_type}), transport {endpoint}")
    reports: list[dict[str, Any]] = []
    failed = 0

    async def main() -> None:
        nonlocal failed
        async with WeightSync(
            llm, endpoint, pipeline=pipeline, bucket_bytes=args.bucket_bytes, timeout=args.timeout
        ) as channel:
            for step in range(1, args.steps + 1):
                steps.set_description(f"sync {step}/{args.steps}")
                perturb(trainer, seed=step)
                report = await channel.update(named_tensors(trainer))
                want = reference_outputs(trainer)
                got = engine_outputs(llm)
                diff = got.max_logprob_diff(want)
                ok = got.tokens == want.tokens and diff <= LOGPROB_TOL and report.complete
                failed += not ok
                steps.update()
                _say(
                    f"step {step}/{args.steps}: {report.nbytes / 2**20:.2f} MiB in "
                    f"{report.buckets} buckets, {report.seconds:.3f} s, {report.gbps:.2f} GB/s, "
                    f"verified={'yes' if ok else 'NO'} (tokens equal: {got.tokens == want.tokens}, "
                    f"max |dlogprob| {diff:.1e})"
                )
                entry = msgspec.to_builtins(report)
                entry.update(step=step, verified=ok, max_logprob_diff=diff, gbps=report.gbps)
                reports.append(entry)

    try:
        anyio.run(main)
    finally:
        steps.close()
        with contextlib.suppress(Exception):  # best effort at exit
            llm.llm_engine.engine_core.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2))
    _say(f"{args.steps - failed}/{args.steps} steps verified")
    return 1 if failed else 0


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
