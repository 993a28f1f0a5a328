"""Logprob drift on a canary, every version: each engine scores a fixed token sequence after it commits, the
trainer scores it with its own Megatron forward, and the drift per engine is recorded (and bounded).

Pure: the canary's ids and the drift figures. Through the drivers (a Megatron trainer of TP=2 and a reference
engine of two ranks, float32): with correct weights and config the drift stays within float32's tolerance
every version; with the engine's rotary base changed (exact weights, different computation) the drift
crosses the bound and the sync fails naming the engine, or only warns, per `on_drift`.
"""

from __future__ import annotations

import json

import pytest

from megatron_sync.core.canary import canary_tokens, drift


def test_the_canary_is_the_same_for_every_rank_and_run_and_checks_given_ids():
    assert canary_tokens(100, length=8, seed=3) == canary_tokens(100, length=8, seed=3)
    assert canary_tokens(100, length=8, seed=3) != canary_tokens(100, length=8, seed=4)
    assert all(0 <= t < 100 for t in canary_tokens(100, length=64, seed=0))
    assert canary_tokens(100, length=8, seed=0, tokens=[5, 6, 7]) == [5, 6, 7]
    with pytest.raises(ValueError, match=r"canary_tokens must be at least 2 ids in \[0, 100\)"):
        canary_tokens(100, length=0, seed=0, tokens=[5, 100])


def test_drift_is_the_largest_and_mean_absolute_gap():
    assert drift([-1.0, -2.0, -3.0], [-1.0, -2.5, -2.0]) == {"max": 1.0, "mean": 0.5}
    with pytest.raises(ValueError, match="the engine scored 2 canary positions, the trainer 3"):
        drift([-1.0, -2.0, -3.0], [-1.0, -2.0])


def _drift_rows(trainer: dict) -> list[dict]:
    return [json.loads(m).get("drift", {}) for m in trainer["metrics"]]


CANARY = {"canary_length": 16, "canary_seed": 7, "max_logprob_drift": 1e-3}
CASE = {"spec": {"family": "qwen3"}, "layout": {"tp": 2}, "engine_tp": 2, "versions": 2, "keep_tensors": False}


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_exact_engines_stay_within_float32_and_a_wrong_rope_base_fails_the_sync_naming_the_engine():
    from tests.support.jobs import run_pair

    trainers, _ = run_pair({**CASE, "weight_sync": CANARY}, timeout=360)
    rows = _drift_rows(trainers[0])
    print(f"\ndrift per version, exact engine: {rows}")
    assert [sorted(r) for r in rows] == [["0"], ["0"]], rows  # engine 0, every version
    assert all(r["0"]["max"] < 1e-4 for r in rows), rows  # float32: the same weights, kernels of their own

    wrong = {**CASE, "versions": 1, "record_failures": True, "engine_rope_base": 500.0, "weight_sync": CANARY}
    trainers, _ = run_pair(wrong, timeout=360)
    (failure,) = trainers[0]["failures"]
    assert "DriftError" in failure["text"] and "engine 0: max |Δ log p|" in failure["text"], failure["text"][-1500:]


@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_on_drift_warn_records_the_drift_and_goes_on():
    from tests.support.jobs import run_pair

    case = {**CASE, "engine_rope_base": 500.0, "weight_sync": {**CANARY, "on_drift": "warn"}}
    trainers, engines = run_pair(case, timeout=360)
    assert not trainers[0]["failures"]
    rows = _drift_rows(trainers[0])
    print(f"\ndrift per version, rope base 500: {rows}")
    assert all(r["0"]["max"] > 1e-3 for r in rows), rows
    assert [h["version"] for h in engines[0]["held"]] == [1, 2]
