"""Benchmark: what a P2P sync keeps the CPUs busy with, against the raw writes of the same bytes.

Runs one point of `bench/bench_p2p.py` (default the device-direct criterion's point: NIXL over UCX's TCP, the
trainer as two data-parallel replicas, one engine of TP=2) under `perf record -a`: every CPU sampled at
`--hz` with wall-clock timestamps, every process and the kernel. The samples that fall inside the measured
syncs, and those inside the raw replays (the same messages written again from the arena, the wire alone), are
split by what ran:

- idle: no task on the CPU;
- kernel copies: the kernel copying socket data (`_copy_from_iter` / `_copy_to_iter`: loopback TCP moving the
  bytes, what a NIC's DMA does on real hardware);
- kernel other: the rest of the kernel (TCP stack, syscalls, softirqs, scheduling, locks);
- checksums: xxHash (the trainer's over what it stages, the receivers' per round and after loading);
- tensor copies: torch's kernels (the staging copy into the arena, and conversion);
- interpreter: CPython and torch's Python bindings;
- ucx / libc / other: UCX, NIXL, the C library (its memmove and spin locks are mostly UCX's), the rest.

Per sync and per raw replay it prints each part in core-milliseconds, the busy total, the wall time and the
cores busy on average; then two floors. A sync that did this work on this machine's cores, every part
overlapping every other, would still take busy / cores, so sync / raw cannot fall below that divided by the
raw replay's wall time without removing work; and the passes the design needs (the wire, as the raw replay
costs it, the checksums on both sides, the staging copy and conversion) on their own, every other part removed.

Needs Linux `perf` and leave to sample every CPU (root, or `kernel.perf_event_paranoid` <= 0).

    PYTHONPATH=. python bench/p2p_cpu.py                       # nixl:1x2@dp2, 12 syncs, 3 replays after each
    PYTHONPATH=. python bench/p2p_cpu.py --checksum none       # the same without checksums
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections import Counter

from bench import bench_p2p
from bench.bench_sync import machine_description
from megatron_sync.core.metrics import align

PARTS = ("idle", "kernel copies", "kernel other", "checksums", "tensor copies", "interpreter", "ucx", "libc", "other")
SAMPLE = re.compile(r"^\s*(\S.*?)\s+(\d+)/(\d+)\s+([\d.]+):\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")


def part(pid: str, symbol: str, dso: str) -> str:
    """Return which of PARTS one sample (process `pid`, function `symbol` in library `dso`) belongs to."""
    name = os.path.basename(dso)
    if pid == "0":
        return "idle"
    if "kallsyms" in dso:
        return "kernel copies" if symbol in ("_copy_from_iter", "_copy_to_iter") else "kernel other"
    for prefix, kind in (("_xxhash", "checksums"), ("libtorch_cpu", "tensor copies"), ("libc10", "tensor copies"),
                         ("libpython", "interpreter"), ("libtorch_python", "interpreter"), ("libuc", "ucx"),
                         ("libnixl", "ucx"), ("libplugin_UCX", "ucx"), ("_bindings", "ucx"), ("libc.so", "libc")):
        if name.startswith(prefix):
            return kind
    return "other"


class Spans:
    """Wall-clock intervals, sorted and disjoint: which one a time falls in."""

    def __init__(self, spans: list[list[float]]) -> None:
        self.spans = sorted(spans)
        self.starts = [a for a, _ in self.spans]

    def __contains__(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and t <= self.spans[i][1]

    @property
    def seconds(self) -> float:
        return sum(z - a for a, z in self.spans)


def profile(point: dict, hz: int) -> tuple[dict, dict[str, Counter]]:
    """Run `point` (bench_p2p.run_point's arguments) under `perf record -a`; return its result and the samples
    inside its syncs and inside its raw replays, counted by part."""
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        recorder = subprocess.Popen(["perf", "record", "-a", "-F", str(hz), "-k", "CLOCK_REALTIME", "-o", data],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            result = bench_p2p.run_point(**point)
        finally:
            recorder.send_signal(signal.SIGINT)
            _, err = recorder.communicate(timeout=120)
        if recorder.returncode not in (0, -signal.SIGINT):
            raise SystemExit(f"perf record failed ({recorder.returncode}): {err.decode()[-500:]}")
        script = subprocess.run(["perf", "script", "-i", data, "-F", "comm,pid,tid,time,ip,sym,dso"],
                                capture_output=True, text=True, check=True, timeout=600)
    spans = {kind: Spans(result["spans"][kind]) for kind in ("sync", "raw")}
    counts = {kind: Counter() for kind in spans}
    for line in script.stdout.splitlines():
        match = SAMPLE.match(line)
        if match is None:
            continue
        _, pid, _, at, symbol, dso = match.groups()
        for kind, within in spans.items():
            if float(at) in within:
                counts[kind][part(pid, symbol, dso)] += 1
    return result, counts


def table(result: dict, counts: dict[str, Counter], hz: int) -> tuple[str, dict[str, dict[str, float]]]:
    """Return the parts per sync and per raw replay in core-ms as a table, and by kind ("sync", "raw") each
    part's core-ms with "busy" (all but idle) and "wall" (ms per span)."""
    rows, per_kind = [], {}
    for kind in ("sync", "raw"):
        spans = result["spans"][kind]
        per = 1000.0 / hz / len(spans)  # core-ms one sample stands for, per span
        ms = {p: counts[kind][p] * per for p in PARTS}
        ms["busy"] = sum(v for p, v in ms.items() if p != "idle")
        ms["wall"] = 1000.0 * Spans(spans).seconds / len(spans)
        per_kind[kind] = ms
        rows.append([kind, str(len(spans)), f"{ms['wall']:.1f}", f"{ms['busy']:.1f}", f"{ms['busy'] / ms['wall']:.2f}",
                     *(f"{ms[p]:.1f}" for p in PARTS)])
    return align(["per", "spans", "wall ms", "busy core-ms", "cores busy", *PARTS], rows), per_kind


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--point", default="nixl:1x2@dp2", help="transport:ENGINESxTP[@TRAINER], as bench_p2p")
    parser.add_argument("--versions", type=int, default=13, help="syncs; the first is a warm-up")
    parser.add_argument("--replays", type=int, default=3, help="raw replays after each measured sync")
    parser.add_argument("--checksum", default=None, help="weight_sync.checksum (default: the config's)")
    parser.add_argument("--hz", type=int, default=999, help="samples per second per CPU")
    args = parser.parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("bench/p2p_cpu.py needs Linux perf: install it (Debian: apt-get install linux-perf) and "
                         "run as root or with kernel.perf_event_paranoid <= 0")
    point = dict(bench_p2p.parse_point(args.point), versions=args.versions, replays=args.replays)
    transport = point["transport"]
    if args.checksum is not None:
        bench_p2p.TRANSPORTS[transport] = {**bench_p2p.TRANSPORTS[transport], "checksum": args.checksum}
    bench_p2p.SPEC.update(params_dtype="bfloat16")
    bench_p2p.MODEL_BYTES = bench_p2p.model_bytes("bfloat16")
    print(machine_description())
    print(f"point {args.point}, checksum {args.checksum or 'default'}, {args.versions} syncs (first = warm-up), "
          f"{args.replays} raw replays after each; perf record -a -F {args.hz}")
    result, counts = profile(point, args.hz)
    cores = os.cpu_count() or 1
    text, ms = table(result, counts, args.hz)
    sync, raw = ms["sync"], ms["raw"]
    print(text)
    floor = sync["busy"] / cores
    print(f"sync {result['sync_s'] * 1000:.1f} ms (median), raw {result['raw_s'] * 1000:.1f} ms (median): "
          f"sync / raw {result['sync_s'] / result['raw_s']:.2f}; the sync's busy core-ms on {cores} cores, every "
          f"part overlapping: {floor:.1f} ms, a floor of {floor / raw['wall']:.2f} x the raw replay")
    required = (raw["busy"] + sync["checksums"] + sync["tensor copies"]) / cores
    print(f"the wire's work alone (the raw replay's busy core-ms) with the sync's checksums and tensor copies, on "
          f"{cores} cores, nothing else: {required:.1f} ms, {required / raw['wall']:.2f} x the raw replay")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
