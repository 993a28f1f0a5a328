"""Every transport built here, on `make bench`'s models, for the scale model's check on this machine.

`make bench` (bench_sync.py) times broadcast; this times the same six models (trainer EP=2 or TP=2 on two
processes, one reference engine of TP=2, bf16) over every other transport, through the library's drivers
as separate trainer and inference jobs (`tests/support/jobs.py::run_pair`): p2p with each backend the
settings accept (`settings.config.P2P_BACKENDS`), disk_delta (shared and local directories under a
temporary directory) and colocated ipc. Per (model, transport): `--versions` syncs with a training step
between them, the first a warm-up; the sync time of a version is its slowest trainer rank's
`SyncMetrics` total (disk_delta: what `sync()` waits for, the conversion into the writer's buffer);
medians over the measured versions. Nothing asserts on time.

    PYTHONPATH=. .venv/bin/python bench/bench_scale_local.py --json local.json
    PYTHONPATH=. .venv/bin/python bench/bench_scale_local.py --models moe-small --transports p2p-torch,ipc
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_sync import MODELS, load_average, machine_description  # noqa: E402

from megatron_sync.core.metrics import align  # noqa: E402
from megatron_sync.settings.config import P2P_BACKENDS  # noqa: E402

NIXL_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}  # UCX's TCP transport on loopback (no RDMA here)
TRANSPORTS = {
    "broadcast": {"transport": "broadcast"},
    **{f"p2p-{b}": {"transport": "p2p", "p2p_backend": b, **({"p2p_local_hostname": "127.0.0.1"}
                                                             if b == "mooncake" else {})} for b in P2P_BACKENDS},
    "disk_delta": {"transport": "disk_delta", "delta_encode_threads": 1, "delta_snapshot_every": 5,
                   "delta_when_behind": "block"},
    "ipc": {"transport": "ipc"},
}


def _settings(name: str, tmp: str) -> dict:
    settings = dict(TRANSPORTS[name])
    if name == "disk_delta":
        settings.update(delta_dir=os.path.join(tmp, "shared"), delta_local_dir=os.path.join(tmp, "host0"))
    return settings


def run_point(spec, layout: dict, name: str, *, bucket_mb: float, versions: int) -> dict:
    """Run the trainer (`layout`, two processes) and one engine of TP=2 over transport `name`; return the
    median sync seconds over versions 2.., every measured version's, and the wall time with start-up."""
    from dataclasses import asdict

    from tests.support.jobs import run_pair

    if name == "p2p-nixl":
        os.environ.update(NIXL_ENV)  # the spawned jobs inherit it
    with tempfile.TemporaryDirectory(prefix="scale-local-") as tmp:
        case = {"spec": asdict(spec), "layout": layout, "engines": 1, "engine_tp": 2, "versions": versions,
                "keep_tensors": False, "timeout_s": 600.0,
                "weight_sync": {"dtype": "bfloat16", "bucket_size_mb": bucket_mb, **_settings(name, tmp)}}
        start = time.monotonic()
        trainers, _ = run_pair(case, timeout=1800)
        wall = time.monotonic() - start
    rounds = [max(json.loads(t["metrics"][v])["phases_s"]["total"] for t in trainers) for v in range(1, versions)]
    return {"transport": name, "sync_s": statistics.median(rounds), "sync_rounds": rounds, "wall_s": wall}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--transports", default=",".join(t for t in TRANSPORTS if t != "broadcast"),
                        help=f"comma-separated, from {list(TRANSPORTS)} (broadcast: make bench)")
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--versions", type=int, default=4, help="syncs per point; the first is a warm-up")
    parser.add_argument("--json", default=None, help="write the rows here (bench_scale_check.py --local reads them)")
    args = parser.parse_args(argv)
    print("command: python " + " ".join(sys.argv))
    print(machine_description(), flush=True)
    rows = []
    for model in args.models.split(","):
        spec, layout = MODELS[model]
        for name in args.transports.split(","):
            if name not in TRANSPORTS:
                parser.error(f"--transports: unknown {name!r}; choose from {list(TRANSPORTS)}")
            row = {"model": model, "bucket_mb": args.bucket_mb, **run_point(spec, layout, name,
                                                                             bucket_mb=args.bucket_mb,
                                                                             versions=args.versions)}
            rows.append(row)
            print(f"{model} {name}: {row['sync_s']:.3f} s ({row['wall_s']:.0f} s with start-up); load average "
                  f"{load_average()}", flush=True)
    print(align(["model", "transport", "MiB", "sync s (median)", "rounds"],
                [[r["model"], r["transport"], f"{r['bucket_mb']:g}", f"{r['sync_s']:.3f}",
                  " ".join(f"{x:.3f}" for x in r["sync_rounds"])] for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_description(), "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
