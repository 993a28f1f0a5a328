"""Peer benchmark: megatron-core's own refit (`megatron.core.resharding`, 0.16.1) for the same layout change.

Layout change: a TP=2 trained model into two full TP=1 copies (two inference ranks at TP=1).

- refit: `swap_model_weights(src, dst, service)` in one 2-process gloo job that holds both models
  (0.16.1's refit is colocated only: every rank owns a source shard and a destination model; here
  DP=2 x TP=1 destinations). Megatron format in, Megatron format out, float32 (the parameters'
  dtype), plan built once and cached. 0.16.1's `GlooCopyService.__init__` creates a
  `torch.cuda.Stream()`, so on CPU it runs through `CpuGlooCopyService` below: the same service
  without the stream, counting the bytes it sends to other ranks. The result is checked: both
  destination models, converted by this library's converter, equal the single-rank conversion
  of the same weights bit for bit.
- P2P and broadcast: this library's drivers, trainer TP=2 -> two reference engines of TP=1 each
  (separate processes), HF format in float32 (so bytes compare), `bench_p2p.run_point`.

    PYTHONPATH=. python bench/bench_refit.py [--repeats 5] [--versions 4]

Machine caveat as in bench_p2p.py: every process shares this machine's cores (2 here).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.bench_p2p import SPEC, run_point
from bench.bench_sync import machine_description
from tests.support.dist import run_distributed

MB = 1e6


def _cpu_gloo_copy_service():
    """Return 0.16.1's GlooCopyService without its CUDA stream, counting bytes sent to other ranks."""
    import torch.distributed as dist
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService

    class CpuGlooCopyService(GlooCopyService):
        def __init__(self):  # the parent's, less `self._copy_stream = torch.cuda.Stream()`
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.gloo_pg = dist.new_group(backend="gloo")
            self.send_ops, self.recv_ops = [], []
            self._copy_stream = None  # run() skips the stream sync when None
            self.remote_bytes = self.local_bytes = 0

        def submit_send_with_id(self, task_id, src_tensor, dest_rank):
            nbytes = src_tensor.numel() * src_tensor.element_size()
            if dest_rank == self.rank:
                self.local_bytes += nbytes
            else:
                self.remote_bytes += nbytes
            super().submit_send_with_id(task_id, src_tensor, dest_rank)

    return CpuGlooCopyService()


def _dp2_tp1_groups():
    """Return a ProcessGroupCollection of TP=1 x DP=2 over the 2 ranks (the refit's destination layout)."""
    import torch.distributed as dist
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    grid = HyperCommGrid([1, 1, 1, 1, 2], ["tp", "cp", "ep", "pp", "dp"])
    one = {axis: grid.create_pg(axis) for axis in ("tp", "cp", "ep", "pp", "dp")}
    own = None
    for rank in range(dist.get_world_size()):  # every rank creates every group, in the same order
        group = dist.new_group([rank])
        if rank == dist.get_rank():
            own = group
    return ProcessGroupCollection(
        tp=one["tp"], cp=one["cp"], pp=one["pp"], ep=one["ep"], dp=one["dp"], embd=own, pos_embd=own,
        tp_cp=grid.create_pg(["tp", "cp"]), mp=grid.create_pg(["tp", "cp", "ep", "pp"]), expt_tp=one["tp"],
        expt_dp=one["dp"], tp_ep=grid.create_pg(["tp", "ep"]), tp_ep_pp=grid.create_pg(["tp", "ep", "pp"]),
        dp_cp=grid.create_pg(["cp", "dp"]), tp_dp_cp=grid.create_pg(["tp", "cp", "dp"]),
    )


def _refit_job(rank: int, world: int, repeats: int) -> dict:
    from megatron.core.resharding import swap_model_weights

    from megatron_sync.convert import get_converter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.stream import MegatronWeightStream
    from tests.support import models
    from tests.support.dist import init_megatron

    init_megatron(tp=2, seed=3)
    spec = models.ModelSpec(**SPEC)
    weights = models.reference_weights(spec, seed=3)
    src = models.build_model_chunks(spec)
    models.load_reference_weights(src, weights, spec)
    dst = models.build_model_chunks(spec, pg_collection=_dp2_tp1_groups())
    service = _cpu_gloo_copy_service()
    seconds = []
    for _ in range(repeats + 1):  # the first call also builds and caches the plan
        start = time.perf_counter()
        swap_model_weights(src, dst, service)
        seconds.append(time.perf_counter() - start)
    remote, local = service.remote_bytes // (repeats + 1), service.local_bytes // (repeats + 1)
    # Check: the TP=1 copy, converted by this library, is the single-rank conversion bit for bit.
    converter = get_converter(spec.family, models.hf_config(spec), dtype=torch.float32)
    want = {}
    for name, tensor in weights.items():
        want.update(converter.convert(name, tensor))
    got = dict(MegatronWeightStream(dst, ParallelLayout.single(), converter))
    exact = set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    held = sum(p.numel() * p.element_size() for p in dst[0].parameters())
    return {"plan_s": seconds[0], "seconds": seconds[1:], "remote": remote, "local": local, "exact": exact,
            "dst_bytes": held}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed refits after the one that plans")
    parser.add_argument("--versions", type=int, default=4, help="syncs per transport point (first = warm-up)")
    args = parser.parse_args(argv)
    print(machine_description())
    print(f"model: {SPEC}; layout change: TP=2 -> two TP=1 copies; float32")
    out = run_distributed(_refit_job, 2, args.repeats, timeout=1800)
    assert all(r["exact"] for r in out), "refit result differs from the single-rank conversion"
    refit_s = statistics.median(max(r["seconds"][k] for r in out) for k in range(args.repeats))
    print(f"refit (megatron.core.resharding 0.16.1, gloo, colocated): {refit_s:.3f} s median of {args.repeats} "
          f"(first call, planning included: {max(r['plan_s'] for r in out):.3f} s); sent to other ranks "
          f"{sum(r['remote'] for r in out) / MB:.1f} MB, copied locally {sum(r['local'] for r in out) / MB:.1f} MB; "
          f"destination {out[0]['dst_bytes'] / MB:.1f} MB per rank; exact: {all(r['exact'] for r in out)}", flush=True)
    for transport in ("broadcast", "p2p-torch", "p2p-mooncake"):
        r = run_point(transport, engines=2, engine_tp=1, versions=args.versions, dtype="float32")
        print(f"{transport} (trainer TP=2 -> 2 engines TP=1, HF float32): {r['sync_s']:.3f} s median sync "
              f"(gather {r['phases']['gather']:.3f}, convert {r['phases']['convert']:.3f}, transfer "
              f"{r['phases']['transfer']:.3f}, commit {r['phases']['commit']:.3f}); received "
              f"{r['wire'] / MB:.1f} MB ({'/'.join(f'{b / MB:.1f}' for b in r['recv'])} per rank)", flush=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in __import__('os').getloadavg())}")


if __name__ == "__main__":
    main()
