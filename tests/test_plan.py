"""SyncPlan: pure tables of cases, no processes."""

from __future__ import annotations

import pytest
import torch

from megatron_sync.core.meta import TensorMeta
from megatron_sync.convert import get_family
from megatron_sync.plan.buckets import build_plan

DEEPSEEK_KEEP_TOGETHER = get_family("deepseek_v3").keep_together
from megatron_sync.plan.buckets import coverage_problem

bf16, f32, i64, u8 = torch.bfloat16, torch.float32, torch.int64, torch.uint8


def T(name, n, dtype=f32):
    return TensorMeta(name, (n,), dtype)


def layout(plan):
    """[(stage, [(name, offset), ...]), ...] for compact expectations."""
    return [(b.stage, [(e.name, e.offset) for e in b.entries]) for b in plan.buckets]


CASES = [
    # id, stages, bucket bytes, expected layout
    ("fits_one_bucket", [[T("a", 4), T("b", 4)]], 64,
     [(0, [("a", 0), ("b", 16)])]),
    ("exact_bound_closes_next", [[T("a", 4), T("b", 4), T("c", 1)]], 32,
     [(0, [("a", 0), ("b", 16)]), (0, [("c", 0)])]),
    ("oversized_alone", [[T("a", 2), T("big", 100), T("b", 2)]], 64,
     [(0, [("a", 0)]), (0, [("big", 0)]), (0, [("b", 0)])]),
    ("stages_never_mix", [[T("a", 1)], [T("b", 1)]], 1024,
     [(0, [("a", 0)]), (1, [("b", 0)])]),
    # itemsize descending inside a bucket: i64 (8) then f32 (4) then bf16 (2) then u8 (1)
    ("aligned_by_itemsize", [[T("h", 3, bf16), T("s", 1, f32), T("q", 2, i64), T("c", 5, u8)]], 1024,
     [(0, [("q", 0), ("s", 16), ("h", 20), ("c", 26)])]),
    ("empty_stage", [[], [T("b", 1)]], 64, [(1, [("b", 0)])]),
]


@pytest.mark.parametrize("stages,bound,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_layout_table(stages, bound, expected):
    plan = build_plan(stages, bound, keep_together=())
    assert layout(plan) == expected
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_invariants(case):
    _, stages, bound, _ = case
    plan = build_plan(stages, bound, keep_together=())
    for b in plan.buckets:
        offset = 0
        for e in b.entries:
            assert e.offset == offset, "no gaps: offsets are cumulative"
            assert e.offset % e.dtype.itemsize == 0, "every offset aligned to its itemsize"
            offset += e.nbytes
        assert b.nbytes == offset
        assert b.nbytes <= bound or len(b.entries) == 1
    assert sorted(m.name for m in plan.tensors()) == sorted(m.name for s in stages for m in s)


def _mla(layer, q=40, kv=40):
    return [
        TensorMeta(f"model.layers.{layer}.self_attn.q_a_proj.weight", (q,), bf16),
        TensorMeta(f"model.layers.{layer}.self_attn.o_proj.weight", (40,), bf16),
        TensorMeta(f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight", (kv,), bf16),
    ]


def _bucket_of(plan, name):
    return next(b.index for b in plan.buckets for e in b.entries if e.name == name)


def test_keep_together_lands_in_one_bucket():
    metas = _mla(1) + _mla(11)
    plan = build_plan([metas], 160, keep_together=DEEPSEEK_KEEP_TOGETHER)  # 80 B per tensor
    for layer in (1, 11):
        q = _bucket_of(plan, f"model.layers.{layer}.self_attn.q_a_proj.weight")
        kv = _bucket_of(plan, f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight")
        assert q == kv
    # without the group, the bound splits q_a from kv_a of layer 1
    split = build_plan([metas], 160, keep_together=())
    assert _bucket_of(split, "model.layers.1.self_attn.q_a_proj.weight") != \
        _bucket_of(split, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight")


def test_keep_together_matches_whole_name_and_same_layer_only():
    metas = [
        TensorMeta("model.layers.1.self_attn.q_a_proj.weight", (40,), bf16),
        TensorMeta("model.layers.11.self_attn.kv_a_proj_with_mqa.weight", (40,), bf16),
        TensorMeta("model.layers.1.self_attn.q_a_proj.weight.extra", (40,), bf16),
    ]
    plan = build_plan([metas], 80, keep_together=DEEPSEEK_KEEP_TOGETHER)
    assert len(plan.buckets) == 3  # nothing grouped: layers differ, suffix breaks fullmatch


def test_oversized_keep_together_unit_gets_its_own_bucket():
    metas = [T("x", 1)] + _mla(2, q=100, kv=100) + [T("y", 1)]
    plan = build_plan([metas], 64, keep_together=DEEPSEEK_KEEP_TOGETHER)
    names = [[e.name for e in b.entries] for b in plan.buckets]
    assert ["model.layers.2.self_attn.q_a_proj.weight",
            "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"] in names


def test_digest_deterministic_and_sensitive():
    stages = [[T("a", 4), T("b", 4, bf16)], [T("c", 8, i64)]]
    d = build_plan(stages, 64).digest()
    assert d == build_plan([list(s) for s in stages], 64).digest()
    assert len(d) == 64
    assert d != build_plan(stages, 32).digest()
    assert d != build_plan([[T("a", 4), T("b", 4, f32)], [T("c", 8, i64)]], 64).digest()
    assert d != build_plan([[T("a", 4), T("b", 4, bf16), T("c", 8, i64)]], 64).digest()


def test_for_stage_and_totals():
    plan = build_plan([[T("a", 4)], [T("b", 4), T("c", 100)]], 64, keep_together=())
    assert [b.stage for b in plan.for_stage(1)] == [1, 1]
    assert plan.total_bytes == 16 + 16 + 400
    assert plan.max_bucket_bytes == 400


@pytest.mark.parametrize("stages,bound,match", [
    ([[T("a", 1)], [T("a", 1)]], 64, "stage 0 and stage 1"),
    ([[T("a", 1)]], 0, "bucket_size_bytes"),
])
def test_rejects_bad_input(stages, bound, match):
    with pytest.raises(ValueError, match=match):
        build_plan(stages, bound)


def test_coverage_problem_names_missing_unexpected_and_mismatched():
    sent = [T("a", 4), T("b", 4), T("extra", 1)]
    expected = [T("a", 4), T("b", 4, bf16), T("gone", 2)]
    problem = coverage_problem(sent, expected)
    assert "missing" in problem and "'gone'" in problem
    assert "unexpected" in problem and "'extra'" in problem
    assert "b: sent (4,) torch.float32, engine expects (4,) torch.bfloat16" in problem
    assert coverage_problem(sent, list(sent)) is None
