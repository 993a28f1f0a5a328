"""Benchmark: quantize and dequantize throughput of each format, in GB/s of source (bf16) bytes.

Each size is one bf16 weight matrix (the full gathered tensor the convert stage
quantizes); every (format, size) pair runs a warm-up and `--repeats` timed
calls, and the median is printed, as wall-clock GB/s and as GB per CPU-second.
The "(copy, baseline)" row is a plain clone (quantize column) and a bf16 ->
float32 cast (dequantize column) of the same tensor: the memory speed the
formats are bounded by. Prints figures only; nothing asserts on time.

    python bench/bench_quant.py                       # 64 and 256 MiB, every format
    python bench/bench_quant.py --sizes-mb 16 --repeats 5 --threads 1
    python bench/bench_quant.py --device cuda         # on a GPU, synchronizing around each call
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from megatron_sync.convert.quant import Fp8Block, Fp8Tensor, Int4Group, dequantize, quantize

FORMATS = {
    "fp8 block 128x128": Fp8Block(),
    "fp8 block ue8m0": Fp8Block((128, 128), "ue8m0"),
    "fp8 per-tensor": Fp8Tensor(),
    "int4 group 128": Int4Group(128),
    "int4 group 32": Int4Group(32),
}


def _shape(mib: int) -> tuple[int, int]:
    """A [rows, 8192] bf16 matrix of `mib` MiB (8192: a typical hidden size, a multiple of every block)."""
    cols = 8192
    return mib * 2 ** 20 // 2 // cols, cols


def _timed(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """Return the median (wall seconds, process CPU seconds) of `repeats` calls of `fn` after one warm-up.

    CPU seconds (all threads) stay meaningful on a machine shared with other jobs, where wall time
    also counts the time this process waited for a core.
    """
    def once() -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - wall, time.process_time() - cpu
    once()
    runs = [once() for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def run(sizes_mb: list[int], repeats: int, device: torch.device) -> None:
    """Print one row per (format, size): quantize and dequantize GB/s of bf16 source bytes."""
    print("GB/s of bf16 source bytes: wall-clock, and per CPU-second (all threads) in brackets")
    print(f"{'format':<20} {'size':>8} {'quantize GB/s':>20} {'dequantize GB/s':>20} {'out/in bytes':>13}")
    for mib in sizes_mb:
        x = torch.randn(_shape(mib), device=device).to(torch.bfloat16)
        gb = x.numel() * x.element_size() / 1e9
        cases = {"(copy, baseline)": (lambda: x.clone(), lambda: x.float(), 1.0)}
        for label, scheme in FORMATS.items():
            out = dict(quantize("w.weight", x, scheme))
            ratio = sum(t.numel() * t.element_size() for t in out.values()) / (x.numel() * x.element_size())
            cases[label] = (lambda s=scheme: quantize("w.weight", x, s),
                            lambda s=scheme, o=out: dequantize("w.weight", o, s, torch.bfloat16), ratio)
        for label, (quant, dequant, ratio) in cases.items():
            (qw, qc), (dw, dc) = _timed(quant, device, repeats), _timed(dequant, device, repeats)
            q_txt, d_txt = f"{gb / qw:.2f} [{gb / max(qc, 1e-9):.2f}]", f"{gb / dw:.2f} [{gb / max(dc, 1e-9):.2f}]"
            print(f"{label:<20} {mib:>5} MiB {q_txt:>20} {d_txt:>20} {ratio:>13.3f}")
        del x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="64,256", help="comma-separated bf16 sizes in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"torch {torch.__version__}, {device} ({where}), {torch.get_num_threads()} CPU threads, "
          f"{platform.machine()}, {os.cpu_count()} cores")
    print("load average (1/5/15 min) at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    run([int(s) for s in args.sizes_mb.split(",")], args.repeats, device)
    print("load average (1/5/15 min) at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
