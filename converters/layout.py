"""Pure, invertible layout transforms between Megatron's fused tensors and HF's.

Each pair takes the config values it needs as keywords and no process group;
`merge_*(*split_*(x)) == x` exactly. Tensors are full (TP=1) tensors.
"""

from __future__ import annotations

import torch

from converters.errors import ConfigError, ShapeMismatchError


def _qkv_group_sizes(num_attention_heads: int, num_key_value_heads: int, head_dim: int):
    if num_attention_heads % num_key_value_heads:
        raise ConfigError(
            f"num_attention_heads={num_attention_heads} is not a multiple of "
            f"num_key_value_heads={num_key_value_heads}; fix the HF config"
        )
    per_group = num_attention_heads // num_key_value_heads
    return per_group * head_dim, head_dim


def split_qkv(
    qkv: torch.Tensor, *, num_attention_heads: int, num_key_value_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (q, k, v) from Megatron's per-query-group interleaved `linear_qkv` weight or bias.

    Megatron stores [ng, (nq/ng + 2) * d, ...]: for each KV group its nq/ng query
    heads, then its key head, then its value head. Works for MHA, GQA, MQA and 1-D biases.
    """
    q_rows, kv_rows = _qkv_group_sizes(num_attention_heads, num_key_value_heads, head_dim)
    ng = num_key_value_heads
    expected = ng * (q_rows + 2 * kv_rows)
    if qkv.shape[0] != expected:
        raise ShapeMismatchError(
            f"linear_qkv has {qkv.shape[0]} rows, but the HF config gives "
            f"num_key_value_heads*(num_attention_heads/num_key_value_heads+2)*head_dim = "
            f"{ng}*({num_attention_heads // ng}+2)*{head_dim} = {expected}; check "
            f"num_attention_heads, num_key_value_heads and head_dim against the Megatron model"
        )
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(ng, q_rows + 2 * kv_rows, *rest)
    q, k, v = grouped.split([q_rows, kv_rows, kv_rows], dim=1)
    return q.reshape(ng * q_rows, *rest), k.reshape(ng * kv_rows, *rest), v.reshape(ng * kv_rows, *rest)


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    num_attention_heads: int, num_key_value_heads: int, head_dim: int,
) -> torch.Tensor:
    """Return Megatron's interleaved `linear_qkv` tensor from HF's q, k, v (inverse of split_qkv)."""
    q_rows, kv_rows = _qkv_group_sizes(num_attention_heads, num_key_value_heads, head_dim)
    ng = num_key_value_heads
    rest = tuple(q.shape[1:])
    grouped = torch.cat(
        [q.reshape(ng, q_rows, *rest), k.reshape(ng, kv_rows, *rest), v.reshape(ng, kv_rows, *rest)],
        dim=1,
    )
    return grouped.reshape(ng * (q_rows + 2 * kv_rows), *rest)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (gate, up) from a full `linear_fc1` weight laid out as [gate; up] on dim 0."""
    if fc1.shape[0] % 2:
        raise ShapeMismatchError(
            f"linear_fc1 has an odd number of rows ({fc1.shape[0]}); a gated MLP stores "
            f"[gate; up] and needs an even count (is gated_linear_unit on in the Megatron model?)"
        )
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Return Megatron's `linear_fc1` [gate; up] from HF's gate_proj and up_proj (inverse of split_gate_up)."""
    return torch.cat([gate, up], dim=0)


def trim_vocab(weight: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """Return the first `vocab_size` rows of a (padded) Megatron vocabulary tensor."""
    if weight.shape[0] < vocab_size:
        raise ShapeMismatchError(
            f"vocabulary tensor has {weight.shape[0]} rows, fewer than the HF config's "
            f"vocab_size={vocab_size}; set vocab_size in the HF config to the tokenizer's "
            f"size used to build the Megatron model"
        )
    return weight[:vocab_size]


def pad_vocab(weight: torch.Tensor, *, padded_vocab_size: int) -> torch.Tensor:
    """Return `weight` with zero rows appended up to Megatron's `padded_vocab_size` (inverse of trim_vocab)."""
    if weight.shape[0] > padded_vocab_size:
        raise ShapeMismatchError(
            f"vocabulary tensor has {weight.shape[0]} rows, more than padded_vocab_size={padded_vocab_size}"
        )
    pad = weight.new_zeros(padded_vocab_size - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, pad], dim=0)


def identity(tensor: torch.Tensor) -> tuple[torch.Tensor]:
    """Return the tensor unchanged, as a one-element tuple (a plain rename)."""
    return (tensor,)


# Rule transforms: adapt the pure functions above to `(tensor, HFConfig) -> tuple of HF tensors`.

def rename(tensor, cfg):
    """One Megatron tensor becomes one HF tensor, unchanged."""
    return identity(tensor)


def qkv(tensor, cfg):
    """Fused, interleaved `linear_qkv` weight or bias becomes q, k, v."""
    return split_qkv(
        tensor,
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
    )


def gate_up(tensor, cfg):
    """Fused `linear_fc1` becomes gate_proj, up_proj."""
    return split_gate_up(tensor)


def vocab(tensor, cfg):
    """Padded vocabulary rows are trimmed to the HF vocab_size."""
    return (trim_vocab(tensor, vocab_size=cfg["vocab_size"]),)


REARRANGING_TRANSFORMS = frozenset({rename, qkv, gate_up, vocab})
"""Rule transforms that only move elements (split, reorder, trim): casting their input to the output
dtype first yields the very bits that casting their outputs would, so a tensor may be gathered in the
(narrower) output dtype. A transform that computes (a quantizer) must not be listed."""
