"""The dtypes that may cross the wire, by their wire names."""

from __future__ import annotations

import torch

from streamsync.errors import WireFormatError

_CANDIDATES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex64",
    "complex128",
]

#: Wire name -> torch dtype, for every dtype the installed torch knows.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _CANDIDATES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

#: Floating-point dtypes that may be converted into one another on the way. Casting fp8 or
#: integer tensors would destroy quantized weights and indices.
CASTABLE: frozenset[torch.dtype] = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16}
)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; raises ``WireFormatError`` for dtypes that cannot travel."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise WireFormatError(
            f"dtype {dtype} cannot be sent; supported: {', '.join(DTYPES)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a wire name; raises ``WireFormatError`` for unknown names."""
    try:
        return DTYPES[name]
    except KeyError:
        raise WireFormatError(
            f"unknown dtype {name!r} in metadata; supported: {', '.join(DTYPES)}"
        ) from None
