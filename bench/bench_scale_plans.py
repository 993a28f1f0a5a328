"""What the scale model's plans cost at full size: seconds and peak memory (tracemalloc) per planner.

For each bundled large model at a typical layout (trainer and engines of 32 nodes each for the largest),
on meta tensors: the planner's set-up (converter, Megatron side, gather units, engine regions), then each
transport's plan (P2P: the items `balance` assigns, as `scale.p2p_plan` builds them without pieces).
Times run without tracemalloc; memory comes from a second run under tracemalloc (which slows Python down).

    PYTHONPATH=. .venv/bin/python bench/bench_scale_plans.py
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_sync import load_average, machine_description  # noqa: E402

from megatron_sync.core.metrics import align  # noqa: E402
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout  # noqa: E402
from megatron_sync.scale.models import model_named  # noqa: E402
from megatron_sync.scale.plans import ScalePlanner  # noqa: E402

CASES = (
    ("qwen3-235b-a22b", TrainerLayout(tp=4, pp=4, cp=2, dp=2, ep=16), FleetLayout(engines=2, tp=32, expert_parallel=True)),
    ("glm-4.5", TrainerLayout(tp=4, pp=8, dp=2, ep=8), FleetLayout(engines=4, tp=16, expert_parallel=True)),
    ("deepseek-v3", TrainerLayout(tp=8, pp=8, cp=2, ep=16, first_layers=7, last_layers=6),
     FleetLayout(engines=4, tp=32, expert_parallel=True)),
    ("kimi-k2", TrainerLayout(tp=8, pp=8, cp=4, ep=32), FleetLayout(engines=8, tp=32, expert_parallel=True)),
)
BUCKET = 1 << 30


def _config(name: str) -> tuple[str, dict]:
    family, config = model_named(name)
    config = copy.deepcopy(config)
    if config.get("quantization_config"):
        config["quantization_config"]["weight_block_size"] = [64, 64]  # divides TP=32 slices of every weight
    return family, config


def measure(fn, memory: bool) -> tuple[float, int | None, object]:
    if memory:
        tracemalloc.start()
    started = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] if memory else None
    if memory:
        tracemalloc.stop()
    return seconds, peak, value


def run_case(name: str, trainer: TrainerLayout, fleet: FleetLayout, memory: bool) -> list[list[str]]:
    family, config = _config(name)
    seconds, peak, planner = measure(lambda: ScalePlanner(family, config, trainer, fleet), memory)
    rows = [["set-up", seconds, peak, f"{len(planner.specs):,} HF tensors, "
                                      f"{sum(len(u) for u in planner.units):,} gather units"]]
    for transport in ("broadcast", "p2p", "disk_delta"):
        s, p, summary = measure(lambda: planner.plan(transport, bucket_bytes=BUCKET), memory)
        what = {"broadcast": f"{summary.extra.get('buckets', 0):,} buckets",
                "p2p": f"{summary.extra['p2p'].items:,} items balanced, busiest / mean "
                       f"{summary.extra['busiest_over_mean']:.3f}" if transport == "p2p" else "",
                "disk_delta": f"{sum(e.messages for e in summary.senders):,} chunks"}[transport]
        rows.append([transport, s, p, what])
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(c[0] for c in CASES))
    args = parser.parse_args(argv)
    print("command: python " + " ".join(sys.argv))
    print(machine_description(), flush=True)
    table = []
    for name, trainer, fleet in CASES:
        if name not in args.models.split(","):
            continue
        timed = run_case(name, trainer, fleet, False)
        traced = run_case(name, trainer, fleet, True)
        for (what, seconds, _, note), (_, _, peak, _) in zip(timed, traced):
            table.append([name, f"{trainer.nodes}+{fleet.nodes(trainer)}", what, f"{seconds:.1f}",
                          f"{peak / 2**20:,.0f}", note])
        print(f"{name} done; load average {load_average()}", file=sys.stderr, flush=True)
    print(align(["model", "nodes", "planner", "seconds", "peak MiB (tracemalloc)", "what it planned"], table))
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
