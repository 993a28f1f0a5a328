"""The time model: a transport's plan summary and a hardware profile in, predicted seconds per phase out.

Each transport is modelled with the pipelining its code really does: `timing_gpu` (broadcast, the
built colocated `ipc`, disk-delta on GPU clusters), `timing_p2p` (device-direct P2P), `timing_local`
(this machine, where every phase is CPU work on shared cores). Every prediction carries the physical
bound of its layouts (`physical_bound`: what a rank's links, and a node's NICs, must carry at least);
no transport's prediction is below it.
"""

from __future__ import annotations

from typing import Callable

from megatron_sync.scale.hardware import HardwareProfile
from megatron_sync.scale.phases import STAGED, Phase, Prediction, SyncOptions, gather_seconds, staging_memory
from megatron_sync.scale.summary import PlanSummary
from megatron_sync.scale.timing_gpu import broadcast_gpu, disk_delta_gpu, ipc_gpu
from megatron_sync.scale.timing_local import MODELS as LOCAL_MODELS
from megatron_sync.scale.timing_local import processor_sharing, required
from megatron_sync.scale.timing_p2p import p2p_gpu

_GPU: dict[str, Callable] = {"broadcast": broadcast_gpu, "p2p": p2p_gpu, "ipc": ipc_gpu, "disk_delta": disk_delta_gpu}


def missing_rates(transport: str, profile: HardwareProfile, trainer_tp: int = 1,
                  options: SyncOptions = SyncOptions()) -> list[str]:
    """Return the measured rates a `cpu_bound` profile lacks for `transport` ([] on GPU profiles)."""
    if not profile.cpu_bound:
        return []
    return [key for key in required(transport, trainer_tp, options) if key not in profile.cpu]


def models(transport: str, profile: HardwareProfile, trainer_tp: int = 1, options: SyncOptions = SyncOptions()) -> bool:
    """Return True if the time model covers `transport` on `profile` (on `local`: its rates were measured)."""
    table = LOCAL_MODELS if profile.cpu_bound else _GPU
    return transport in table and not missing_rates(transport, profile, trainer_tp, options)


def input_rate(summary: PlanSummary, profile: HardwareProfile, rank: int) -> float:
    """Return the bytes/s every link that can feed inference rank `rank` carries together: its NIC (GPUs on
    other nodes), NVLink (any other GPU of its node, trainer or engine: engines relay), a device copy (its
    own GPU trains too)."""
    trainer, fleet = summary.trainer, summary.fleet
    node, gpu = fleet.node_of(rank, trainer), fleet.first_gpu(trainer) + rank
    g = trainer.gpus_per_node
    used = set(range(trainer.world)) | {fleet.first_gpu(trainer) + r for r in range(fleet.ranks)}
    on_node = {x for x in used if x // g == node}
    rate = profile.nic_per_gpu if len(on_node) < len(used) else 0.0
    rate += profile.nvlink.value if on_node - {gpu} else 0.0
    return rate + (profile.device_copy if gpu < trainer.world else 0.0)


def physical_bound(summary: PlanSummary, profile: HardwareProfile) -> float:
    """Return the time no transport can beat (on the CPU machine: one copy of the largest shard at the
    measured copy rate). On GPU nodes the larger of: a rank's shard over every link that feeds it; and, on
    a node without trainer GPUs, the distinct bytes its inference ranks hold (ranks of one engine hold
    different shards, less what an engine holds twice; the same rank of several engines, one shard) over
    the node's NICs, through which they all must come."""
    if not summary.shard_bytes:
        return 0.0
    if profile.cpu_bound:
        return max(summary.shard_bytes) * profile.cpu["copy_byte"].value
    trainer, fleet, shards = summary.trainer, summary.fleet, summary.shard_bytes
    per_engine = fleet.engine_ranks
    twice = max(0, sum(shards[:per_engine]) - summary.model_bytes)
    positions: dict[int, set[int]] = {}
    for r in range(fleet.ranks):
        positions.setdefault(fleet.node_of(r, trainer), set()).add(r % per_engine)
    worst = 0.0
    for node, held in positions.items():
        first = next(r for r in range(fleet.ranks) if fleet.node_of(r, trainer) == node)
        worst = max(worst, max(shards[p] for p in held) / input_rate(summary, profile, first))
        if node >= trainer.nodes:  # no trainer GPU here: everything enters through the NICs
            union = max(max(shards[p] for p in held), sum(shards[p] for p in held) - twice)
            worst = max(worst, union / profile.node_nic)
    return worst


def predict(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions = SyncOptions()) -> Prediction:
    """Return the predicted time of the sync `summary` plans on `profile`; ValueError names what is missing."""
    missing = missing_rates(summary.transport, profile, summary.trainer.tp, options)
    table = LOCAL_MODELS if profile.cpu_bound else _GPU
    if summary.transport not in table or missing:
        raise ValueError(f"profile {profile.name!r} has no model of {summary.transport}"
                         + (f": its rates file lacks {missing}; measure them with bench/bench_scale_rates.py"
                            if missing else ""))
    phases, total, bound, cpu = table[summary.transport](summary, profile, options)
    floor = physical_bound(summary, profile)
    if total < floor:
        raise AssertionError(f"{summary.transport} predicted {total:.3f} s, below its physical bound {floor:.3f} s: "
                             "a phase of its model moves bytes faster than the links allow")
    staged = summary.transport in STAGED and not profile.cpu_bound
    notes = (staging_memory(summary, profile, options),) if staged else ()
    return Prediction(summary.transport, profile.name, total, bound, tuple(phases), floor, cpu, notes)


__all__ = ["Phase", "Prediction", "SyncOptions", "gather_seconds", "models", "physical_bound", "predict",
           "processor_sharing", "missing_rates"]
