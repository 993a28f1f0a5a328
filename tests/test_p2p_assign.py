"""The distributed replica assignment as tables of invariants (pure, no processes)."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_sync.transports.p2p.assign import ReplicaUnit, TrainerRank, assign_replica, candidates


def grid(tp=1, dp=1, pp=1, ep=1, etp=1) -> list[TrainerRank]:
    """Return trainer ranks of a Megatron-like grid: dense tp-dp-pp, expert etp-ep-edp-pp."""
    per_stage = tp * dp
    assert per_stage % (ep * etp) == 0
    edp = per_stage // (ep * etp)
    ranks = []
    for rank in range(per_stage * pp):
        pp_rank, local = divmod(rank, per_stage)
        dp_rank, tp_rank = divmod(local, tp)
        edp_rank, rest = divmod(local, ep * etp)
        ep_rank, etp_rank = divmod(rest, etp)
        ranks.append(TrainerRank(rank, pp=pp_rank, tp=tp_rank, dp=dp_rank, ep=ep_rank, etp=etp_rank, edp=edp_rank))
    return ranks


def model_units(pp=1, ep=1, layers=4, experts=8, seed=0) -> list[ReplicaUnit]:
    """Return a stage-by-stage unit list: embeddings, per-layer attention/MLP, routed experts."""
    rng = random.Random(seed)
    units = [ReplicaUnit("embedding", 0, (("model.embed_tokens.weight", 32000),))]
    for layer in range(layers):
        stage = layer * pp // layers
        a = f"model.layers.{layer}.self_attn."
        units.append(ReplicaUnit(f"L{layer}.qkv", stage, ((a + "q_proj.weight", 4096), (a + "k_proj.weight", 1024),
                                                           (a + "v_proj.weight", 1024))))
        units.append(ReplicaUnit(f"L{layer}.proj", stage, ((a + "o_proj.weight", 4096),)))
        units.append(ReplicaUnit(f"L{layer}.norm", stage, ((f"model.layers.{layer}.input_layernorm.weight", 128),)))
        for e in range(experts):
            x = f"model.layers.{layer}.mlp.experts.{e}."
            size = rng.choice([2048, 2048, 3072])
            units.append(ReplicaUnit(f"L{layer}.e{e}.fc1", stage, ((x + "gate_proj.weight", size), (x + "up_proj.weight", size)),
                                     owner_ep=e * ep // experts))
            units.append(ReplicaUnit(f"L{layer}.e{e}.fc2", stage, ((x + "down_proj.weight", size),), owner_ep=e * ep // experts))
    units.append(ReplicaUnit("output", pp - 1, (("lm_head.weight", 32000),)))
    return units


LAYOUTS = [
    pytest.param(dict(tp=2), dict(), id="tp2"),
    pytest.param(dict(tp=2, dp=2), dict(), id="tp2-dp2"),
    pytest.param(dict(dp=2, ep=2), dict(ep=2), id="ep2"),
    pytest.param(dict(tp=2, dp=2, ep=2, etp=2), dict(ep=2), id="tp2-ep2"),
    pytest.param(dict(tp=2, dp=4, ep=4, etp=2), dict(ep=4), id="tp2-dp4-ep4-etp2"),
    pytest.param(dict(pp=2), dict(pp=2), id="pp2"),
    pytest.param(dict(tp=2, pp=2, dp=2, ep=2), dict(pp=2, ep=2), id="tp2-pp2-ep2"),
]


@pytest.mark.parametrize("grid_kw,unit_kw", LAYOUTS)
def test_every_unit_goes_to_a_rank_of_its_stage_and_expert_owner(grid_kw, unit_kw):
    ranks, units = grid(**grid_kw), model_units(**unit_kw)
    by_rank = {r.rank: r for r in ranks}
    a = assign_replica(units, ranks)
    for unit, holder in zip(units, a.holders):
        r = by_rank[holder]
        assert r.pp == unit.stage, unit.name
        if unit.owner_ep is not None:
            assert r.ep == unit.owner_ep, f"{unit.name} hopped from EP rank {unit.owner_ep} to {r.ep}"


@pytest.mark.parametrize("grid_kw,unit_kw", LAYOUTS)
def test_held_bytes_add_up_and_are_balanced_within_the_largest_unit(grid_kw, unit_kw):
    ranks, units = grid(**grid_kw), model_units(**unit_kw)
    held = assign_replica(units, ranks).bytes_per_rank()
    assert sum(held.values()) == sum(u.nbytes for u in units)
    largest = max(u.nbytes for u in units)
    for stage in {r.pp for r in ranks}:
        loads = [held[r.rank] for r in ranks if r.pp == stage]
        assert max(loads) - min(loads) <= largest, (stage, loads)
        assert min(loads) > 0, "a rank of the stage holds nothing though there is work"


@pytest.mark.parametrize("grid_kw,unit_kw", LAYOUTS)
def test_one_megatron_tensor_stays_on_one_rank(grid_kw, unit_kw):
    ranks, units = grid(**grid_kw), model_units(**unit_kw)
    a = assign_replica(units, ranks)
    hf = a.hf_holders()
    for unit, holder in zip(units, a.holders):
        assert {hf[name] for name, _ in unit.hf} == {holder}


def test_assignment_is_deterministic_and_independent_of_rank_order():
    ranks, units = grid(tp=2, dp=2, ep=2, etp=2), model_units(ep=2)
    first = assign_replica(units, ranks)
    shuffled = list(ranks)
    random.Random(3).shuffle(shuffled)
    again = assign_replica(units, shuffled)
    assert first.holders == again.holders and first.digest() == again.digest()
    assert assign_replica(units[:-1], ranks).digest() != first.digest()


@pytest.mark.parametrize("sizes,ranks_n,want", [
    ([10, 10], 2, [0, 1]),
    ([10, 5, 5], 2, [0, 1, 1]),
    ([1, 2, 3, 4], 2, [0, 1, 1, 0]),  # largest first: 4->r0, 3->r1, 2->r1, 1->r0
    ([7], 4, [0]),
])
def test_greedy_largest_first_table(sizes, ranks_n, want):
    units = [ReplicaUnit(f"u{i}", 0, ((f"t{i}", s),)) for i, s in enumerate(sizes)]
    assert list(assign_replica(units, [TrainerRank(r) for r in range(ranks_n)]).holders) == want


def test_a_cost_per_hf_tensor_overrides_bytes():
    units = [ReplicaUnit("embed", 0, (("e", 100),)), ReplicaUnit("a", 0, (("a", 60),)), ReplicaUnit("b", 0, (("b", 60),))]
    ranks = [TrainerRank(0), TrainerRank(1)]
    assert list(assign_replica(units, ranks).holders) == [0, 1, 1]
    sent = {"e": 400, "a": 60, "b": 60}  # the embedding goes to 4 receivers whole
    a = assign_replica(units, ranks, cost=sent)
    assert list(a.holders) == [0, 1, 1] and a.bytes_per_rank() == {0: 100, 1: 120}


def test_missing_candidates_and_duplicate_names_are_errors():
    with pytest.raises(ValueError, match="EP owner 3"):
        candidates(ReplicaUnit("x", 0, (("x", 1),), owner_ep=3), grid(dp=2, ep=2))
    with pytest.raises(ValueError, match="unique"):
        assign_replica([ReplicaUnit("x", 0, ()), ReplicaUnit("x", 0, ())], grid())


def test_report_lists_every_rank_with_its_bytes():
    a = assign_replica(model_units(ep=2), grid(tp=2, dp=2, ep=2, etp=2))
    lines = a.report().splitlines()
    assert len(lines) == 4 and all("bytes" in line for line in lines)
    assert list(itertools.chain(*[[int(line.split()[-2])] for line in lines])) == list(a.bytes_per_rank().values())
