"""What streamsync reads of a peft model without importing peft: whether an object is one
(:func:`is_peft_model`), and its base checkpoint's names (:func:`base_name`). Below both
:mod:`streamsync.sources`, which streams a peft model's base, and :mod:`streamsync.lora`,
which builds its adapter."""

from __future__ import annotations

import sys

# Parts of a peft model's names that belong to an adapter, not to the base model.
_ADAPTER_PARTS = frozenset(
    {
        "lora_A",
        "lora_B",
        "lora_embedding_A",
        "lora_embedding_B",
        "lora_magnitude_vector",
        "lora_dropout",
        "modules_to_save",
    }
)


def is_peft_model(obj: object) -> bool:
    """Whether ``obj`` is a ``peft.PeftModel`` (without importing peft if it is not loaded)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(obj, peft.PeftModel)


def base_name(name: str) -> str | None:
    """The base checkpoint's name for a peft model's state-dict ``name``, or ``None`` for an
    adapter's own tensor: ``base_model.model.`` and ``.base_layer`` / ``.original_module``
    dropped (``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` is
    ``model.layers.0.self_attn.q_proj.weight``)."""
    parts = name.removeprefix("base_model.model.").split(".")
    if any(part in _ADAPTER_PARTS for part in parts):
        return None
    return ".".join(p for p in parts if p not in ("base_layer", "original_module"))
