"""The scale model against `make bench`: predict every configuration of bench_sync.py from this machine's
measured rates (bench_scale_rates.py, taken separately) and compare with the sync times bench_sync measured.

    PYTHONPATH=. .venv/bin/python bench/bench_scale_rates.py                       # rates, written to the package
    PYTHONPATH=. .venv/bin/python bench/bench_sync.py --reps 5 --json /tmp/bench.json
    PYTHONPATH=. .venv/bin/python bench/bench_scale_check.py /tmp/bench.json [--rates other_rates.json]

The prediction uses the same plans the sync builds (megatron_sync.scale.plans over the bench's tiny models:
trainer EP=2 or TP=2 on two processes, one engine of TP=2 with the reference engine's whole vocabulary)
and `megatron_sync.scale.timing` on the `local` profile. Nothing here reads the bench's own phase times.
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
from megatron_sync.scale.timing import predict  # noqa: E402
from tests.support.models import hf_config  # noqa: E402


def bench_planner(name: str) -> ScalePlanner:
    """The bench's own layouts: 2 trainer processes (MoE EP=2, dense TP=2), one reference engine of TP=2."""
    spec, layout = MODELS[name]
    tp, ep = layout.get("tp", 1), layout.get("ep", 1)
    trainer = TrainerLayout(tp=tp, ep=ep, dp=2 // tp, gpus_per_node=4)
    fleet = FleetLayout(engines=1, tp=2, vocab_parallel=False, gpus_per_node=4)
    return ScalePlanner(spec.family, hf_config(spec), trainer, fleet)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", help="bench_sync.py --json output")
    parser.add_argument("--rates", default=RATES_FILE)
    args = parser.parse_args(argv)
    with open(args.bench_json) as f:
        measured = json.load(f)
    profile = local_profile(args.rates)
    planners: dict[str, ScalePlanner] = {}
    table, errors = [], []
    for row in measured["rows"]:
        planner = planners.get(row["model"]) or planners.setdefault(row["model"], bench_planner(row["model"]))
        p = predict(planner.plan("broadcast", bucket_bytes=int(row["bucket_mb"] * 2**20)), profile)
        error = (p.seconds - row["sync_s"]) / row["sync_s"]
        errors.append(error)
        rounds = row.get("sync_rounds") or [row["sync_s"]]
        table.append([row["model"], f"{row['bucket_mb']:g}", str(row["buckets"]), f"{row['sync_s']:.3f}",
                      f"{min(rounds):.3f}-{max(rounds):.3f}", f"{p.seconds:.3f}", f"{100 * error:+.0f}%",
                      f"{row['sync_cpu']:.3f}", f"{p.cpu_seconds:.3f}", p.bound])
    print(f"rates: {args.rates} ({profile.description})")
    print(align(["model", "MiB", "buckets", "measured s (median)", "rounds min-max", "predicted s", "error",
                 "measured CPU-s", "predicted CPU-s", "bounded by"], table))
    worst = max(errors, key=abs)
    within = sum(abs(e) <= 0.25 for e in errors)
    print(f"\n{within} of {len(errors)} configurations within 25%; worst {100 * worst:+.0f}%, median |error| "
          f"{100 * statistics.median(abs(e) for e in errors):.0f}%")


if __name__ == "__main__":
    main()
