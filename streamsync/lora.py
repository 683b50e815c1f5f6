"""LoRA adapters on the trainer side: what an adapter sync carries (:func:`lora_adapter`).

An adapter is its LoRA tensors, named as peft saves them (``adapter_model.safetensors``:
``base_model.model.<module>.lora_A.weight`` and ``.lora_B.weight``, no adapter name in
them), and its LoRA config as JSON values. peft is imported only when a ``PeftModel`` or a
``LoraConfig`` is handed in (the ``lora`` extra).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from streamsync._peft import is_peft_model
from streamsync.errors import ConfigError
from streamsync.sources import full_tensor

#: The absolute path under which an engine knows the versions streamsync installed; nothing
#: is ever read from it (``/streamsync-lora/<name>/v<sync id>``).
LORA_PATH_PREFIX = "/streamsync-lora/"

_REQUIRED = ("r", "lora_alpha", "target_modules")
_LORA_SUFFIX = re.compile(r"\.(lora_A|lora_B)\.weight$|\.(lora_embedding_A|lora_embedding_B)$")
# peft's in-memory names carry the adapter's name: ``.lora_A.default.weight``.
_NAMED_SUFFIX = re.compile(r"\.(lora_A|lora_B)\.[^.]+\.weight$|\.(lora_embedding_[AB])\.[^.]+$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter as a sync carries it: its tensors (in order) and its config."""

    tensors: tuple[tuple[str, torch.Tensor], ...]
    #: The LoRA config as JSON values (``r``, ``lora_alpha``, ``target_modules``, ...).
    config: dict[str, Any]

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


def check_lora_name(name: object) -> str:
    """``name`` if it can name an adapter (letters, digits and ``._:@+-``, at most 128)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"LoRA adapter name {name!r}: use 1-128 letters, digits and '._:@+-', "
            "starting with a letter or digit"
        )
    return name


def _json(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _json(value.value)
    if isinstance(value, set | frozenset):
        return sorted(_json(v) for v in value)
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def lora_config_dict(config: Any) -> dict[str, Any]:
    """A LoRA config (peft's ``LoraConfig`` or a mapping of its fields) as JSON values,
    checked for the fields an engine needs."""
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        raw = config.to_dict()
    elif isinstance(config, Mapping):
        raw = dict(config)
    else:
        raise ConfigError(
            f"LoRA config is a {type(config).__name__}: pass peft's LoraConfig or a mapping "
            "of its fields (r, lora_alpha, target_modules, ...)"
        )
    out: dict[str, Any] = {k: _json(v) for k, v in raw.items() if k != "runtime_config"}
    missing = [k for k in _REQUIRED if out.get(k) in (None, "", [])]
    if missing:
        raise ConfigError(f"LoRA config lacks {', '.join(missing)} (needs {', '.join(_REQUIRED)})")
    peft_type = out.get("peft_type")
    if peft_type not in (None, "LORA"):
        raise ConfigError(f"adapter config has peft_type={peft_type!r}; only LORA adapters sync")
    r = out["r"]
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConfigError(f"LoRA config r={r!r}: use a rank >= 1")
    return out


def _from_peft(model: Any) -> tuple[dict[str, torch.Tensor], Any]:
    active = model.active_adapter
    if not isinstance(active, str):
        raise ConfigError(
            f"the peft model has several active adapters {active!r}: set one with "
            "set_adapter(name), or pass its tensors and config"
        )
    # What peft's get_peft_model_state_dict saves for a LoRA adapter (names without the
    # adapter's), read off its layers: a walk of the modules, not of the whole state dict.
    state: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        children = module._modules  # not getattr: nn.Module's is slow, over every module
        for kind in ("lora_A", "lora_B"):
            layers = children.get(kind)
            if isinstance(layers, torch.nn.ModuleDict) and active in layers:
                weight = layers[active].weight
                assert isinstance(weight, torch.Tensor)
                state[f"{prefix}.{kind}.weight"] = weight
        for kind in ("lora_embedding_A", "lora_embedding_B"):
            params = children.get(kind)
            if isinstance(params, torch.nn.ParameterDict) and active in params:
                state[f"{prefix}.{kind}"] = params[active]
    return state, model.peft_config[active]


def lora_adapter(adapter: Any, config: Any = None) -> LoraAdapter:
    """An adapter to sync: a ``peft.PeftModel`` (its active adapter and config), or named
    LoRA tensors (a mapping or ``(name, tensor)`` pairs, named as peft saves them) with
    ``config`` (a ``LoraConfig`` or its dict). Every name is checked; the tensors are not
    copied (the sync copies them once, as it sends)."""
    if is_peft_model(adapter):
        if config is not None:
            raise ConfigError("lora config: a peft model carries its own; pass config=None")
        tensors, config = _from_peft(adapter)
        pairs: Iterable[Any] = tensors.items()
    else:
        if config is None:
            raise ConfigError(
                "update_lora(name, tensors) needs config= (peft's LoraConfig or its dict), "
                "or pass the peft model itself"
            )
        if isinstance(adapter, Mapping):
            pairs = adapter.items()
        elif isinstance(adapter, Iterable) and not isinstance(adapter, str | bytes | torch.Tensor):
            pairs = adapter
        else:
            raise ConfigError(
                f"LoRA adapter is a {type(adapter).__name__}: pass a peft model, a mapping "
                "of LoRA tensors or (name, tensor) pairs"
            )
    cfg = lora_config_dict(config)
    out: list[tuple[str, torch.Tensor]] = []
    for item in pairs:
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"LoRA tensor {name!r} is a {type(tensor).__name__}")
        if not _LORA_SUFFIX.search(name):
            hint = (
                " (it carries the adapter's name: use peft's get_peft_model_state_dict, "
                "which drops it)"
                if _NAMED_SUFFIX.search(name)
                else ""
            )
            raise ConfigError(
                f"tensor {name!r} is not a LoRA tensor (names end in .lora_A.weight, "
                f".lora_B.weight, .lora_embedding_A or .lora_embedding_B){hint}"
            )
        if not tensor.is_floating_point():
            raise ConfigError(f"LoRA tensor {name!r} is {tensor.dtype}, not floating point")
        out.append((name, full_tensor(tensor)))
    if not out:
        raise ConfigError("the LoRA adapter has no tensors")
    return LoraAdapter(tuple(out), cfg)


def lora_id(name: str) -> int:
    """The engine-side id of adapter ``name``: the same in every process (vLLM replaces an
    adapter in place only under its id), and high, away from a user's own ids."""
    return (1 << 20) + xxhash.xxh32_intdigest(name.encode()) % (1 << 30)


def version_path(name: str, version: int) -> str:
    """The path vLLM knows version ``version`` of adapter ``name`` by (a ``LoRARequest``
    needs one, and its prefix cache keys blocks on it); nothing is read from it."""
    return f"{LORA_PATH_PREFIX}{name}/v{version}"


def path_version(name: str, path: str) -> int | None:
    """The version :func:`version_path` made ``path`` for adapter ``name``, or ``None`` when
    it is not such a path (an adapter of the user's own, on disk)."""
    prefix = f"{LORA_PATH_PREFIX}{name}/v"
    digits = path.removeprefix(prefix) if path.startswith(prefix) else ""
    return int(digits) if digits.isascii() and digits.isdigit() else None
