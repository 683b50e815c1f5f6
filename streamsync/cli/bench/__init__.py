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
copies of a two-process shared-memory path can reach together), and raw pyzmq PUSH/PULL
moving the same bytes in bucket-sized messages (the bound of the zmq transports).
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
``engine``             ``--vllm``: ``update_weights`` against vLLM's ``reload_weights``
``harness``            :func:`run_bench`: measures and returns plain data
``delta``, ``lora``    ``--delta``, ``--lora``: delta and LoRA adapter syncs against full ones
``sharded``            ``--sharded``: each TP worker sent its slices, against the full fan-out
``fanout``             ``--receivers``: one sender to several receiver processes
``report``, ``plot``   the Markdown table, the chart
``command``            ``streamsync bench``: options, table on stdout, ``--json``, ``--plot``
=====================  ====================================================================

The project's own measurements (its targets, verl's path re-implemented as a baseline,
micro-benchmarks, GPU scripts) live in ``benchmarks/`` at the repository root, apart from
the package; they import from it, never the other way.
"""
