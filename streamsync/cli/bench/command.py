"""``streamsync bench``: its options, and the command that runs the bench and writes the
table (stdout), ``--json`` and ``--plot``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from streamsync.cli.bench.harness import BenchConfig, run_bench
from streamsync.cli.bench.models import GiB, MiB, human, parse_size
from streamsync.cli.bench.plot import plot
from streamsync.cli.bench.report import format_table
from streamsync.cli.bench.scenarios import SCENARIOS, TRANSPORTS
from streamsync.wire.pack import DEFAULT_BUCKET_BYTES

DESCRIPTION = """\
Measure each transport's end-to-end throughput against this machine's bounds.

A synthetic Qwen3-shaped model of --size bytes goes through each transport in
each scenario: a warm-up sync, then --runs timed syncs. The table gives the
medians, the phases of each side, peak memory, and each transport's bound
(memcpy, two memcpys at once, raw pyzmq) measured in the same run."""


def _epilog() -> str:
    width = max(map(len, SCENARIOS)) + 2
    lines = ["scenarios:"]
    lines += [f"  {name:{width}}{s.description}" for name, s in SCENARIOS.items()]
    lines += ["", "transports (bound):"]
    lines += [f"  {name:{width}}{t.bound}" for name, t in TRANSPORTS.items()]
    return "\n".join(lines)


def add_parser(subparsers: Any) -> None:
    """Register ``streamsync bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="measure every transport against memcpy and raw pyzmq",
        description=DESCRIPTION,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--size", type=parse_size, default=GiB, help="model size, e.g. 16MiB (default 1GiB)"
    )
    parser.add_argument(
        "--transport",
        action="append",
        choices=[*TRANSPORTS, "torch+gloo"],
        help="a transport to run; repeatable (default: every one that runs here; "
        "torch+gloo with --receivers only)",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=list(SCENARIOS),
        metavar="SCENARIO",
        help="a scenario to run (listed below); repeatable (default: all)",
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="timed syncs after the warm-up (default 3)"
    )
    parser.add_argument(
        "--bucket-bytes",
        type=parse_size,
        default=64 * MiB,
        metavar="SIZE",
        help="bucket size, also each ring slot's (default 64MiB)",
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=None,
        help="ring slots (default: each transport's own default)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) in the sender and receiver processes of two-process "
        "paths (default: torch's own default, what users get)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds to wait for a peer or a bucket (default 120)",
    )
    parser.add_argument(
        "--receivers",
        type=_counts,
        metavar="N[,N...]",
        help="fan-out instead: the sender's seconds per sync to N receiver processes over "
        "zmq+tcp and torch+gloo, next to a raw gloo broadcast (e.g. 1,2,4)",
    )
    parser.add_argument(
        "--delta",
        action="store_true",
        help="delta against dense syncs instead: the model trained --steps AdamW steps at "
        "lr 1e-6 and 1e-5 (fp32 master weights, bf16 on the wire) over shm, zmq+tcp and "
        "torch+gloo to 1 and 3 receivers, side by side per step (--size is the bf16 size)",
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="training steps of --delta (default 5)"
    )
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="also sync a ~400 MiB Qwen3 into a real vLLM engine (update_weights over shm) "
        "against vLLM's own reload_weights from tensors in the worker's memory, in the "
        "same run",
    )
    parser.add_argument(
        "--vllm-only",
        action="store_true",
        help="only the vLLM comparison (implies --vllm; no transport table)",
    )
    parser.add_argument(
        "--vllm-bucket-bytes",
        type=parse_size,
        action="append",
        metavar="SIZE",
        help="bucket size of the vLLM comparison; repeatable (default: the library's, "
        f"{DEFAULT_BUCKET_BYTES >> 20}MiB)",
    )
    parser.add_argument(
        "--vllm-in-process",
        action="store_true",
        help="run the vLLM comparison's engine core in this process (its trainer and worker "
        "then share one interpreter); by default it runs in a process of its own, as vLLM "
        "runs it",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="a LoRA adapter sync instead: the demo's ~400 MiB Qwen3 with a peft adapter "
        "(--rank) into a real vLLM engine, against a full sync of the same model, alternating "
        "(needs the vllm and lora extras)",
    )
    parser.add_argument(
        "--rank", type=int, default=8, help="the adapter's rank for --lora (default 8)"
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="sharded syncs instead: the demo's ~400 MiB Qwen3 into --engines TP=2 CPU vLLM "
        "engines, each worker sent only its slices, against the full fan-out, alternating; "
        "then sharded delta syncs; over zmq+tcp and torch+gloo (needs the vllm extra)",
    )
    parser.add_argument(
        "--staged",
        action="store_true",
        help="staged syncs instead: the demo's ~400 MiB Qwen3 into one CPU vLLM AsyncLLM while "
        "two requests generate, stage then commit against a plain update, alternating; the "
        "engine's pause (the longest gap between a request's outputs) of each (needs the "
        "vllm extra)",
    )
    parser.add_argument(
        "--ray",
        action="store_true",
        help="an engine hosted in a Ray actor instead: the demo's ~400 MiB Qwen3 into a CPU "
        "vLLM engine in a Ray actor and into one in this process, alternating, seconds side "
        "by side (needs the vllm and ray extras)",
    )
    parser.add_argument(
        "--engines",
        type=int,
        choices=(1, 2),
        default=1,
        help="TP=2 engines of --sharded (default 1)",
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH as JSON")
    parser.add_argument("--plot", metavar="PATH.png", help="draw GB/s against the bounds")
    parser.set_defaults(run=run)


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: receiver counts like 1,2,4")
    return counts


def run(args: argparse.Namespace) -> int:
    """Run the bench; exit status 1 if any transport failed or moved the model wrong,
    2 for options that cannot run here."""
    from tqdm import tqdm

    if args.delta:
        return _run_delta(args)
    if args.lora:
        return _run_lora(args)
    if getattr(args, "ray", False):
        return _run_ray(args)
    if args.sharded:
        return _run_sharded(args)
    if getattr(args, "staged", False):
        return _run_staged(args)
    if args.receivers:
        return _run_fanout(args)
    for name in args.transport or ():
        if name not in TRANSPORTS:
            sys.stderr.write(f"streamsync bench: {name} runs with --receivers N only\n")
            return 2
        reason = TRANSPORTS[name].unavailable()
        if reason is not None:
            sys.stderr.write(f"streamsync bench: {reason}\n")
            return 2
    if args.runs < 1:
        sys.stderr.write("streamsync bench: --runs must be at least 1\n")
        return 2
    config = BenchConfig(
        size=args.size,
        transports=tuple(dict.fromkeys(args.transport or ())),
        scenarios=tuple(dict.fromkeys(args.scenario or SCENARIOS)),
        runs=args.runs,
        bucket_bytes=args.bucket_bytes,
        slots=args.slots,
        threads=args.threads,
        timeout=args.timeout,
    )
    vllm = args.vllm or args.vllm_only
    if vllm and importlib.util.find_spec("vllm") is None:
        sys.stderr.write("streamsync bench: --vllm needs vLLM (pip install 'streamsync[vllm]')\n")
        return 2
    data: dict[str, Any] = {}
    if not args.vllm_only:
        with tqdm(total=config.steps(), file=sys.stderr, disable=None, unit="step") as bar:
            last: list[str] = []

            def progress(label: str) -> None:
                if last:
                    bar.update()
                last[:] = [label]
                bar.set_description(label)

            data = run_bench(config, progress)
            bar.update()
        sys.stdout.write(format_table(data) + "\n")  # the command's output
    if vllm:
        from streamsync.cli.bench.engine import format_engine_table, run_engine_bench

        sizes = args.vllm_bucket_bytes or [DEFAULT_BUCKET_BYTES]
        with tqdm(total=None, file=sys.stderr, disable=None, bar_format="{desc}") as bar:
            engine = run_engine_bench(
                sizes,
                runs=args.runs,
                timeout=args.timeout,
                in_process=args.vllm_in_process,
                progress=bar.set_description,
            )
        data["engine"] = engine
        sys.stdout.write("\n" + format_engine_table(engine) + "\n")
    data["command"] = _command_line(args)
    _write_json(args, data)
    if args.plot and "results" in data:
        plot(data, args.plot)
    ok = all(
        r["ok"] and r["verified"] and r["received_bytes"] == r["model_bytes"]
        for r in data.get("results", [])
    )
    return 0 if ok else 1


def _run_fanout(args: argparse.Namespace) -> int:
    from streamsync.cli.bench.fanout import (
        FANOUT_TRANSPORTS,
        FanoutConfig,
        format_fanout,
        run_fanout,
    )

    transports = tuple(dict.fromkeys(args.transport or FANOUT_TRANSPORTS))
    others = [t for t in transports if t not in FANOUT_TRANSPORTS]
    if others or args.runs < 1:
        sys.stderr.write(
            f"streamsync bench --receivers: runs over {', '.join(FANOUT_TRANSPORTS)} "
            "with --runs 1 or more\n"
        )
        return 2
    config = FanoutConfig(
        receivers=args.receivers,
        transports=transports,
        size=args.size,
        runs=args.runs,
        bucket_bytes=args.bucket_bytes,
        slots=args.slots if args.slots is not None else FanoutConfig.slots,
        timeout=args.timeout,
    )

    def progress(label: str) -> None:
        sys.stderr.write(f"{label}\n")

    data = run_fanout(config, progress)
    data["command"] = _command_line(args)
    sys.stdout.write(format_fanout(data) + "\n")
    _write_json(args, data)
    return 0 if all(r["ok"] and r["verified"] for r in data["rows"]) else 1


def _run_delta(args: argparse.Namespace) -> int:
    from streamsync.cli.bench.delta import DELTA_TRANSPORTS, DeltaConfig, format_delta, run_delta

    transports = tuple(dict.fromkeys(args.transport or DELTA_TRANSPORTS))
    if any(t not in DELTA_TRANSPORTS for t in transports) or args.steps < 1:
        sys.stderr.write(
            f"streamsync bench --delta: runs over {', '.join(DELTA_TRANSPORTS)} "
            "with --steps 1 or more\n"
        )
        return 2
    config = DeltaConfig(
        size=args.size,
        steps=args.steps,
        transports=transports,
        receivers=args.receivers or (1, 3),
        bucket_bytes=args.bucket_bytes,
        timeout=args.timeout,
    )

    def progress(label: str) -> None:
        sys.stderr.write(f"{label}\n")

    data = run_delta(config, progress)
    data["command"] = _command_line(args)
    sys.stdout.write(format_delta(data) + "\n")
    _write_json(args, data)
    return 0 if all(r["verified"] for r in data["rows"]) else 1


def _run_lora(args: argparse.Namespace) -> int:
    missing = [m for m in ("vllm", "peft") if importlib.util.find_spec(m) is None]
    if missing or args.runs < 1 or args.rank < 1:
        sys.stderr.write(
            "streamsync bench --lora: needs vLLM and peft (pip install "
            "'streamsync[vllm,lora]'), --runs and --rank of 1 or more\n"
        )
        return 2
    from streamsync.cli.bench.lora import format_lora_table, run_lora_bench

    def progress(label: str) -> None:
        sys.stderr.write(f"{label}\n")

    data = run_lora_bench(rank=args.rank, runs=args.runs, timeout=args.timeout, progress=progress)
    data["command"] = _command_line(args)
    sys.stdout.write(format_lora_table(data) + "\n")
    _write_json(args, data)
    return 0


def _run_ray(args: argparse.Namespace) -> int:
    missing = [m for m in ("vllm", "ray") if importlib.util.find_spec(m) is None]
    if missing or args.runs < 1:
        sys.stderr.write(
            "streamsync bench --ray: needs vLLM and Ray (pip install "
            "'streamsync[vllm,ray]') and --runs of 1 or more\n"
        )
        return 2
    from streamsync.cli.bench.ray import format_ray_table, run_ray_bench

    def progress(label: str) -> None:
        sys.stderr.write(f"{label}\n")

    data = run_ray_bench(runs=args.runs, timeout=args.timeout, progress=progress)
    data["command"] = _command_line(args)
    sys.stdout.write(format_ray_table(data) + "\n")
    _write_json(args, data)
    return 0 if data["verified"] else 1


def _run_sharded(args: argparse.Namespace) -> int:
    from streamsync.cli.bench.sharded import SHARDED_TRANSPORTS, ShardedConfig

    transports = tuple(dict.fromkeys(args.transport or SHARDED_TRANSPORTS))
    others = [t for t in transports if t not in SHARDED_TRANSPORTS]
    if others or args.runs < 1 or importlib.util.find_spec("vllm") is None:
        sys.stderr.write(
            f"streamsync bench --sharded: runs over {', '.join(SHARDED_TRANSPORTS)} with "
            "--runs 1 or more, and needs vLLM (pip install 'streamsync[vllm]')\n"
        )
        return 2
    from streamsync.cli.bench.sharded import format_sharded, run_sharded_bench

    config = ShardedConfig(
        engines=args.engines, transports=transports, runs=args.runs, timeout=args.timeout
    )

    def progress(label: str) -> None:
        sys.stderr.write(f"{label}\n")

    data = run_sharded_bench(config, progress)
    data["command"] = _command_line(args)
    sys.stdout.write(format_sharded(data) + "\n")
    _write_json(args, data)
    return 0 if all(r["verified"] is not False for r in data["rows"]) else 1


def _run_staged(args: argparse.Namespace) -> int:
    if args.runs < 1 or importlib.util.find_spec("vllm") is None:
        sys.stderr.write(
            "streamsync bench --staged: runs with --runs 1 or more, and needs vLLM (pip "
            "install 'streamsync[vllm]')\n"
        )
        return 2
    from streamsync.cli.bench.staged import StagedConfig, format_staged, run_staged_bench

    config = StagedConfig(runs=args.runs, timeout=args.timeout)

    def progress(label: str) -> None:
        sys.stderr.write(f"{label}\n")

    data = run_staged_bench(config, progress)
    data["command"] = _command_line(args)
    sys.stdout.write(format_staged(data) + "\n")
    _write_json(args, data)
    return 0 if all(r["outlasted"] for rows in data["rows"].values() for r in rows) else 1


def _write_json(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Every figure of the run to ``--json``, when it was given."""
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(data, fh, indent=2)


def _command_line(args: argparse.Namespace) -> str:
    parts = ["streamsync bench", f"--size {human(args.size).replace(' ', '')}"]
    parts += [f"--transport {t}" for t in args.transport or ()]
    parts += [f"--scenario {s}" for s in args.scenario or ()]
    parts += [f"--delta --steps {args.steps}"] if args.delta else []
    parts += [f"--lora --rank {args.rank}"] if getattr(args, "lora", False) else []
    sharded = getattr(args, "sharded", False)
    parts += [f"--sharded --engines {args.engines}"] if sharded else []
    parts += ["--staged"] if getattr(args, "staged", False) else []
    parts += ["--ray"] if getattr(args, "ray", False) else []
    parts += [f"--receivers {','.join(map(str, args.receivers))}"] if args.receivers else []
    parts += [f"--runs {args.runs}", f"--bucket-bytes {args.bucket_bytes}"]
    parts += [f"--slots {args.slots}"] if args.slots is not None else []
    parts += [f"--threads {args.threads}"] if args.threads is not None else []
    parts += ["--vllm-only"] if args.vllm_only else ["--vllm"] if args.vllm else []
    parts += [f"--vllm-bucket-bytes {b}" for b in args.vllm_bucket_bytes or ()]
    parts += ["--vllm-in-process"] if getattr(args, "vllm_in_process", False) else []
    parts += [f"--json {args.json}"] if args.json else []
    parts += [f"--plot {args.plot}"] if args.plot else []
    return " ".join(parts)
