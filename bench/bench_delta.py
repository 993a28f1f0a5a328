"""Benchmark: disk-delta payload size against the full size and plain XOR + zstd; encode and apply GB/s.

(b) Synthetic: `--synthetic-mb` of bf16 weights (32 MiB tensors, N(0, 0.02)) where
    about 2% of the elements change, in two ways: by one ulp (what an RL step does
    to most elements it changes, see (a)) and re-drawn from the same distribution
    (a pessimistic update). Each encoding is measured on whole tensors, one thread,
    best of --repeats. Then the store end to end over three versions, figures of the
    last one (both slots of the local copy warm, as in a long run): publish = encode +
    tensor digests + write + fsync + rename (DeltaWriter); stage = verify file digests +
    decode into the local copy + verify tensor digests; commit = msync + fsync of the
    staged slot + the atomic state switch (DeltaReader). GB/s = full bytes / seconds.
(a) Real: a Megatron Qwen3 trained by megatron-core on CPU with Adam at RL-like
    learning rates; after every step the library's bf16 replica goes through a
    DeltaWriter / DeltaReader pair into a reference engine (tests/delta_support.py):
    per version, the fraction of bf16 elements changed, the payload, the baseline
    on the same update, and the bit-exact / logits checks.

Prints figures only; nothing asserts on time.

    python bench/bench_delta.py                                  # 256 MiB synthetic; real at 1e-6 and 1e-5
    python bench/bench_delta.py --synthetic-mb 64 --steps 10 --lrs 1e-5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests.support

from bench_sync import _table, machine_description  # noqa: E402 — the benchmarks' shared helpers
from megatron_sync.transports.disk_delta import DeltaReader, DeltaWriter, WriterOptions, codec  # noqa: E402
from tests.support.dist import run_distributed  # noqa: E402
from tests.support.models import ModelSpec  # noqa: E402

TENSOR_ELEMENTS = 16 * 2**20  # 32 MiB of bf16 per tensor
FRACTION = 0.02
BASELINE_LEVEL = 3  # zstd's default level: "plain XOR + zstd"
# ~86 MB of bf16 weights: 8 layers, hidden 512, a 16k vocabulary (untied embeddings and head).
REAL_SPEC = ModelSpec(family="qwen3", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                      ffn_hidden_size=1536, vocab_size=16000)


# ----------------------------------------------------------------------------- (b) synthetic


def synthetic_versions(total_mb: float, kind: str, count: int = 3, seed: int = 0) -> list[list[np.ndarray]]:
    """Return `count` versions (lists of bf16 tensors as bytes), each changing about FRACTION of the last (`kind`)."""
    gen = torch.Generator().manual_seed(seed)
    versions = [[(torch.randn(TENSOR_ELEMENTS, generator=gen) * 0.02).to(torch.bfloat16)
                 for _ in range(max(1, round(total_mb * 2**20 / (2 * TENSOR_ELEMENTS))))]]
    for _ in range(count - 1):
        versions.append([_update(weights, kind, gen) for weights in versions[-1]])
    return [[w.view(torch.uint8).numpy() for w in version] for version in versions]


def _update(weights: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    mask = torch.rand(weights.shape, generator=gen) < FRACTION
    changed = weights.clone()
    if kind == "ulp":
        step = torch.where(torch.rand(weights.shape, generator=gen) < 0.5, -1, 1).to(torch.int16)
        changed.view(torch.int16)[mask] += step[mask]
    else:
        changed[mask] = (torch.randn(int(mask.sum()), generator=gen) * 0.02).to(torch.bfloat16)
    return changed


def _best_time(fn, repeats: int) -> tuple[object, float]:
    """Return fn()'s result and its fastest wall time over `repeats` runs (the machine is shared)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def measure_encoding(label: str, encode, base: list[np.ndarray], new: list[np.ndarray], repeats: int) -> dict:
    """Encode every tensor with `encode(new, base) -> Encoded`, decode it back (checked); return sizes and GB/s."""
    size = enc_s = dec_s = 0.0
    out = np.empty_like(new[0])
    out[:] = 0  # touch the pages once, outside the timing
    for old, fresh in zip(base, new):
        encoded, seconds = _best_time(lambda: encode(fresh, old), repeats)
        enc_s += seconds
        _, seconds = _best_time(lambda: codec.decode_into(encoded.name, encoded.payload, out, 2, base=old), repeats)
        dec_s += seconds
        assert np.array_equal(out, fresh), label
        size += encoded.size
    raw = sum(a.nbytes for a in new)
    return {"method": label, "bytes": size, "raw": raw, "enc_gbs": raw / enc_s / 1e9, "dec_gbs": raw / dec_s / 1e9}


def _codec(name: str, level: int):
    return lambda fresh, old: codec.Encoded(name, codec.CODECS[name].encode(codec._Tensor(fresh, old, 2), level))


def codec_rows(base: list[np.ndarray], new: list[np.ndarray], repeats: int) -> list[dict]:
    """Return one row per encoding on this update: the baseline, each alternative, the choosers, a snapshot."""
    methods = [
        (f"XOR+zstd-{BASELINE_LEVEL} (baseline)", _codec("xor_zstd", BASELINE_LEVEL)),
        ("XOR+zstd-1", _codec("xor_zstd", 1)),
        ("byte-plane XOR+zstd-1", _codec("plane_xor_zstd", 1)),
        ("sparse XOR (index/value)+zstd-1", _codec("sparse_xor", 1)),
        ("chooser auto", lambda fresh, old: codec.encode_delta(fresh, old, 2, choice="auto")),
        ("chooser best", lambda fresh, old: codec.encode_delta(fresh, old, 2, choice="best")),
        ("snapshot (no base) plane_zstd-1", lambda fresh, old: codec.encode_snapshot(fresh, 2)),
    ]
    return [measure_encoding(label, encode, base, new, repeats) for label, encode in methods]


def store_row(versions: list[list[np.ndarray]], threads: int) -> dict:
    """Publish every version through a DeltaWriter and apply each with a DeltaReader; return the last delta's
    figures (both slots of the local copy are then warm, as in a long run)."""
    def as_tensors(arrays):
        return {f"w{i}": torch.from_numpy(a).view(torch.bfloat16) for i, a in enumerate(arrays)}

    with tempfile.TemporaryDirectory(prefix="bench_delta_") as tmp:
        writer = DeltaWriter(f"{tmp}/store", WriterOptions(encode_threads=threads, snapshot_every=100))
        reader = DeltaReader(f"{tmp}/store", f"{tmp}/local", reader_id="bench")
        for version, arrays in enumerate(versions, start=1):
            writer.submit(version, as_tensors(arrays))
            writer.flush(timeout=600)
            staged = reader.apply()
        assert all(np.array_equal(staged.tensors[f"w{i}"].view(torch.uint8).numpy(), a)
                   for i, a in enumerate(versions[-1]))
        stats = writer.stats[-1]
        writer.close(), reader.close()
    stage_s = staged.seconds["verify_files"] + staged.seconds["decode"]
    return {"method": f"store, {threads} encode thread(s)", "bytes": stats.delta_bytes, "raw": stats.raw_bytes,
            "enc_gbs": stats.raw_bytes / stats.seconds / 1e9, "dec_gbs": stats.raw_bytes / stage_s / 1e9,
            "commit_gbs": stats.raw_bytes / staged.seconds["commit"] / 1e9}


SWEEP = (0.002, 0.02, 0.1, 0.3, 0.6, 1.0)


def sweep_rows(repeats: int) -> list[list[str]]:
    """Return, per fraction of elements changed by one ulp in a 32 MiB bf16 tensor, each delta encoding's
    size (% of full) and encode GB/s, and what "auto" picks: the evidence behind the chooser's threshold."""
    gen = torch.Generator().manual_seed(1)
    weights = (torch.randn(TENSOR_ELEMENTS, generator=gen) * 0.02).to(torch.bfloat16)
    old, lines = weights.view(torch.uint8).numpy(), []
    for fraction in SWEEP:
        mask = torch.rand(TENSOR_ELEMENTS, generator=gen) < fraction
        changed = weights.clone()
        changed.view(torch.int16)[mask] += 1
        new, cells = changed.view(torch.uint8).numpy(), [f"{100 * fraction:g}%"]
        for name in codec.DELTA_CANDIDATES:
            encoded, seconds = _best_time(lambda: _codec(name, 1)(new, old), repeats)
            cells.append(f"{100 * encoded.size / new.nbytes:.2f}% @ {new.nbytes / seconds / 1e9:.2f}")
        cells.append(codec.encode_delta(new, old, 2, choice="auto").name)
        lines.append(cells)
    return lines


def format_codec_rows(rows: list[dict], baseline: float) -> str:
    """Return the synthetic table: payload, its share of full and of the baseline, encode / decode GB/s."""
    header = ["method", "payload_MB", "of_full", "vs_baseline", "encode_GB/s", "decode_GB/s", "commit_GB/s"]
    lines = [["full (raw bf16)", f"{rows[0]['raw'] / 1e6:.1f}", "100%", "-", "-", "-", "-"]]
    lines += [[r["method"], f"{r['bytes'] / 1e6:.2f}", f"{100 * r['bytes'] / r['raw']:.2f}%",
               f"{r['bytes'] / baseline:.3f}x", f"{r['enc_gbs']:.2f}", f"{r['dec_gbs']:.2f}",
               f"{r['commit_gbs']:.2f}" if "commit_gbs" in r else "-"] for r in rows]
    return _table(header, lines)


# ----------------------------------------------------------------------------- (a) real Megatron updates


def real_rows(lr: float, steps: int, timeout: float) -> list[dict]:
    """Train REAL_SPEC for `steps` Adam steps at `lr` through the delta store; return one row per version."""
    from tests.delta_support import megatron_delta_chain

    with tempfile.TemporaryDirectory(prefix="bench_delta_real_") as tmp:
        (rows,) = run_distributed(megatron_delta_chain, 1, REAL_SPEC, steps, lr, f"{tmp}/store", f"{tmp}/local",
                                  WriterOptions(snapshot_every=steps + 1, retention=2), timeout=timeout)
    return rows


def format_real_rows(rows: list[dict]) -> str:
    """Return the per-version table of a real run (version 1 is the initial snapshot)."""
    header = ["version", "changed", "full_MB", "delta_KB", "baseline_KB", "vs_baseline", "of_full",
              "publish_GB/s", "stage_GB/s", "commit_GB/s", "bit_exact", "logits_diff"]
    lines = []
    for r in rows:
        delta = r["delta_bytes"] or r["snapshot_bytes"]
        lines.append([
            f"{r['version']}" + (" (snapshot)" if r["changed"] is None else ""),
            "-" if r["changed"] is None else f"{100 * r['changed']:.2f}%",
            f"{r['raw_bytes'] / 1e6:.1f}", f"{delta / 1e3:.1f}",
            "-" if r["baseline_bytes"] is None else f"{r['baseline_bytes'] / 1e3:.1f}",
            "-" if r["baseline_bytes"] is None else f"{delta / r['baseline_bytes']:.3f}x",
            f"{100 * delta / r['raw_bytes']:.2f}%", f"{r['raw_bytes'] / r['publish_s'] / 1e9:.2f}",
            f"{r['raw_bytes'] / r['stage_s'] / 1e9:.2f}", f"{r['raw_bytes'] / r['commit_s'] / 1e9:.2f}",
            str(r["bit_exact"]), f"{r['logits_diff']:.1e}"])
    return _table(header, lines)


def summarize_real(lr: float, rows: list[dict]) -> str:
    """Return one line of medians over the delta versions of a real run."""
    deltas = rows[1:]
    med = lambda key: statistics.median(key(r) for r in deltas)  # noqa: E731
    return (f"lr {lr:g}: median over {len(deltas)} steps: {100 * med(lambda r: r['changed']):.2f}% of bf16 "
            f"elements changed; delta {100 * med(lambda r: r['delta_bytes'] / r['raw_bytes']):.2f}% of full, "
            f"{med(lambda r: r['delta_bytes'] / r['baseline_bytes']):.3f}x the XOR+zstd-{BASELINE_LEVEL} baseline; "
            f"all bit-exact: {all(r['bit_exact'] for r in rows)}; "
            f"max logits diff {max(r['logits_diff'] for r in rows):.1e}")


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--synthetic-mb", type=float, default=256.0, help="synthetic bf16 MiB (default 256)")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated Adam learning rates (default 1e-6,1e-5)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per learning rate (default 10)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one real run may take (default 900)")
    parser.add_argument("--repeats", type=int, default=3, help="timings are the best of this many runs (default 3)")
    parser.add_argument("--skip-real", action="store_true", help="only the synthetic part")
    args = parser.parse_args(argv)
    args.lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    if args.synthetic_mb <= 0 or args.steps < 1:
        parser.error("--synthetic-mb must be positive and --steps >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    print("command: python " + " ".join(sys.argv))
    print(machine_description())
    print(f"store and local copy under {tempfile.gettempdir()}; zstd levels as labelled; one thread unless said\n")
    for kind, what in (("ulp", "by one ulp"), ("redraw", "re-drawn from N(0, 0.02)")):
        versions = synthetic_versions(args.synthetic_mb, kind)
        base, new = versions[-2:]
        rows = codec_rows(base, new, args.repeats) + [store_row(versions, threads) for threads in (1, 2)]
        changed = sum(int(np.count_nonzero(a.view(np.uint16) != b.view(np.uint16))) for a, b in zip(base, new))
        print(f"(b) synthetic: {len(new)} bf16 tensors, {sum(a.nbytes for a in new) / 2**20:.0f} MiB, "
              f"{100 * changed / (sum(a.nbytes for a in new) // 2):.2f}% of elements changed {what}\n")
        print(format_codec_rows(rows, rows[0]["bytes"]) + "\n", flush=True)
    print("Chooser evidence: payload (% of full) @ encode GB/s per fraction of bf16 elements changed by one ulp,"
          " 32 MiB tensor, zstd level 1, best of --repeats\n")
    print(_table(["changed", *codec.DELTA_CANDIDATES, "auto picks"], sweep_rows(args.repeats)) + "\n", flush=True)
    if args.skip_real:
        return
    for lr in args.lrs:
        start = time.monotonic()
        rows = real_rows(lr, args.steps, args.timeout)
        print(f"(a) real: Megatron {REAL_SPEC.family} (hidden {REAL_SPEC.hidden_size}, {REAL_SPEC.num_layers} "
              f"layers, vocab {REAL_SPEC.vocab_size}), Adam lr {lr:g}, {args.steps} steps, bf16 replica; "
              f"{time.monotonic() - start:.0f}s wall\n")
        print(format_real_rows(rows))
        print(summarize_real(lr, rows) + "\n", flush=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
