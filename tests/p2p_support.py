"""Test support for the P2P path: shard roles of HF tensors until the family tables carry them.

`ROLES` stands in for the `shard` field the family rows (converters/) are gaining; once
`converter.shard_role(name)` exists, `tensor_specs` asks it instead and this table goes.
"""

from __future__ import annotations

import re

import torch

from megatron_sync.p2p.layout import Shard, TensorSpec

_PROJ = r"model\.layers\.\d+\.(?:self_attn|mlp(?:\.experts\.\d+|\.shared_experts)?)\."
ROLES: tuple[tuple[str, Shard], ...] = (
    (r"model\.embed_tokens\.weight|lm_head\.weight", Shard.VOCAB),
    (_PROJ + r"(?:q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj)\.(?:weight|bias)", Shard.COLUMN),
    (_PROJ + r"[kv]_proj\.(?:weight|bias)", Shard.KV_HEADS),
    (_PROJ + r"(?:o_proj|down_proj)\.weight", Shard.ROW),
    (r".+", Shard.REPLICATED),  # norms, routers, MLA's low-rank down projections, o_proj bias
)


def role_of(name: str) -> Shard:
    """Return the shard role of HF tensor `name` (first fully matching row of `ROLES`)."""
    return next(role for pattern, role in ROLES if re.fullmatch(pattern, name))


def tensor_specs(expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[TensorSpec]:
    """Return `TensorSpec`s for a converter's `expected_hf_tensors()`, in its order."""
    return [TensorSpec(name, tuple(shape), dtype, role_of(name)) for name, (shape, dtype) in expected.items()]
