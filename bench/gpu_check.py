"""`make gpu-check`: every gpu-marked test, then a short device benchmark, as one table; exit 1 on any failure.

Runs on one CUDA machine with no network, in under 8 minutes (each step has its own time limit):

1. `pytest -m gpu` (NCCL broadcast, the distributed optimizer, device buckets, CUDA IPC segments, the
   P2P movers on CUDA): passed / failed / skipped, each failure named.
2. Device checks, each exact before it is timed:
   - device checksums: the `wsum64` checksum computed by torch on the GPU equals the same definition
     computed on the CPU, for odd and large sizes; its rate;
   - pinned host replica: host-to-device and device-to-host copy rates, pinned against pageable;
   - one staging set's host copy (`staging_sets: 1`'s rollback source): taken on a side stream into
     pinned memory, exact; its rate;
   - CUDA IPC: a second process maps a tensor this one shares and reads it back bit for bit; the rate;
   - NCCL broadcast between two processes (needs two GPUs: NCCL refuses two ranks on one device);
   - the device-direct P2P arena: NIXL registers device memory and writes device to device between two
     processes (needs a NIXL wheel; skipped with the reason when it cannot import);
   - peak device memory of a gather against its bound (the gather budget plus the largest tensor).
A check that cannot run here says why in its row ("skipped: ..."); only a check that ran and failed, or
a failed test, makes the exit status 1. `--allow-cpu` runs the same logic without CUDA (tests do that).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


@dataclass
class Row:
    """One line of the table: what was checked, how it ended, its figure, and what it is held against."""

    check: str
    status: str  # "ok", "FAILED", "skipped: <why>"
    figure: str = ""
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAILED"


def table(rows: list[Row]) -> str:
    """Return the rows as an aligned text table."""
    head = Row("check", "status", "figure", "detail")
    cols = [max(len(getattr(r, f)) for r in [head, *rows]) for f in ("check", "status", "figure")]
    lines = []
    for r in [head, *rows]:
        lines.append(f"{r.check:<{cols[0]}}  {r.status:<{cols[1]}}  {r.figure:<{cols[2]}}  {r.detail}".rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def exit_status(rows: list[Row]) -> int:
    """Return 1 when any row failed, else 0."""
    return 1 if any(r.failed for r in rows) else 0


def rows_of_report(junit_path: str, returncode: int) -> list[Row]:
    """Return the rows of a pytest run from its junit XML (one summary row, one row per failure)."""
    try:
        suite = ET.parse(junit_path).getroot()
    except (OSError, ET.ParseError) as e:
        return [Row("gpu-marked tests", "FAILED", "", f"no junit report ({e}); pytest exit {returncode}")]
    passed = failed = skipped = 0
    failures = []
    for case in suite.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            failures.append(Row(f"  {name}", "FAILED", "", (bad.get("message") or "")[:160]))
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    status = "FAILED" if failed or returncode not in (0, 5) else "ok"
    return [Row("gpu-marked tests", status, f"{passed} passed, {failed} failed, {skipped} skipped"), *failures]


def run_gpu_tests(out_dir: str, time_limit_s: float, select: Optional[str] = None) -> list[Row]:
    """Run every gpu-marked test (those `select`, a pytest -k expression, picks) under `time_limit_s`; return
    its rows."""
    junit = os.path.join(out_dir, "gpu-tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", f"--junitxml={junit}",
           *(["-k", select] if select else [])]
    try:
        done = subprocess.run(cmd, cwd=ROOT, timeout=time_limit_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return [Row("gpu-marked tests", "FAILED", "", f"did not finish within {time_limit_s:g}s")]
    return rows_of_report(junit, done.returncode)


def timed(fn: Callable[[], None], repeat: int = 3) -> float:
    """Return the best of `repeat` timings of `fn` in seconds (the device synchronised around each)."""
    import torch

    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def check(name: str, body: Callable[[], Row]) -> Row:
    """Run one check; an exception is its failure, named in the row."""
    try:
        return body()
    except Exception as e:  # noqa: BLE001 — reported in the table with its cause
        return Row(name, "FAILED", "", f"{type(e).__name__}: {e} | {traceback.format_exc(limit=2).splitlines()[-1]}")


def checksum_row(device: str) -> Row:
    """The device checksum equals the host one on the same bytes; its rate on the device."""
    import torch

    from megatron_sync.core.checksum import wsum64_checksum

    for n in (1, 65535, 65537, (1 << 20) + 3):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8)
        on_device, on_host = wsum64_checksum(data.to(device)), wsum64_checksum(data)
        if on_device != on_host:
            return Row("device checksum = host checksum", "FAILED", "", f"{n} bytes: {on_device} != {on_host}")
    size = 1 << (28 if device != "cpu" else 22)  # the rate is the device's figure; on a CPU only the logic
    big = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    seconds = timed(lambda: wsum64_checksum(big))
    return Row("device checksum = host checksum", "ok", f"{big.numel() / seconds / GB:.1f} GB/s",
               f"wsum64 on {device}, 4 sizes equal, rate over {size >> 20} MiB")


def pinned_row(device: str) -> Row:
    """Host-device copy rates, pinned against pageable (the pinned replica's reason to exist)."""
    import torch

    if device == "cpu":
        return Row("pinned host replica", "skipped: no CUDA")
    dev = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    rates = {}
    for kind, pin in (("pinned", True), ("pageable", False)):
        host = torch.randint(0, 256, (1 << 28,), dtype=torch.uint8).pin_memory() if pin else \
            torch.randint(0, 256, (1 << 28,), dtype=torch.uint8)
        rates[kind] = (dev.numel() / timed(lambda: dev.copy_(host, non_blocking=pin)) / GB,
                       dev.numel() / timed(lambda: host.copy_(dev, non_blocking=pin)) / GB)
        if not torch.equal(dev.cpu(), host):
            return Row("pinned host replica", "FAILED", "", f"{kind} round trip changed bytes")
    figure = " ".join(f"{k} H2D {h:.1f} D2H {d:.1f}" for k, (h, d) in rates.items())
    return Row("pinned host replica", "ok", figure + " GB/s", "256 MiB, exact round trip")


def _ipc_reader(queue, done) -> None:
    import torch

    tensor, expected_sum = queue.get(timeout=60)
    start = time.perf_counter()
    copy = tensor.clone()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    done.put((int(copy.to(torch.int64).sum().item()) == expected_sum, copy.numel() / seconds / GB))


def cuda_ipc_row(device: str) -> Row:
    """A second process maps a shared CUDA tensor (CUDA IPC) and reads it back exactly."""
    import torch
    import torch.multiprocessing as mp

    if device == "cpu":
        return Row("CUDA IPC", "skipped: no CUDA")
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    reader = ctx.Process(target=_ipc_reader, args=(queue, done), daemon=True)
    reader.start()
    tensor = torch.randint(0, 256, (1 << 28,), dtype=torch.uint8, device=device)
    queue.put((tensor, int(tensor.to(torch.int64).sum().item())))
    equal, rate = done.get(timeout=120)
    reader.join(30)
    return Row("CUDA IPC", "ok" if equal else "FAILED", f"{rate:.1f} GB/s", "256 MiB mapped and read by a 2nd process")


def nccl_row(device: str) -> Row:
    """NCCL broadcast between two processes, when two GPUs are present."""
    import torch

    if device == "cpu" or torch.cuda.device_count() < 2:
        return Row("NCCL broadcast", "skipped: needs 2 GPUs (NCCL refuses two ranks on one device)")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_broadcast_sync.py", "-m", "gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    return Row("NCCL broadcast", "ok" if done.returncode == 0 else "FAILED", "",
               done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "")


class _StoreBoard:
    """A control board over a TCPStore, for the two processes of the NIXL check."""

    timeout_s = 60.0

    def __init__(self, port: int, host: bool) -> None:
        import datetime

        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", port, None, host, timeout=datetime.timedelta(seconds=60),
                                   wait_for_workers=False)

    def post(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def fetch(self, key: str, timeout_s: Optional[float] = None) -> bytes:
        self.store.wait([key])
        return self.store.get(key)


NIXL_BYTES = 1 << 28  # a 256 MiB arena written into a 256 MiB window, in 64 spans


def _nixl_receiver(port: int, device: str, done) -> None:
    import torch

    from megatron_sync.core.checksum import wsum64_checksum
    from megatron_sync.transports.p2p.movers.nixl import NixlMover

    board = _StoreBoard(port, host=False)
    mover = NixlMover(board, timeout_s=60, device=torch.device(device))
    window = mover.alloc(NIXL_BYTES)
    window.zero_()
    mover.expose("receiver/0", window)
    board.fetch("written")
    done.put(wsum64_checksum(window))  # computed on the window's device
    mover.close()


def nixl_row(device: str) -> Row:
    """NIXL registers device memory on both sides and writes a device arena into a device window: exact bytes
    (wsum64 computed on the receiving device against the sender's) and the rate."""
    import socket

    import torch
    import torch.multiprocessing as mp

    from megatron_sync.core.checksum import wsum64_checksum
    from megatron_sync.transports.p2p.movers import Span
    try:
        from megatron_sync.transports.p2p.movers.nixl import NixlMover, nixl_api
        nixl_api()
    except ImportError as e:
        return Row("P2P arena (NIXL, device memory)", f"skipped: {e}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    board = _StoreBoard(port, host=True)
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    reader = ctx.Process(target=_nixl_receiver, args=(port, device, done), daemon=True)
    reader.start()
    mover = NixlMover(board, timeout_s=60, device=torch.device(device))
    arena = mover.alloc(NIXL_BYTES)
    arena.copy_(torch.randint(0, 256, (NIXL_BYTES,), dtype=torch.uint8))
    step = NIXL_BYTES // 64
    spans = [Span(i * step, NIXL_BYTES - (i + 1) * step, step) for i in range(64)]  # reversed order at the peer
    seconds = timed(lambda: mover.write("receiver/0", arena, spans).wait(60), repeat=2)
    board.post("written", b"1")
    expected = wsum64_checksum(torch.cat([arena[s.src:s.src + s.nbytes] for s in reversed(spans)]))
    got = done.get(timeout=120)
    reader.join(30)
    mover.close()
    kind = "VRAM" if device != "cpu" else "DRAM"
    return Row("P2P arena (NIXL, device memory)", "ok" if got == expected else "FAILED",
               f"{NIXL_BYTES / seconds / GB:.1f} GB/s", f"{kind} to {kind}, 256 MiB in 64 spans, wsum64 equal")


def gather_memory_row(device: str) -> Row:
    """Peak device memory of gathering a tensor in pieces stays within budget + the tensor."""
    import torch

    if device == "cpu":
        return Row("gather peak memory <= bound", "skipped: no CUDA")
    from megatron_sync.trainer.gather import merge_strided_shards

    shards = [torch.randn(4096, 1024, device=device) for _ in range(4)]
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    full = merge_strided_shards(shards, 0, 1)
    peak = torch.cuda.max_memory_allocated() - before
    bound = full.numel() * full.element_size()
    ok = peak <= bound and torch.equal(full[:4096], shards[0])
    return Row("gather peak memory <= bound", "ok" if ok else "FAILED", f"{peak / 2**20:.0f} MiB",
               f"bound {bound / 2**20:.0f} MiB (the merged tensor)")


def host_copy_row(device: str) -> Row:
    """With one staging set, the host copy of the live version (its rollback source) is exact, pinned on a GPU
    host, and taken at the device-to-host rate (`StagingSets` with `staging_sets: 1`)."""
    import torch

    from megatron_sync.layout.rank import ParamSpec, Placement, RankLayout
    from megatron_sync.layout.regions import Region
    from megatron_sync.layout.staging import StagingSets

    shape = (1 << 14, 1 << 13) if device != "cpu" else (256, 256)  # 256 MiB of bf16 on a GPU
    nbytes = shape[0] * shape[1] * 2
    layout = RankLayout((ParamSpec("w", shape, torch.bfloat16),),
                        (Placement("w", Region.whole(shape), "w", 0, nbytes),))
    sets = StagingSets(layout, lambda n: torch.empty(n, dtype=torch.uint8, device=device), 1)
    full = torch.randn(shape, dtype=torch.bfloat16, device=device)
    sets.begin()
    sets.write("w", full)
    start = time.perf_counter()
    sets.committed(1)  # the copy starts (a side stream on a GPU, a thread on a CPU) ...
    sets.begin()  # ... and is waited for before the set may take the next version
    seconds = time.perf_counter() - start
    kept = sets.live_params(1)["w"]
    pinned = device == "cpu" or kept.is_pinned()
    if kept.device.type != "cpu" or not pinned or not torch.equal(kept, full.cpu()):
        return Row("host copy of one staging set", "FAILED", "", f"on {kept.device}, pinned {pinned}, exact "
                   f"{torch.equal(kept.cpu(), full.cpu())}")
    return Row("host copy of one staging set", "ok", f"{nbytes / seconds / GB:.1f} GB/s",
               f"{nbytes / 2**20:g} MiB from {device} into {'pinned ' if device != 'cpu' else ''}host memory, exact")


CHECKS = [checksum_row, pinned_row, host_copy_row, cuda_ipc_row, nccl_row, nixl_row, gather_memory_row]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (tests of this script)")
    parser.add_argument("--skip-tests", action="store_true", help="only the device checks")
    parser.add_argument("--tests", metavar="EXPR", help="only the gpu-marked tests this pytest -k expression picks "
                        "(a second call that brings NIXL: --tests nixl)")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu-check"), help="where reports go")
    parser.add_argument("--test-time-limit", type=float, default=300.0)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu-check: no CUDA device visible (torch.cuda.is_available() is False); run it on a GPU machine")
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    rows = [] if args.skip_tests else run_gpu_tests(args.out, args.test_time_limit, args.tests)
    rows += [check(fn.__name__, lambda fn=fn: fn(device)) for fn in CHECKS]
    print(table(rows))
    with open(os.path.join(args.out, "gpu-check.json"), "w") as f:
        json.dump([r.__dict__ for r in rows], f, indent=1)
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
