"""Adapters: stackable stages on a stream of named tensors, one per file, each an
async-generator function made pipeable by :func:`streamsync.adapter` (see
:mod:`streamsync.pipeline`).

==================================  ============================================================
``cast(dtype)``                     convert floating-point tensors (fused into packing
                                    before ``bucket``); fp8 and ``*_scale_inv`` untouched
``rename(how)``                     rename by mapping or function
``select(pred)``                    keep tensors whose name ``pred`` accepts
``expand_moe(when, model_type)``    packed MoE experts into per-expert checkpoint keys
                                    (vLLM < 0.25), expert by expert, per model family
``split_buffers(module|names)``     declare the trainer's buffers; the receiver's ``BufferSink``
                                    copies buffers in place into every model instance
``quantize_fp8(block, skip)``       block-FP8 weights plus ``float32`` ``*_scale_inv``,
                                    quantized once, at the sender
``bucket(nbytes)``                  group into buckets (the last stage of a sending chain)
==================================  ============================================================
"""

from streamsync.adapters.bucket import bucket
from streamsync.adapters.cast import cast
from streamsync.adapters.expand_moe import expand_moe
from streamsync.adapters.quantize_fp8 import quantize_fp8
from streamsync.adapters.rename import rename
from streamsync.adapters.select import select
from streamsync.adapters.split_buffers import BufferSink, split_buffers

__all__ = [
    "BufferSink",
    "bucket",
    "cast",
    "expand_moe",
    "quantize_fp8",
    "rename",
    "select",
    "split_buffers",
]
