"""Adapters: stackable stages on a stream of named tensors, one per file.

=====================  ===============================================================
``cast(dtype)``        convert floating-point tensors (fused into packing before ``bucket``)
``rename(how)``        rename by mapping or function
``select(pred)``       keep tensors whose name ``pred`` accepts
``bucket(nbytes)``     group into buckets (the last stage of a sending chain)
``unbucket()``         packed buckets back into named tensors
=====================  ===============================================================
"""

from streamsync.adapters.bucket import Bucketer, Unbucketer, bucket, unbucket
from streamsync.adapters.cast import Cast, cast
from streamsync.adapters.rename import Rename, rename
from streamsync.adapters.select import Select, select

__all__ = [
    "Bucketer",
    "Cast",
    "Rename",
    "Select",
    "Unbucketer",
    "bucket",
    "cast",
    "rename",
    "select",
    "unbucket",
]
