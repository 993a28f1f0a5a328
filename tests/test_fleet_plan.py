"""The fleet's roster and wave plans, as tables (pure)."""

from __future__ import annotations

import pytest

from megatron_sync.fleet.roster import EngineRecord, EngineState, FleetTooSmall, Roster
from megatron_sync.fleet.waves import TRAINER, Delivery, plan_waves


def _engines(*specs):
    """(id, layout digest) pairs -> serving records at version 0 (ids: letters a.. -> 0..)."""
    return [EngineRecord(ord(e) - ord("a"), 0, EngineState.SERVING, 0, layout) for e, layout in specs]


def _letter(engine):
    return engine if engine == TRAINER else chr(ord("a") + engine)


def _waves(plan):
    return [[(_letter(d.engine), _letter(d.source)) for d in wave] for wave in plan]


@pytest.mark.parametrize("wave_size,relay,want", [
    (0, False, [[("a", TRAINER), ("b", TRAINER), ("c", TRAINER)]]),
    (1, False, [[("a", TRAINER)], [("b", TRAINER)], [("c", TRAINER)]]),
    (2, False, [[("a", TRAINER), ("b", TRAINER)], [("c", TRAINER)]]),
    # relay: the trainer feeds one engine; holders double every wave
    (0, True, [[("a", TRAINER)], [("b", "a")], [("c", "a"), ("d", "b")]]),
    (1, True, [[("a", TRAINER)], [("b", "a")], [("c", "a")], [("d", "a")]]),
])
def test_waves_and_relay_sources(wave_size, relay, want):
    engines = _engines(("a", "L"), ("b", "L"), ("c", "L")) if not relay else \
        _engines(("a", "L"), ("b", "L"), ("c", "L"), ("d", "L"))
    assert _waves(plan_waves(engines, wave_size=wave_size, relay=relay)) == want


def test_relay_feeds_one_engine_per_layout_and_never_across_layouts():
    engines = _engines(("a", "L1"), ("b", "L2"), ("c", "L1"), ("d", "L2"), ("e", ""))
    plan = plan_waves(engines, relay=True)
    assert _waves(plan) == [[("a", TRAINER), ("b", TRAINER), ("e", TRAINER)], [("c", "a"), ("d", "b")]]
    from_trainer = [d.engine for wave in plan for d in wave if not d.relayed]
    assert from_trainer == [0, 1, 4]  # one per layout, and the engine of unknown layout


def test_engines_that_already_hold_the_version_serve_from_the_first_wave():
    holders = _engines(("z", "L"))
    assert _waves(plan_waves(_engines(("a", "L"), ("b", "L")), holders, relay=True)) == [[("a", "z")], [("b", "z")]]
    assert plan_waves([], holders, relay=True) == []


def test_a_bad_wave_size_is_refused():
    with pytest.raises(ValueError, match="wave_size=-1"):
        plan_waves(_engines(("a", "L")), wave_size=-1)


def test_roster_generations_events_and_the_minimum():
    clock = iter(range(100))
    roster = Roster(clock=lambda: next(clock))
    roster.admit(0, 0, "L")
    roster.admit(1, 0, "L")
    roster.committed(0, 1)
    roster.committed(1, 1)
    assert [(r.engine, r.version) for r in roster.active()] == [(0, 1), (1, 1)]
    roster.leave(1, "its rank 1 died mid-sync")
    with pytest.raises(FleetTooSmall, match=r"1 engine\(s\) left.*min_engines=2 \(gone: engines \[1\]\)"):
        roster.check_minimum(2)
    roster.check_minimum(1)
    roster.check_minimum(None)
    back = roster.admit(1, 1, "L")
    assert (back.generation, back.state, back.version) == (1, EngineState.SERVING, 0)
    with pytest.raises(ValueError, match="engine 1 is already in the fleet as generation 1"):
        roster.admit(1, 1, "L")
    assert [(e["engine"], e["event"], e["generation"]) for e in roster.take_events()] == [
        (0, "joined", 0), (1, "joined", 0), (1, "left", 0), (1, "rejoined", 1)]
    assert roster.take_events() == []


def test_a_delivery_knows_whether_it_is_relayed_and_travels_as_json():
    assert Delivery(1, 0).relayed and not Delivery(0, TRAINER).relayed
    assert [Delivery.from_wire(d.to_wire()) for d in (Delivery(1, 0), Delivery(0, TRAINER))] == \
        [Delivery(1, 0), Delivery(0, TRAINER)]
