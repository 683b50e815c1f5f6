"""``streamsync bench``: end-to-end throughput of every transport against the machine's bounds.

A synthetic model of ``--size`` bytes shaped like a Qwen3 layer stack (embeddings, q/k/v/o,
gate/up/down, norms; the MoE variant with packed experts and a router buffer) goes through
each selected transport in each scenario, a few times after a warm-up sync on the same
channel, and the median is reported:

==================  =====================================================================
``dense``           bf16 weights, no adapters
``dense-fp32-cast`` fp32 master weights, ``pipeline=cast(bf16)`` (fused into the packing
                    copy): the same bytes on the wire as ``dense``
``moe``             bf16 MoE weights with packed experts, no adapters
``moe-chain``       the same through ``expand_moe(when="always") | split_buffers(...) |
                    cast(bf16)``, into a receiver holding per-expert tensors
``small-tensors``   bf16 tensors of 16 KiB each (per-tensor fixed cost), against
``large-tensors``   bf16 tensors of 8 MiB each
==================  =====================================================================

Every process keeps torch's default thread count (what users get) unless ``--threads N``
is given; the table says which.

Process transports run sender and receiver in two processes (forkserver children); the
receiver copies into its own preallocated model through :class:`~streamsync.ModuleSink`
(behind a :class:`~streamsync.adapters.BufferSink` for the chain). ``memory://`` runs both
sides in one process. Measured in the same run: a plain memcpy of the same tensors (torch's
copy), two plain memcpys (``memmove``, one thread each) in two processes at once (what the two
copies of a two-process shared-memory path can reach together), raw pyzmq PUSH/PULL moving
the same bytes in bucket-sized messages (the bound of the zmq transports), and, with ``shm``
and ``dense``, verl's shared-memory path at its best bucket size (``baseline_verl``).
``--vllm`` adds a sync into a real vLLM engine against vLLM's own ``reload_weights``
(``engine``). Each bound is measured at the start and again right
before its transport runs; the best is kept (a bound measured while other work loads the
machine would flatter the ratios).

Per run: end-to-end seconds (the sender's report: first bucket to the last receiver's
report), the phases of both sides' :class:`~streamsync.SyncReport` (sender ``pack``: copies
into slots; receiver ``load``: unpacking and the sink's copies) and ``transfer``: for each
bucket, the time the receiver sat idle waiting for a bucket the sender had already handed to
the transport (cross-process ``time.monotonic`` stamps). Peak extra memory of each side
during each sync: its peak RSS (``VmHWM``, reset before the sync) over its baseline with its
model allocated, before the channel opened, so the ring counts as extra; less the shared
libraries' code pages (``RssFile``) mapped in since the baseline (each run's as at its start),
which a child forked from a server that imported torch maps on first use (the ``--json``
keeps the figure with them as ``extra_with_files_bytes``). CPU seconds of each process per
sync (every thread): spinning threads show there even when the wall clock hides them.

The package, by concern:

=====================  ====================================================================
``models``             sizes, and the synthetic models (from the Qwen3 shape table in
                       :mod:`streamsync.testing.shapes`)
``scenarios``          the scenarios, the transports and their bounds: what runs
``stamped``            the sender/receiver wrappers that time each bucket
``roles``              what each child process runs (started through
                       :mod:`streamsync.testing.peers`)
``baseline_verl``      verl's shared-memory weight transfer, re-implemented as a baseline
``engine``             ``--vllm``: ``update_weights`` against vLLM's ``reload_weights``
``harness``            :func:`run_bench`: measures and returns plain data
``targets``            the targets, a table evaluated by one function
``report``, ``plot``   the Markdown table, the chart
``command``            ``streamsync bench``: options, table on stdout, ``--json``, ``--plot``
=====================  ====================================================================

Scripts beside the command, run by hand (figures go in ``BENCHMARKS.md`` with the command
that produced them): ``headline.sh`` (every headline figure in one run at torch's
defaults: ``bash streamsync/cli/bench/headline.sh [OUT_DIR]``), and modules run with
``python -m``: ``streamsync.cli.bench.quantize_fp8`` (block-FP8 quantization throughput),
``streamsync.cli.bench.cast_bound`` (the fused fp32 -> bf16 cast against a memmove of the
bytes it writes: what the cast can cost at best),
``streamsync.cli.bench.copy_placement`` (a copy's speed against where its destination sits
past its source, modulo 4 KiB), ``streamsync.cli.bench.source_forms`` (a model, a mapping and
``named_tensors`` of each, sent over ``shm://``: what each way of handing ``send`` a model
costs),
``streamsync.cli.bench.gpu_cuda_ipc`` (``cuda-ipc://`` on a GPU machine),
``streamsync.cli.bench.gpu_torch_nccl`` (``torch+nccl://`` with a receiver per GPU, 2+
GPUs, bit-exact, next to a raw NCCL broadcast of the same bytes).
"""

from streamsync.cli.bench.command import add_parser
from streamsync.cli.bench.harness import SCHEMA, BenchConfig, run_bench
from streamsync.cli.bench.models import SyntheticModel, parse_size, synthetic_model
from streamsync.cli.bench.plot import plot
from streamsync.cli.bench.report import format_table
from streamsync.cli.bench.scenarios import SCENARIOS, TRANSPORTS, Scenario, TransportSpec
from streamsync.cli.bench.targets import TARGETS, Target, evaluate_targets

__all__ = [
    "SCENARIOS",
    "SCHEMA",
    "TARGETS",
    "TRANSPORTS",
    "BenchConfig",
    "Scenario",
    "SyntheticModel",
    "Target",
    "TransportSpec",
    "add_parser",
    "evaluate_targets",
    "format_table",
    "parse_size",
    "plot",
    "run_bench",
    "synthetic_model",
]
