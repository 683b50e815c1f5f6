"""The names Transformers gives mixture-of-experts tensors, in one place.

Transformers ≥ 5 keeps an MoE layer's experts packed in ``<block>.experts.gate_up_proj``
``[E, 2·I, H]`` and ``<block>.experts.down_proj`` ``[E, H, I]``, without a ``.weight`` suffix
(other versions and FSDP wrappers may add one), and its router in ``<block>.gate.weight``;
checkpoints name each expert ``<block>.experts.{e}.<proj>.weight``. ``<block>`` is the
module path of the layer's MoE block (``model.layers.3.mlp``). The adapters and the test
fakes build and recognise these names through this module only.
"""

from __future__ import annotations

import re
from typing import Final

#: The packed expert parameters of one MoE block.
PACKED_PROJECTIONS: Final = ("gate_up_proj", "down_proj")
#: A packed expert parameter; groups ``block`` (its MoE block's path) and ``proj``.
PACKED: Final = re.compile(
    rf"^(?P<block>.*)\.experts\.(?P<proj>{'|'.join(PACKED_PROJECTIONS)})(?:\.weight)?$"
)
#: The MoE blocks whose ``gate.weight`` is the router (Qwen-style and Mixtral-style).
ROUTER_BLOCKS: Final = ("mlp", "block_sparse_moe")
#: A router weight ``<block>.gate.weight``; groups ``block``.
ROUTER: Final = re.compile(rf"^(?P<block>(?:.*\.)?(?:{'|'.join(ROUTER_BLOCKS)}))\.gate\.weight$")
#: Modules that are routers or gates of experts wherever they appear in a name.
ROUTER_MODULES: Final = ("router", "shared_expert_gate")


def block_kind(block: str) -> str:
    """The last component of a block path: ``mlp`` for ``model.layers.0.mlp``."""
    return block.rpartition(".")[2]


def packed_name(block: str, proj: str) -> str:
    """The live (packed) name of ``proj`` in ``block``: ``<block>.experts.<proj>``."""
    return f"{block}.experts.{proj}"


def expert_name(block: str, expert: int, proj: str) -> str:
    """A checkpoint's name for one expert's ``proj``: ``<block>.experts.{e}.<proj>.weight``."""
    return f"{block}.experts.{expert}.{proj}.weight"


def router_name(block: str) -> str:
    """The router weight of ``block``: ``<block>.gate.weight``."""
    return f"{block}.gate.weight"
