"""Pure tests of the pattern grammar and the layout transform pairs (arange tensors, exact)."""

from __future__ import annotations

import pytest
import torch

from megatron_sync.convert.errors import ConfigError, ShapeMismatchError
from megatron_sync.convert.layout import (
    merge_gate_up, merge_qkv, pad_vocab, split_gate_up, split_qkv, trim_vocab,
)
from megatron_sync.convert.patterns import Pattern, compile_pattern, translate

# -- pattern grammar ------------------------------------------------------------------------

@pytest.mark.parametrize("template, name, captures", [
    ("decoder.layers.{layer}.mlp.linear_fc2.weight", "decoder.layers.1.mlp.linear_fc2.weight", {"layer": 1}),
    ("decoder.layers.{layer}.mlp.linear_fc2.weight", "decoder.layers.11.mlp.linear_fc2.weight", {"layer": 11}),
    ("decoder.layers.{layer}.mlp.experts.linear_fc1.weight{expert}",
     "decoder.layers.3.mlp.experts.linear_fc1.weight17", {"layer": 3, "expert": 17}),
    ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", {}),
    # anchored: no prefix, no suffix, no substring
    ("decoder.layers.1.x", "decoder.layers.11.x", None),
    ("decoder.layers.{layer}.x", "module.decoder.layers.1.x", None),
    ("decoder.layers.{layer}.x", "decoder.layers.1.x.extra", None),
    ("decoder.layers.{layer}.x", "decoder.layers.1.y.x", None),
    # the dot is literal, not "any character"
    ("decoder.layers.{layer}.x", "decoder-layers.1.x", None),
    # wildcards are decimal indices without leading zeros, never empty
    ("decoder.layers.{layer}.x", "decoder.layers..x", None),
    ("decoder.layers.{layer}.x", "decoder.layers.a.x", None),
    ("decoder.layers.{layer}.x", "decoder.layers.01.x", None),
    ("decoder.layers.{layer}.mlp.experts.linear_fc1.weight{expert}",
     "decoder.layers.3.mlp.experts.linear_fc1.weight", None),
])
def test_pattern_matches_whole_name_only(template, name, captures):
    assert Pattern(template).match(name) == captures


def test_pattern_round_trips_in_both_directions():
    meg = "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight"
    hf = "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
    m_name = "decoder.layers.12.mlp.experts.local_experts.7.linear_fc2.weight"
    h_name = "model.layers.12.mlp.experts.7.down_proj.weight"
    assert translate(m_name, meg, hf) == h_name
    assert translate(h_name, hf, meg) == m_name
    assert translate("decoder.layers.12.mlp.linear_fc2.weight", meg, hf) is None
    assert compile_pattern(meg) is compile_pattern(meg)  # compiled once


def test_pattern_rejects_unknown_wildcard():
    with pytest.raises(ValueError, match=r"unknown wildcard \{head\}"):
        Pattern("decoder.layers.{head}.x")


def test_pattern_format_requires_its_fields():
    with pytest.raises(ValueError, match="needs"):
        Pattern("model.layers.{layer}.x").format(expert=1)


# -- QKV ------------------------------------------------------------------------------------

QKV_CASES = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=3),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=2),
    "mha": dict(num_attention_heads=3, num_key_value_heads=3, head_dim=2),
}


@pytest.mark.parametrize("case", QKV_CASES)
@pytest.mark.parametrize("trailing", [(5,), ()], ids=["weight", "bias"])
def test_qkv_round_trip_and_interleaving(case, trailing):
    c = QKV_CASES[case]
    nq, ng, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    rows = ng * (nq // ng + 2) * d
    qkv = torch.arange(rows * (trailing[0] if trailing else 1)).reshape(rows, *trailing)
    q, k, v = split_qkv(qkv, **c)
    assert q.shape == (nq * d, *trailing) and k.shape == v.shape == (ng * d, *trailing)
    assert torch.equal(merge_qkv(q, k, v, **c), qkv)
    # Trace rows: group g holds its nq/ng query heads, then its key head, then its value head.
    row_of = qkv[:, 0] if trailing else qkv
    per = nq // ng
    group = (per + 2) * d
    for g in range(ng):
        for j in range(per):
            head = g * per + j
            assert torch.equal((q[:, 0] if trailing else q)[head * d:(head + 1) * d],
                               row_of[g * group + j * d: g * group + (j + 1) * d])
        assert torch.equal((k[:, 0] if trailing else k)[g * d:(g + 1) * d],
                           row_of[g * group + per * d: g * group + (per + 1) * d])
        assert torch.equal((v[:, 0] if trailing else v)[g * d:(g + 1) * d],
                           row_of[g * group + (per + 1) * d: (g + 1) * group])


def test_qkv_known_values_gqa():
    # nq=2, ng=1, d=1: rows are [q0, q1, k0, v0]
    q, k, v = split_qkv(torch.arange(4), num_attention_heads=2, num_key_value_heads=1, head_dim=1)
    assert q.tolist() == [0, 1] and k.tolist() == [2] and v.tolist() == [3]
    # nq=2, ng=2, d=1: rows are [q0, k0, v0, q1, k1, v1]
    q, k, v = split_qkv(torch.arange(6), num_attention_heads=2, num_key_value_heads=2, head_dim=1)
    assert q.tolist() == [0, 3] and k.tolist() == [1, 4] and v.tolist() == [2, 5]


def test_split_qkv_names_config_values_on_bad_rows():
    with pytest.raises(ShapeMismatchError, match="num_attention_heads, num_key_value_heads and head_dim"):
        split_qkv(torch.zeros(10, 4), num_attention_heads=4, num_key_value_heads=2, head_dim=2)
    with pytest.raises(ConfigError, match="not a multiple of num_key_value_heads=3"):
        split_qkv(torch.zeros(10, 4), num_attention_heads=4, num_key_value_heads=3, head_dim=2)


# -- gate/up and vocabulary ---------------------------------------------------------------------

def test_gate_up_round_trip():
    fc1 = torch.arange(6 * 4).reshape(6, 4)
    gate, up = split_gate_up(fc1)
    assert torch.equal(gate, fc1[:3]) and torch.equal(up, fc1[3:])
    assert torch.equal(merge_gate_up(gate, up), fc1)
    with pytest.raises(ShapeMismatchError, match="odd number of rows"):
        split_gate_up(torch.zeros(5, 4))


def test_vocab_trim_pad_round_trip():
    emb = torch.arange(10 * 3).reshape(10, 3)
    padded = pad_vocab(emb, padded_vocab_size=16)
    assert padded.shape == (16, 3) and not padded[10:].any()
    assert torch.equal(trim_vocab(padded, vocab_size=10), emb)
    assert torch.equal(trim_vocab(emb, vocab_size=10), emb)
    with pytest.raises(ShapeMismatchError, match="fewer than the HF config's vocab_size=11"):
        trim_vocab(emb, vocab_size=11)
