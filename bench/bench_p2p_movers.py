"""Throughput of the P2P byte movers on loopback: S senders push column shards into one engine of R ranks.

    PYTHONPATH=. python bench/bench_p2p_movers.py --mib 64 --senders 2 --receivers 2

Each version moves the same plan (64 MiB of bf16 tensors, COLUMN-split over the engine's
ranks) over one backend; a receiver's time runs from posting its receives to the last
checksum verified. Prints bytes, the slowest receiver's seconds and aggregate GB/s.
"""

from __future__ import annotations

import argparse
import time

import torch

from tests.support.dist import free_port, run_distributed

ROW_ELEMS = 4096


def _plan(mib: int, senders: int, receivers: int, bucket: int):
    from megatron_sync.layout.regions import Shard, Sharding, TensorSpec
    from megatron_sync.layout.roles import RoleLayout
    from megatron_sync.transports.p2p.assign import ReplicaUnit, TrainerRank, assign_replica
    from megatron_sync.transports.p2p.plan import build_transfer_plan, fleet_receivers

    rows = 512 * receivers  # 4 MiB per tensor in bf16 when receivers == 1
    count = max(1, mib * 2**20 // (rows * ROW_ELEMS * 2))
    specs = [TensorSpec(f"t{i}", (rows, ROW_ELEMS), torch.bfloat16, Shard.COLUMN) for i in range(count)]
    engine = RoleLayout(Sharding(receivers))
    fleet = fleet_receivers([engine.rank_layout(specs, rank) for rank in range(receivers)], receivers)
    units = [ReplicaUnit(s.name, 0, ((s.name, s.nbytes),)) for s in specs]
    holders = assign_replica(units, [TrainerRank(r) for r in range(senders)]).hf_holders()
    return specs, holders, build_transfer_plan(specs, holders, fleet, bucket)


def _worker(rank, world, port, planned, senders, backends, repeats):
    from megatron_sync.transports.p2p.execute import receive_shards, send_share
    from megatron_sync.transports.p2p.old_movers import MooncakeMover, TorchP2PMover
    from megatron_sync.session.group import init_transport_group

    specs, holders, plan = planned
    group = init_transport_group("127.0.0.1", port, world, rank, timeout=300, group_name="bench_p2p")
    peers = {("sender", s): s for s in range(senders)}
    peers.update({("receiver", i): senders + i for i in range(world - senders)})
    replica = {s.name: torch.randn(s.shape).to(s.dtype) for s in specs if holders.get(s.name) == rank}
    staging = None if rank < senders else torch.zeros(plan.receivers[rank - senders].layout.nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {}
    version = 0
    for backend in backends:
        mover = (MooncakeMover(group.board, protocol="tcp") if backend == "mooncake"
                 else TorchP2PMover(group, peers))
        if staging is not None:
            mover.expose(rank - senders, staging)
        for _ in range(repeats):
            version += 1
            group.all_gather_json(rank)
            start = time.perf_counter()
            if rank < senders:
                send_share(plan, rank, replica, mover, group.board, version=version)
            else:
                receive_shards(plan, rank - senders, staging, mover, group.board, version=version, timeout_s=300)
            times.setdefault(backend, []).append(time.perf_counter() - start)
        group.all_gather_json(rank)
        mover.close()
    group.close()
    return times


def main() -> None:
    """Run the benchmark the command line describes and print one line per backend."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="bytes moved per version, MiB")
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--receivers", type=int, default=2, help="ranks of the one engine")
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="torch,mooncake")
    args = parser.parse_args()
    planned = _plan(args.mib, args.senders, args.receivers, args.bucket_mib * 2**20)
    world = args.senders + args.receivers
    out = run_distributed(_worker, world, free_port(), planned, args.senders, args.backends.split(","),
                          args.repeats, timeout=900)
    total = sum(planned[2].bytes_to_receiver().values())
    for backend in args.backends.split(","):
        per_version = [max(out[r][backend][k] for r in range(args.senders, world)) for k in range(args.repeats)]
        best = min(per_version)
        print(f"{backend:9s} {total / 2**20:.0f} MiB, {args.senders} senders -> {args.receivers} receivers: "
              f"slowest receiver {best:.3f} s (best of {args.repeats}; all {[round(t, 3) for t in per_version]}), "
              f"{total / best / 1e9:.2f} GB/s aggregate")


if __name__ == "__main__":
    main()
