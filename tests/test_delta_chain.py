"""Tier 1: chain planning and garbage-collection keep sets are pure functions of metadata (tables)."""

from __future__ import annotations

import pytest

from megatron_sync.transports.disk_delta.chain import (
    Held, Lease, Step, VersionInfo, plan_chain, versions_to_keep,
)
from megatron_sync.transports.disk_delta.errors import ChainError, VersionNotPublishedError


def _store(spec: str) -> dict[int, VersionInfo]:
    """Build published versions from "1S 2 3 4S 5": S carries a snapshot; every version after the first
    carries a delta against the one before (content digest "d<v>")."""
    published, previous = {}, None
    for token in spec.split():
        version = int(token.rstrip("S"))
        published[version] = VersionInfo(
            version, f"d{version}", token.endswith("S"),
            previous, None if previous is None else f"d{previous}")
        previous = version
    return published


def _held(version: int, content: str = "") -> Held:
    return Held(version, content or f"d{version}")


def _steps(text: str) -> tuple[Step, ...]:
    return tuple(Step(int(t.rstrip("S")), "snapshot" if t.endswith("S") else "delta") for t in text.split())


PLANS = [
    # store,            held,              target, steps,          fallback reason contains
    ("1S 2 3",          None,              3,      "1S 2 3",      "holds no version"),
    ("1S 2 3",          _held(1),          3,      "2 3",          None),
    ("1S 2 3",          _held(3),          3,      "",             None),  # re-apply: a no-op
    ("1S 2 3 4S 5",     _held(2),          5,      "3 4 5",        None),  # deltas through a snapshot
    ("1S 2 3 4S 5",     _held(2, "other"), 5,      "4S 5",         "base mismatch"),
    ("1S 2 4S 5",       _held(3),          5,      "4S 5",         "wrong base"),  # 4 is a delta against 2
    ("1S 2 4S 5",       _held(2),          5,      "4 5",          None),
    ("1S 2 3 5",        _held(3),          5,      "5",            None),  # version numbers may skip
    ("1S 3S 4 5",       _held(1),          5,      "3 4 5",        None),  # 3's delta is against 1
    ("1S 2 3S 4 5",     _held(3, "x"),     3,      "3S",           "other content"),
    ("2S 3 4",          _held(5),          4,      None,           None),  # ahead: handled by the reader
]


@pytest.mark.parametrize("spec,held,target,steps,reason", PLANS)
def test_plan_chain(spec, held, target, steps, reason):
    published = _store(spec)
    if held is not None and held.version > target:
        plan = plan_chain(published, held, target)
        assert plan.steps[0].part == "snapshot" and "ahead" in plan.fallback_reason
        return
    plan = plan_chain(published, held, target)
    assert plan.steps == _steps(steps)
    if reason is None:
        assert plan.fallback_reason is None
    else:
        assert reason in plan.fallback_reason


def test_gap_falls_back_to_the_newest_snapshot():
    published = _store("1S 2 3 4S 5 6")
    del published[3]
    plan = plan_chain(published, _held(2), 6)
    assert plan.steps == _steps("4S 5 6") and "gap" in plan.fallback_reason


def test_gap_without_a_later_snapshot_is_an_error_naming_the_missing_version():
    published = _store("1S 2 3 4 5")
    del published[3]
    with pytest.raises(ChainError, match=r"version 3, the base of version 4, is missing.*snapshot"):
        plan_chain(published, _held(2), 5)


def test_delta_against_other_content_than_the_published_base_is_an_error():
    published = _store("1S 2 3")
    published[3] = VersionInfo(3, "d3", False, 2, "not-d2")
    with pytest.raises(ChainError, match="wrong base"):
        plan_chain(published, None, 3)


def test_unpublished_target_is_an_error():
    with pytest.raises(VersionNotPublishedError, match="version 9 is not published"):
        plan_chain(_store("1S 2"), _held(2), 9, where=lambda v: f"version {v}")


AROUND_DAMAGE = [
    # store,              held,      target, damaged,  steps     (damaged: parts whose files failed verification)
    ("1S 2 3 4S 5",       _held(2),  5,      "3",      "4S 5"),  # around a damaged delta, from a later snapshot
    ("1S 2 3 4S 5",       _held(2),  5,      "4",      "4S 5"),  # its delta is damaged, its snapshot is not
    ("1S 2 3 4 5S",       _held(2),  5,      "4",      "5S"),
    ("1S 2 3 4S 5",       None,      5,      "4S",     "1S 2 3 4 5"),  # a damaged snapshot: the one before
    ("1S 2 3",            _held(1),  3,      "5",      "2 3"),  # damage elsewhere changes nothing
]


@pytest.mark.parametrize("spec,held,target,damaged,steps", AROUND_DAMAGE)
def test_plans_go_around_damaged_parts(spec, held, target, damaged, steps):
    plan = plan_chain(_store(spec), held, target, damaged=set(_steps(damaged)))
    assert plan.steps == _steps(steps)
    assert not set(plan.steps) & set(_steps(damaged))


def test_damage_with_no_way_around_it_is_an_error_that_waits_for_a_snapshot():
    with pytest.raises(ChainError, match=r"version 3 failed verification and no intact snapshot lies after it; "
                                         r"the writer's next version carries a snapshot"):
        plan_chain(_store("1S 2 3 4"), _held(2), 4, where=lambda v: f"version {v}", damaged={Step(3, "delta")})


def _lease(held=None, reading=()) -> Lease:
    return Lease("r", held, tuple(reading))


KEEP = [
    # store,                 retention, leases,                          kept
    ("1S 2 3 4 5",           2,         [],                              {1, 2, 3, 4, 5}),  # ancestry to the snapshot
    ("1S 2 3 4S 5 6",        2,         [],                              {4, 5, 6}),
    ("1S 2 3 4S 5 6",        3,         [],                              {4, 5, 6}),
    ("1S 2 3 4S 5 6",        4,         [],                              {1, 2, 3, 4, 5, 6}),
    ("1S 2 3 4S 5 6",        1,         [_lease(_held(2))],              {3, 4, 5, 6}),  # its delta chain
    ("1S 2 3 4S 5 6",        1,         [_lease(None, (1, 2))],          {1, 2, 4, 5, 6}),  # being read
    ("1S 2 3 4S 5 6",        1,         [_lease(_held(2, "other"))],     {4, 5, 6}),  # cannot use deltas
    ("1S 2 3 4S 5 6",        1,         [_lease(_held(6))],              {4, 5, 6}),
]


@pytest.mark.parametrize("spec,retention,leases,kept", KEEP)
def test_versions_to_keep(spec, retention, leases, kept):
    assert versions_to_keep(_store(spec), retention, leases) == kept


def test_retention_must_be_positive():
    with pytest.raises(ValueError, match="retention"):
        versions_to_keep(_store("1S"), 0, [])
