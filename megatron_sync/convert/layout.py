"""Pure, invertible layout transforms between Megatron's fused tensors and HF's.

Each pair takes the config values it needs as keywords and no process group;
`merge_*(*split_*(x)) == x` exactly. Tensors are full (TP=1) tensors.
"""

from __future__ import annotations

import torch

from megatron_sync.convert.errors import ConfigError, ShapeMismatchError


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


def interleave_gate_up(fc1: torch.Tensor) -> torch.Tensor:
    """Return a `linear_fc1` [gate; up] (dim 0) with its rows interleaved: gate_0, up_0, gate_1, up_1, ...

    gpt-oss's checkpoint (and vLLM's swigluoai kernel) keeps each gate row next to its up row.
    """
    gate, up = split_gate_up(fc1)
    return torch.stack([gate, up], dim=1).reshape(fc1.shape)


def deinterleave_gate_up(interleaved: torch.Tensor) -> torch.Tensor:
    """Return the [gate; up] `linear_fc1` of interleaved rows (inverse of interleave_gate_up)."""
    pairs = interleaved.reshape(interleaved.shape[0] // 2, 2, *interleaved.shape[1:])
    return merge_gate_up(pairs[:, 0], pairs[:, 1])


def split_gated_qkv(
    qkv: torch.Tensor, *, num_attention_heads: int, num_key_value_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (q_proj, k, v) from a `linear_qkv` with an output gate (`attention_output_gate`).

    Megatron stores, per KV group, its query heads, then as many gate heads, then the key and
    the value head: [ng, (2 * nq/ng + 2) * d, ...]. Qwen3-Next's q_proj holds each query head
    followed by its gate head: [nq * 2 * d, ...].
    """
    q_rows, kv_rows = _qkv_group_sizes(num_attention_heads, num_key_value_heads, head_dim)
    ng, per_group = num_key_value_heads, num_attention_heads // num_key_value_heads
    expected = ng * (2 * q_rows + 2 * kv_rows)
    if qkv.shape[0] != expected:
        raise ShapeMismatchError(
            f"gated linear_qkv has {qkv.shape[0]} rows, but the HF config gives "
            f"num_key_value_heads*(2*num_attention_heads/num_key_value_heads+2)*head_dim = "
            f"{ng}*(2*{per_group}+2)*{head_dim} = {expected}; check num_attention_heads, "
            f"num_key_value_heads and head_dim against the Megatron model (attention_output_gate on?)"
        )
    rest = tuple(qkv.shape[1:])
    q, gate, k, v = qkv.reshape(ng, 2 * q_rows + 2 * kv_rows, *rest).split([q_rows, q_rows, kv_rows, kv_rows], dim=1)
    heads = [t.reshape(ng, per_group, head_dim, *rest) for t in (q, gate)]
    q_proj = torch.stack(heads, dim=2).reshape(num_attention_heads * 2 * head_dim, *rest)
    return q_proj, k.reshape(ng * kv_rows, *rest), v.reshape(ng * kv_rows, *rest)


def merge_gated_qkv(
    q_proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    num_attention_heads: int, num_key_value_heads: int, head_dim: int,
) -> torch.Tensor:
    """Return Megatron's gated `linear_qkv` from Qwen3-Next's q_proj (query and gate per head), k, v
    (inverse of split_gated_qkv)."""
    q_rows, kv_rows = _qkv_group_sizes(num_attention_heads, num_key_value_heads, head_dim)
    ng, per_group = num_key_value_heads, num_attention_heads // num_key_value_heads
    rest = tuple(q_proj.shape[1:])
    heads = q_proj.reshape(ng, per_group, 2, head_dim, *rest)
    grouped = torch.cat([heads[:, :, 0].reshape(ng, q_rows, *rest), heads[:, :, 1].reshape(ng, q_rows, *rest),
                         k.reshape(ng, kv_rows, *rest), v.reshape(ng, kv_rows, *rest)], dim=1)
    return grouped.reshape(ng * (2 * q_rows + 2 * kv_rows), *rest)


def _gdn_sizes(num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int):
    if num_value_heads % num_key_heads:
        raise ConfigError(
            f"linear_num_value_heads={num_value_heads} is not a multiple of "
            f"linear_num_key_heads={num_key_heads}; fix the HF config"
        )
    per_key = num_value_heads // num_key_heads
    return per_key, [num_key_heads * key_head_dim] * 2 + [num_value_heads * value_head_dim] * 2 + [num_value_heads] * 2


def split_gdn_in_proj(
    in_proj: torch.Tensor, *, num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (in_proj_qkvz, in_proj_ba) from a gated-delta-net `in_proj` weight.

    Megatron stores the six projections one after another, each over all its heads:
    [q; k; v; z; beta; alpha]. Qwen3-Next's checkpoint groups them by key head: in_proj_qkvz
    holds, per key head, its q and k heads and the v and z heads of its value-head group;
    in_proj_ba holds, per key head, the beta then alpha rows of its value-head group.
    """
    per_key, sizes = _gdn_sizes(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    if in_proj.shape[0] != sum(sizes):
        raise ShapeMismatchError(
            f"gated-delta-net in_proj has {in_proj.shape[0]} rows, but the HF config gives "
            f"2*linear_num_key_heads*linear_key_head_dim + 2*linear_num_value_heads*linear_value_head_dim "
            f"+ 2*linear_num_value_heads = {sum(sizes)}; check those values against the Megatron model"
        )
    rest = tuple(in_proj.shape[1:])
    q, k, v, z, beta, alpha = (t.reshape(num_key_heads, -1, *rest) for t in in_proj.split(sizes, dim=0))
    qkvz = torch.cat([q, k, v, z], dim=1).reshape(-1, *rest)
    ba = torch.cat([beta, alpha], dim=1).reshape(-1, *rest)
    return qkvz, ba


def merge_gdn_in_proj(
    qkvz: torch.Tensor, ba: torch.Tensor, *,
    num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int,
) -> torch.Tensor:
    """Return Megatron's gated-delta-net `in_proj` from Qwen3-Next's in_proj_qkvz and in_proj_ba
    (inverse of split_gdn_in_proj)."""
    per_key, _ = _gdn_sizes(num_key_heads, num_value_heads, key_head_dim, value_head_dim)
    rest = tuple(qkvz.shape[1:])
    vz = per_key * value_head_dim
    q, k, v, z = qkvz.reshape(num_key_heads, -1, *rest).split([key_head_dim, key_head_dim, vz, vz], dim=1)
    beta, alpha = ba.reshape(num_key_heads, -1, *rest).split([per_key, per_key], dim=1)
    return torch.cat([t.reshape(-1, *rest) for t in (q, k, v, z, beta, alpha)], dim=0)


def zero_centered_to_gamma(weight: torch.Tensor) -> torch.Tensor:
    """Return the gamma of a zero-centered norm weight (which stores gamma - 1)."""
    return weight + 1


def gamma_to_zero_centered(gamma: torch.Tensor) -> torch.Tensor:
    """Return the zero-centered weight (gamma - 1) of a norm's gamma (inverse of zero_centered_to_gamma)."""
    return gamma - 1


# Rule transforms: adapt the pure functions above to `(tensor, HFConfig) -> tuple of HF tensors`.

def rename(tensor, cfg):
    """One Megatron tensor becomes one HF tensor, unchanged."""
    return identity(tensor)


def _heads(cfg) -> dict[str, int]:
    return dict(num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                head_dim=cfg["head_dim"])


def qkv(tensor, cfg):
    """Fused, interleaved `linear_qkv` weight or bias becomes q, k, v."""
    return split_qkv(tensor, **_heads(cfg))


def gate_up(tensor, cfg):
    """Fused `linear_fc1` becomes gate_proj, up_proj."""
    return split_gate_up(tensor)


def vocab(tensor, cfg):
    """Padded vocabulary rows are trimmed to the HF vocab_size."""
    return (trim_vocab(tensor, vocab_size=cfg["vocab_size"]),)


def gated_qkv(tensor, cfg):
    """Fused `linear_qkv` with output gate becomes q_proj (query and gate per head), k, v."""
    return split_gated_qkv(tensor, **_heads(cfg))


def gdn_in_proj(tensor, cfg):
    """Gated-delta-net `in_proj` becomes in_proj_qkvz, in_proj_ba."""
    return split_gdn_in_proj(
        tensor,
        num_key_heads=cfg["linear_num_key_heads"],
        num_value_heads=cfg["linear_num_value_heads"],
        key_head_dim=cfg["linear_key_head_dim"],
        value_head_dim=cfg["linear_value_head_dim"],
    )


def interleaved_gate_up(tensor, cfg):
    """An expert's `linear_fc1` bias becomes gpt-oss's interleaved gate_up_proj_bias."""
    return (interleave_gate_up(tensor),)


def interleaved_gate_up_transposed(tensor, cfg):
    """An expert's `linear_fc1` weight [2I, H] becomes gpt-oss's gate_up_proj [H, 2I] (rows interleaved,
    then transposed: gpt-oss multiplies x @ W)."""
    return (interleave_gate_up(tensor).t(),)


def transposed(tensor, cfg):
    """An expert's `linear_fc2` weight [H, I] becomes gpt-oss's down_proj [I, H]."""
    return (tensor.t(),)


def gamma(tensor, cfg):
    """A zero-centered Megatron norm weight becomes the plain gamma an HF norm stores."""
    return (zero_centered_to_gamma(tensor),)


REARRANGING_TRANSFORMS = frozenset({
    rename, qkv, gate_up, vocab, gated_qkv, gdn_in_proj, interleaved_gate_up, interleaved_gate_up_transposed,
    transposed,
})
"""Rule transforms that only move elements (split, reorder, trim): casting their input to the output
dtype first yields the very bits that casting their outputs would, so a tensor may be gathered in the
(narrower) output dtype. A transform that computes (a quantizer) must not be listed."""
