"""The scale model against this machine's measurements: predict every configuration `make bench`
(bench_sync.py: broadcast) and bench_scale_local.py (every other transport) timed, from this machine's
rates (bench_scale_rates.py, taken separately, on other models), and compare.

    PYTHONPATH=. .venv/bin/python bench/bench_scale_rates.py --out rates.json
    PYTHONPATH=. .venv/bin/python bench/bench_sync.py --reps 5 --json bench.json
    PYTHONPATH=. .venv/bin/python bench/bench_scale_local.py --json local.json
    PYTHONPATH=. .venv/bin/python bench/bench_scale_check.py bench.json --local local.json --rates rates.json

(bench/bench_scale_validate.py runs the four in that order.) The prediction uses the same plans the sync
builds (megatron_sync.scale.plans over the bench's tiny models: trainer EP=2 or TP=2 on two processes, one
engine of TP=2 with the reference engine's whole vocabulary; colocated for ipc) and
`megatron_sync.scale.timing` on the `local` profile. Nothing here reads the bench's own phase times. A
transport whose rates the rates file lacks is reported as not predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_sync import MODELS  # noqa: E402

from megatron_sync.core.metrics import align  # noqa: E402
from megatron_sync.scale.hardware import RATES_FILE, local_profile  # noqa: E402
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout  # noqa: E402
from megatron_sync.scale.plans import ScalePlanner  # noqa: E402
from megatron_sync.scale.timing import SyncOptions, missing_rates, predict  # noqa: E402
from tests.support.models import hf_config  # noqa: E402


def bench_planner(name: str, colocated: bool = False) -> ScalePlanner:
    """The bench's own layouts: 2 trainer processes (MoE EP=2, dense TP=2), one reference engine of TP=2."""
    spec, layout = MODELS[name]
    tp, ep = layout.get("tp", 1), layout.get("ep", 1)
    trainer = TrainerLayout(tp=tp, ep=ep, dp=2 // tp, gpus_per_node=4)
    fleet = FleetLayout(engines=1, tp=2, vocab_parallel=False, colocated=colocated, gpus_per_node=4)
    return ScalePlanner(spec.family, hf_config(spec), trainer, fleet)


def predict_row(row: dict, profile, planners: dict):
    """Return the prediction of one measured row (`transport` "broadcast" when bench_sync measured it)."""
    name = row.get("transport", "broadcast")
    transport, _, backend = name.partition("-")
    key = (row["model"], transport == "ipc")
    planner = planners.get(key) or planners.setdefault(key, bench_planner(row["model"], colocated=key[1]))
    options = SyncOptions(p2p_backend=backend or "nixl")
    missing = missing_rates(transport, profile, planner.trainer.tp, options)
    if missing:
        return None, f"not predicted: the rates file lacks {missing}"
    summary = planner.plan(transport, bucket_bytes=int(row["bucket_mb"] * 2**20))
    return predict(summary, profile, options), ""


def _stats(errors: list[float]) -> str:
    if not errors:
        return "nothing predicted"
    worst = max(errors, key=abs)
    return (f"{sum(abs(e) <= 0.25 for e in errors)} of {len(errors)} within 25%; worst {100 * worst:+.0f}%, "
            f"median |error| {100 * statistics.median(abs(e) for e in errors):.0f}%")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", nargs="?", default=None, help="bench_sync.py --json output (broadcast)")
    parser.add_argument("--local", default=None, help="bench_scale_local.py --json output (other transports)")
    parser.add_argument("--rates", default=RATES_FILE)
    args = parser.parse_args(argv)
    rows = []
    for path in filter(None, (args.bench_json, args.local)):
        with open(path) as f:
            rows += json.load(f)["rows"]
    profile = local_profile(args.rates)
    planners: dict = {}
    table, errors = [], {}
    for row in rows:
        p, why = predict_row(row, profile, planners)
        name = row.get("transport", "broadcast")
        rounds = row.get("sync_rounds") or [row["sync_s"]]
        measured = f"{row['sync_s']:.3f}", f"{min(rounds):.3f}-{max(rounds):.3f}"
        if p is None:
            table.append([row["model"], name, f"{row['bucket_mb']:g}", *measured, "-", "-", why])
            continue
        error = (p.seconds - row["sync_s"]) / row["sync_s"]
        errors.setdefault(name, []).append(error)
        table.append([row["model"], name, f"{row['bucket_mb']:g}", *measured, f"{p.seconds:.3f}",
                      f"{100 * error:+.0f}%", p.bound])
    print(f"rates: {args.rates} ({profile.description})")
    print(align(["model", "transport", "MiB", "measured s (median)", "rounds min-max", "predicted s", "error",
                 "bounded by"], table))
    print()
    for name, errs in errors.items():
        print(f"{name}: {_stats(errs)}")
    print(f"all: {_stats([e for errs in errors.values() for e in errs])}")


if __name__ == "__main__":
    main()
