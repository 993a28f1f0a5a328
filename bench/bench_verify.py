"""Benchmark: the post-load check (`layout.loaded.ExpectedRegions.check`) over one engine rank's params.

What `verify_every` costs per version on an engine rank: digests of every region of its params (64 bf16
tensors of 95 and 190 MB in all, about what a rank of make bench's medium and large models holds), with
xxh3 (host memory's default) and wsum64 (the device checksum, here on CPU). One torch thread; best of 3.

    PYTHONPATH=. python bench/bench_verify.py
"""
import time

import torch

from megatron_sync.layout.loaded import ExpectedRegions
from megatron_sync.layout.rank import one_param_per_tensor
from megatron_sync.layout.regions import Region, TensorSpec


def _timed(expected, params) -> float:
    start = time.perf_counter()
    assert expected.check(params, "rank") is None
    return time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(1)
    for total_mb in (95, 190):
        n = 64
        rows = int(total_mb * 2**20 / 2 / n / 1024)
        specs = [TensorSpec(f"t{i}.weight", (rows, 1024), torch.bfloat16) for i in range(n)]
        layout = one_param_per_tensor(specs, lambda s: Region.whole(s.shape))
        full = {s.name: torch.randn(s.shape).to(torch.bfloat16) for s in specs}
        for algo in ("xxh3", "wsum64"):
            exp = ExpectedRegions(layout, algo)
            for name, t in full.items():
                exp.record_tensor(name, t)
            best = min(_timed(exp, full) for _ in range(3))
            mb = sum(t.numel() * 2 for t in full.values()) / 1e6
            print(f"{algo:7s} {mb:6.0f} MB: check {best:.3f} s ({mb / best / 1000:.2f} GB/s), {len(exp.regions)} regions")


if __name__ == "__main__":
    main()
