"""Pure tests of the gpt-oss and Qwen3-Next layout pairs: arange tensors, exact, and read back by
transformers' own code where it has one (the checkpoint's meaning, not this package's)."""

from __future__ import annotations

import pytest
import torch

from megatron_sync.convert.errors import ConfigError, ShapeMismatchError
from megatron_sync.convert.layout import (
    deinterleave_gate_up, gamma_to_zero_centered, interleave_gate_up, merge_gated_qkv, merge_gdn_in_proj,
    split_gated_qkv, split_gdn_in_proj, zero_centered_to_gamma,
)

# -- gpt-oss experts: interleaved gate/up --------------------------------------------------------


def test_interleave_known_values_and_round_trip():
    fc1 = torch.arange(6)  # [g0 g1 g2 | u0 u1 u2]
    assert interleave_gate_up(fc1).tolist() == [0, 3, 1, 4, 2, 5]
    weight = torch.arange(6 * 4).reshape(6, 4)
    assert torch.equal(deinterleave_gate_up(interleave_gate_up(weight)), weight)


def test_interleaved_rows_are_what_gpt_oss_reads_as_gate_and_up():
    # transformers' GptOssExperts: gate = gate_up[..., ::2], up = gate_up[..., 1::2] of x @ gate_up_proj.
    # Small integers: every product and sum is exact in float32, so the two matmuls agree bit for bit
    # whatever order their kernels accumulate in (random floats differed once between kernel paths).
    fc1 = torch.randint(-8, 9, (8, 5)).float()  # Megatron [gate; up], 4 intermediate rows each
    x = torch.randint(-8, 9, (3, 5)).float()
    gate_up = x @ interleave_gate_up(fc1).t()
    assert torch.equal(gate_up[..., ::2], x @ fc1[:4].t())
    assert torch.equal(gate_up[..., 1::2], x @ fc1[4:].t())


# -- Qwen3-Next gated attention ------------------------------------------------------------------

def test_gated_qkv_known_values():
    # nq=2, ng=1, d=1: Megatron rows [q0, q1, gate0, gate1, k0, v0]; q_proj holds [q0, gate0, q1, gate1].
    q_proj, k, v = split_gated_qkv(torch.arange(6), num_attention_heads=2, num_key_value_heads=1, head_dim=1)
    assert q_proj.tolist() == [0, 2, 1, 3] and k.tolist() == [4] and v.tolist() == [5]


@pytest.mark.parametrize("heads", [dict(num_attention_heads=4, num_key_value_heads=2, head_dim=3),
                                   dict(num_attention_heads=4, num_key_value_heads=1, head_dim=2)])
@pytest.mark.parametrize("trailing", [(5,), ()], ids=["weight", "bias"])
def test_gated_qkv_round_trip_and_meaning(heads, trailing):
    nq, ng, d = heads["num_attention_heads"], heads["num_key_value_heads"], heads["head_dim"]
    rows = ng * (2 * nq // ng + 2) * d
    qkv = torch.arange(rows * (trailing[0] if trailing else 1)).reshape(rows, *trailing)
    q_proj, k, v = split_gated_qkv(qkv, **heads)
    assert q_proj.shape == (nq * 2 * d, *trailing) and k.shape == v.shape == (ng * d, *trailing)
    assert torch.equal(merge_gated_qkv(q_proj, k, v, **heads), qkv)
    # transformers' Qwen3NextAttention: view(..., -1, 2 * head_dim).chunk(2) -> query, gate per head.
    query, gate = q_proj.reshape(nq, 2 * d, *trailing).chunk(2, dim=1)
    grouped = qkv.reshape(ng, -1, *trailing)
    per = nq // ng
    for head in range(nq):
        g, j = divmod(head, per)
        assert torch.equal(query[head], grouped[g, j * d:(j + 1) * d])
        assert torch.equal(gate[head], grouped[g, (per + j) * d:(per + j + 1) * d])


def test_gated_qkv_names_config_values_on_bad_rows():
    with pytest.raises(ShapeMismatchError, match="attention_output_gate"):
        split_gated_qkv(torch.zeros(12, 4), num_attention_heads=4, num_key_value_heads=2, head_dim=2)


# -- Qwen3-Next gated delta net in_proj ----------------------------------------------------------

GDN = dict(num_key_heads=2, num_value_heads=4, key_head_dim=1, value_head_dim=1)


def test_gdn_in_proj_known_values():
    # q=[0,1] k=[2,3] v=[4..7] z=[8..11] beta=[12..15] alpha=[16..19]; grouped by key head (2 value heads each)
    qkvz, ba = split_gdn_in_proj(torch.arange(20), **GDN)
    assert qkvz.tolist() == [0, 2, 4, 5, 8, 9, 1, 3, 6, 7, 10, 11]
    assert ba.tolist() == [12, 13, 16, 17, 14, 15, 18, 19]
    assert torch.equal(merge_gdn_in_proj(qkvz, ba, **GDN), torch.arange(20))


@pytest.mark.parametrize("sizes", [dict(num_key_heads=2, num_value_heads=4, key_head_dim=3, value_head_dim=2),
                                   dict(num_key_heads=2, num_value_heads=2, key_head_dim=2, value_head_dim=3)])
def test_gdn_in_proj_is_what_transformers_reads(sizes):
    """transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering, fed the rows' own indices as the
    projected states, hands back Megatron's q, k, v, z, beta, alpha in Megatron's head order."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    nk, nv, dk, dv = sizes["num_key_heads"], sizes["num_value_heads"], sizes["key_head_dim"], sizes["value_head_dim"]
    config = Qwen3NextConfig(hidden_size=8, num_hidden_layers=1, linear_num_key_heads=nk, linear_num_value_heads=nv,
                             linear_key_head_dim=dk, linear_value_head_dim=dv, num_experts=0)
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    rows = 2 * nk * dk + 2 * nv * dv + 2 * nv
    in_proj = torch.arange(rows, dtype=torch.float32)
    qkvz, ba = split_gdn_in_proj(in_proj, **sizes)
    query, key, value, z, b, a = layer.fix_query_key_value_ordering(qkvz[None, None], ba[None, None])
    megatron = in_proj.split([nk * dk, nk * dk, nv * dv, nv * dv, nv, nv])
    for hf, want in zip((query, key, value, z, b, a), megatron):
        assert torch.equal(hf.flatten(), want)
    assert torch.equal(merge_gdn_in_proj(qkvz, ba, **sizes), in_proj)


def test_gdn_in_proj_errors_name_the_config_values():
    with pytest.raises(ConfigError, match="linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"):
        split_gdn_in_proj(torch.zeros(10), num_key_heads=2, num_value_heads=3, key_head_dim=1, value_head_dim=1)
    with pytest.raises(ShapeMismatchError, match="in_proj has 19 rows"):
        split_gdn_in_proj(torch.zeros(19, 2), **GDN)


# -- zero-centered norms ---------------------------------------------------------------------------

def test_zero_centered_norm_round_trip():
    weight = torch.arange(-8, 8, dtype=torch.float32) / 8  # exactly representable, so exact both ways
    assert torch.equal(zero_centered_to_gamma(weight), weight + 1)
    assert torch.equal(gamma_to_zero_centered(zero_centered_to_gamma(weight)), weight)
