"""What a prediction is made of: phases, the prediction, the settings it depends on, and the link rates
every transport's model shares (a gather's links, NCCL's broadcast, an engine's load and commit)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from megatron_sync.layout.staging import resolve_staging_sets
from megatron_sync.scale.hardware import HardwareProfile
from megatron_sync.scale.summary import PlanSummary, Traffic

WSUM64_PASSES = 3
"""HBM passes of `core.checksum.wsum64_checksum` on a GPU: it reads the words, writes their weighted
products (one int64 tensor as large as the bytes) and reads them back to sum them."""


@dataclass(frozen=True)
class Phase:
    """Seconds one phase takes on the endpoint where it is longest, and the rate behind it."""

    name: str
    seconds: float
    where: str
    rate: str = ""  # the rate behind it and that rate's source


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds of one sync, the phases behind it, and what bounds it."""

    transport: str
    profile: str
    seconds: float
    bound: str  # the phase (and where) that sets the time
    phases: tuple[Phase, ...]
    physical_bound: float  # the largest shard any inference rank needs / every link that can feed it
    cpu_seconds: float | None = None  # cpu_bound profiles: CPU-seconds of all processes
    notes: tuple[str, ...] = field(default_factory=tuple)

    def phase(self, name: str) -> float:
        return max((p.seconds for p in self.phases if p.name == name), default=0.0)


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """Settings the prediction depends on besides the plan."""

    checksum: bool = True
    delta_threads: int = 2
    pause_resume: bool = True  # driven engines pause and resume around the sync
    p2p_backend: str = "nixl"  # torch | mooncake | nixl: what moves P2P's bytes (distinct rates on `local`)
    engine_switch: bool = False
    """The engine computes on the staging set a version arrived in (the reference engine's unfused weights), so
    a broadcast, ipc or P2P apply switches sets; False: it copies the shard into weights of its own (vLLM, SGLang)."""
    staging_sets: int | str = "auto"
    """`weight_sync.staging_sets`: 1 keeps one set per inference rank and a host copy of the live version, taken
    between syncs (the engine then copies: no switch); 2 keeps two sets; "auto" (the default) is 2 for an engine
    that runs on a set (`engine_switch`), else 1 (`sets`)."""

    @property
    def sets(self) -> int:
        """Return the staging sets each inference rank keeps (`staging_sets` with "auto" resolved)."""
        return resolve_staging_sets(self.staging_sets, copies=not self.engine_switch)


def gather_seconds(traffic: Traffic | None, profile: HardwareProfile) -> float:
    """Return the seconds of one rank's gathers: its busiest link (NVLink inside a node, its NIC across)
    plus one message latency per unit."""
    if traffic is None:
        return 0.0
    links = max(traffic.in_intra / profile.nvlink.value, traffic.in_inter / profile.nic_per_gpu,
                traffic.out_intra / profile.nvlink.value, traffic.out_inter / profile.nic_per_gpu)
    return links + traffic.units * profile.message_s.value


def broadcast_rate(profile: HardwareProfile, members_per_node: Sequence[int]) -> float:
    """Return the bytes/s an NCCL broadcast delivers to every member of a group with `members_per_node`
    members on each node it spans: NVLink inside one node; across nodes every ring channel crosses each
    node through one NIC, and a node has at most one NIC per member GPU (a root alone on its node drives
    one NIC), capped by NVLink, which carries the ring inside a node."""
    if len(members_per_node) <= 1:
        return profile.nvlink.value
    return min(profile.nvlink.value, min(members_per_node) * profile.nic_per_gpu)


def members_per_node(summary: PlanSummary, root: int) -> list[int]:
    """Return the members per node of the broadcast group of trainer rank `root` and every inference rank."""
    count: dict[int, int] = {}
    for node in [summary.trainer.node_of(root)] + [r.node for r in summary.receivers]:
        count[node] = count.get(node, 0) + 1
    return list(count.values())


def device_checksum_rate(profile: HardwareProfile, checksum: bool) -> float:
    """Return wsum64's bytes/s on a GPU (`WSUM64_PASSES` HBM passes), infinite without a checksum."""
    return profile.hbm.value / WSUM64_PASSES if checksum else math.inf


def engine_tail(summary: PlanSummary, profile: HardwareProfile, rounds: int, options: SyncOptions,
                *, staged: bool = True) -> list[Phase]:
    """The engine's apply, the agreement rounds, and pause + resume of driven engines. The apply is a load that
    copies the largest shard, or a switch of staging sets where the version waited in one (`staged`: broadcast,
    ipc, P2P) and the engine runs on it (`options.engine_switch`)."""
    rank = max(range(len(summary.shard_bytes)), key=summary.shard_bytes.__getitem__, default=0)
    if not (staged and options.engine_switch and options.sets == 2):
        apply = (summary.shard_bytes[rank] / profile.device_copy
                 + summary.shard_tensors[rank] * profile.apply_tensor_s.value) if summary.shard_bytes else 0.0
        phases = [Phase("apply", apply, f"inference rank {rank}", f"{rate_of(profile, 'copy')} + "
                        f"{profile.apply_tensor_s.value * 1e6:g} us a tensor [{_cite(profile.apply_tensor_s.source)}]")]
    else:
        phases = [Phase("apply (switch staging set)", profile.switch_s.value, "every inference rank",
                        f"[{_cite(profile.switch_s.source)}]")]
    phases.append(Phase("commit", rounds * profile.round_s.value, f"{rounds} agreement rounds",
                        f"{profile.round_s.value * 1e3:g} ms a round [{_cite(profile.round_s.source)}]"))
    if options.pause_resume:
        phases.append(Phase("pause+resume", profile.pause_resume_s.value, "engines",
                            f"[{_cite(profile.pause_resume_s.source)}]"))
    return phases


STAGED = ("broadcast", "ipc", "p2p")
"""The transports whose receivers stage every version in `weight_sync.staging_sets` sets (`staging_memory`)."""


def staging_memory(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions) -> str:
    """Return what the inference rank with the largest shard holds for syncs (broadcast, ipc, P2P: its staging
    sets, and its weights unless it runs on a set), and with one set the host copy and its time between syncs."""
    shard = max(summary.shard_bytes, default=0) / 1e9
    if options.sets == 1:
        between = max(summary.shard_bytes, default=0) / profile.pcie.value
        return (f"engine rank memory: its weights + 1 staging set = 2 x {shard:.1f} GB = {2 * shard:.1f} GB on the "
                f"GPU, and a host copy of the live version ({shard:.1f} GB pinned) for rollback, copied in "
                f"{between:.2f} s between syncs ({rate_of(profile, 'pcie')}); counted in no sync")
    if options.engine_switch:
        return (f"engine rank memory: 2 staging sets, the live one its weights = 2 x {shard:.1f} GB = "
                f"{2 * shard:.1f} GB on the GPU")
    return (f"engine rank memory: its weights + 2 staging sets = 3 x {shard:.1f} GB = {3 * shard:.1f} GB on the GPU "
            "(staging_sets 2 for an engine that copies; auto: 1 set, 2 x)")


def _cite(source: str) -> str:
    """Return the short name of a profile value's source (its first clause)."""
    return source.split(":")[0].split(" (")[0].strip()


def rate_of(profile: HardwareProfile, link: str) -> str:
    """Return a link's rate and the short name of its source (`python -m megatron_sync.scale profile NAME`
    prints every source in full): nic, nvlink, hbm, copy (a device copy), wsum64, pcie, host_xxh3, storage, store
    (the rendezvous store's work per P2P report)."""
    gb = 1e9
    p = profile
    if link == "nic":
        return (f"NIC {p.nic_per_gpu / gb:.1f} GB/s/GPU = {p.nics_per_node.value:g}x{p.nic_gbps.value:g} Gb/s / "
                f"{p.gpus_per_node.value:g} GPUs x {p.nic_efficiency.value:g} [{_cite(p.nic_gbps.source)}; "
                f"{_cite(p.nic_efficiency.source)}]")
    if link in ("nvlink", "hbm", "pcie", "host_xxh3", "storage"):
        value = getattr(p, link)
        return f"{link} {value.value / gb:.0f} GB/s [{_cite(value.source)}]"
    if link == "copy":
        return f"device copy {p.device_copy / gb:.0f} GB/s = HBM / 2 [{_cite(p.hbm.source)}]"
    if link == "store":
        return (f"{p.store_post_s.value * 1e6:g} us a report + {p.store_take_s.value * 1e6:g} us a take "
                f"[{_cite(p.store_post_s.source)}]")
    if link == "wsum64":
        return (f"wsum64 {p.hbm.value / WSUM64_PASSES / gb:.0f} GB/s = HBM / {WSUM64_PASSES} "
                f"[{_cite(p.hbm.source)}; passes from core/checksum.py]")
    raise ValueError(f"no rate named {link!r}")


def bound_of(phases: Sequence[Phase], streaming: set[str]) -> str:
    """Return the longest streaming phase and where it runs."""
    top = max((p for p in phases if p.name in streaming), key=lambda p: p.seconds)
    return f"{top.name} ({top.where})"
