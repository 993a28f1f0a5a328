"""The time model: a transport's plan summary and a hardware profile in, predicted seconds per phase out.

Each transport is modelled with the pipelining its code really does: `timing_gpu` (broadcast, the
built colocated `ipc`, disk-delta on GPU clusters), `timing_p2p` (device-direct P2P), `timing_local`
(this machine, where every phase is CPU work on shared cores). Every prediction carries the physical
bound of its layouts: the largest shard an inference rank needs over every link that can feed it (its
NIC from other nodes, NVLink from trainer GPUs of its own node, a device copy from its own GPU when the
jobs are colocated); no transport's prediction is below it.
"""

from __future__ import annotations

from typing import Callable

from megatron_sync.scale.hardware import HardwareProfile
from megatron_sync.scale.phases import Phase, Prediction, SyncOptions, gather_seconds
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
    """Return the bytes/s every link that can feed inference rank `rank` carries together: its NIC (trainer
    GPUs on other nodes), NVLink (trainer GPUs of its node), a device copy (its own GPU trains too)."""
    trainer, fleet = summary.trainer, summary.fleet
    node, gpu = fleet.node_of(rank, trainer), fleet.first_gpu(trainer) + rank
    on_node = [t for t in range(node * trainer.gpus_per_node, (node + 1) * trainer.gpus_per_node) if t < trainer.world]
    rate = profile.nic_per_gpu if len(on_node) < trainer.world else 0.0
    rate += profile.nvlink.value if any(t != gpu for t in on_node) else 0.0
    return rate + (profile.device_copy if gpu in on_node else 0.0)


def physical_bound(summary: PlanSummary, profile: HardwareProfile) -> float:
    """Return the time no transport can beat: the largest shard over its rank's input links (see the
    module doc); on the CPU machine, one copy of the largest shard at the measured copy rate."""
    if not summary.shard_bytes:
        return 0.0
    if profile.cpu_bound:  # every transport at least copies each byte of the shard once
        return max(summary.shard_bytes) * profile.cpu["copy_byte"].value
    ranks = summary.fleet.engine_ranks  # every engine is laid out alike: one engine's ranks per node kind
    return max(summary.shard_bytes[r] / input_rate(summary, profile, r) for r in range(len(summary.shard_bytes))
               if r < ranks or summary.fleet.colocated or summary.fleet.shares_nodes(summary.trainer))


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
    return Prediction(summary.transport, profile.name, total, bound, tuple(phases), floor, cpu)


__all__ = ["Phase", "Prediction", "SyncOptions", "gather_seconds", "models", "physical_bound", "predict",
           "processor_sharing", "missing_rates"]
