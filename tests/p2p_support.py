"""Test support for the P2P path: tiny plans, seeded tensors, staging checks, two jobs side by side."""

from __future__ import annotations

import torch

from megatron_sync.p2p.layout import Shard, TensorSpec, tensor_specs


def synthetic_plan(family: str, engines, senders: int, bucket: int, *, kv: int = 2):
    """Return (specs, receivers, holders, plan) for a tiny model of `family` and engine layout factories.

    Every HF tensor is its own unit; holders balance the bytes sent.
    """
    from converters import get_converter
    from megatron_sync.p2p.assign import ReplicaUnit, TrainerRank, assign_replica
    from megatron_sync.p2p.plan import build_transfer_plan, fleet_receivers, send_bytes_per_tensor
    from tests.support import models

    cfg = models.hf_config(models.ModelSpec(family=family, num_kv_heads=kv))
    specs = tensor_specs(get_converter(family, cfg))
    receivers = fleet_receivers(specs, [make(kv) for make in engines])
    units = [ReplicaUnit(s.name, 0, ((s.name, s.nbytes),)) for s in specs]
    cost = send_bytes_per_tensor(specs, receivers)
    holders = assign_replica(units, [TrainerRank(r) for r in range(senders)], cost=cost).hf_holders()
    return specs, receivers, holders, build_transfer_plan(specs, holders, receivers, bucket)


def seeded_full(spec: TensorSpec) -> torch.Tensor:
    """Return a full tensor for `spec` whose values depend only on its name."""
    import zlib

    gen = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()))
    return torch.randn(spec.shape, generator=gen).to(spec.dtype)


SENTINEL = 0xA5


def untouched_outside_placements(layout, staging: torch.Tensor) -> bool:
    """True when every staging byte outside the layout's placements still holds SENTINEL."""
    offsets = layout.param_offsets()
    mask = torch.ones(staging.numel(), dtype=torch.bool)
    for p in layout.placements:
        at = offsets[p.param] + p.offset
        mask[at:at + p.nbytes] = False
    return bool((staging[mask] == SENTINEL).all())


def run_side_by_side(jobs, timeout: float) -> list[list]:
    """Run several `run_distributed` jobs at once (e.g. a trainer job and an inference job); return their results.

    `jobs` are (fn, world_size, args) triples; each job gets its own default process group.
    The first job to fail raises once every job has stopped (each is bounded by `timeout`).
    """
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.dist import run_distributed

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run_distributed, fn, world, *args, timeout=timeout) for fn, world, args in jobs]
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error
    return [f.result() for f in futures]
