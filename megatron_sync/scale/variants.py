"""Other systems' weight-update methods over the same plan summaries and hardware profiles.

Each variant models one published method from its code or documentation (the docstring says which);
`published.py` holds the measurements. Two constants are fitted, on calibration rows only
(`published.fit_constants`, the fit reproduced by a test): the per-HF-tensor cost of an engine's
Python weight loader (SGLang's, on the Miles broadcast rows; vLLM's, with a per-bucket round trip, on
the checkpoint-engine broadcast rows). Every other number is the hardware profile's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from megatron_sync.scale.hardware import HardwareProfile
from megatron_sync.scale.phases import SyncOptions, broadcast_rate, gather_seconds, members_per_node
from megatron_sync.scale.summary import PlanSummary
from megatron_sync.scale.timing import predict


@dataclass(frozen=True)
class Constants:
    """The fitted constants (seconds) and the calibration rows each was fitted on."""

    sglang_tensor_s: float = 0.0  # SGLang load_weights, per HF tensor per engine rank (Miles NCCL rows)
    vllm_tensor_s: float = 0.0  # vLLM load_weights from a bucket, per HF tensor (checkpoint-engine broadcast rows)
    bucket_round_s: float = 0.0  # checkpoint-engine: per bucket and log2(group), the reply + all_reduce + sync


FITTED = Constants(sglang_tensor_s=9.3e-05, vllm_tensor_s=6.7e-05, bucket_round_s=0.0016)
"""`published.fit_constants()` on the calibration rows (tests/test_scale_published.py checks it)."""


@dataclass(frozen=True)
class Modelled:
    """A variant's predicted seconds for a row, and what bounds it."""

    seconds: float
    bound: str
    parts: dict[str, float] = field(default_factory=dict)
    regressors: dict[str, float] = field(default_factory=dict)  # what each fitted constant multiplies


@dataclass(frozen=True)
class Setting:
    """What a row states beyond its layouts: bucket size, fixed post-processing, the updated ranks."""

    bucket_bytes: int = 1 << 30
    post_s: float = 0.0  # post-processing the source states as included in its time
    extra: dict = field(default_factory=dict)


def _most(parts: dict[str, float]) -> str:
    return max(parts, key=parts.get)


def _tensors_per_rank(b: PlanSummary) -> int:
    return max(b.shard_tensors) if b.shard_tensors else b.tensors


def miles_broadcast(plans: dict[str, PlanSummary], profile: HardwareProfile, s: Setting, k: Constants) -> Modelled:
    """Miles + SGLang NCCL broadcast (miles docs, "P2P Weight Transfer" / architecture): every PP stage's head
    all-gathers its stage (TP, then EP per bucket) and broadcasts each bucket to every engine rank in its own
    group (the head alone on its node: one NIC); each engine rank loads every tensor of the bucket
    (`load_weights`); stages run independently, every engine rank receives the whole model."""
    b = plans["broadcast"]
    rate = broadcast_rate(profile, [1, b.fleet.gpus_per_node])
    tensors = b.tensors
    per_stage = max(gather_seconds(b.gather.get(x.rank), profile) + x.bytes / rate + x.tensors * k.sglang_tensor_s
                    for x in b.senders)
    receive = b.model_bytes / profile.nic_per_gpu + tensors * k.sglang_tensor_s
    parts = {"a stage's gather + broadcast + load": per_stage, "every engine rank receives and loads it all": receive}
    return Modelled(max(parts.values()) + s.post_s, _most(parts), parts, {"sglang_tensor_s": tensors})


def miles_p2p(plans: dict[str, PlanSummary], profile: HardwareProfile, s: Setting, k: Constants) -> Modelled:
    """Miles + SGLang RDMA P2P (miles docs): every training rank all-gathers its stage, loads its targets' part
    into a CPU replica of the target engine rank (SGLang `load_weights` on CPU; one replica per distinct
    target layout) and RDMA-writes it from pinned host memory to each target (targets of a stage spread
    round-robin over its ranks, writes to later engines pipelined); the engine post-processes at the end."""
    b = plans["broadcast"]
    fleet, trainer = b.fleet, b.trainer
    targets = -(-fleet.ranks // trainer.stage_ranks)
    layouts = -(-fleet.engine_ranks // trainer.stage_ranks)
    worst, load = 0.0, 0
    for x in b.senders:
        share = x.bytes / max(1, b.model_bytes)
        shard = max(b.shard_bytes) * share
        replica = layouts * (shard / profile.host_copy.value + _tensors_per_rank(b) * share * k.sglang_tensor_s)
        write = targets * shard / min(profile.nic_per_gpu, profile.pcie.value)
        worst = max(worst, gather_seconds(b.gather.get(x.rank), profile) + replica + write)
        load = max(load, layouts * _tensors_per_rank(b) * share)
    parts = {"a training rank's gather, CPU replica and writes": worst}
    return Modelled(worst + s.post_s, _most(parts), parts, {"sglang_tensor_s": load})


def _ckpt_rounds(b: PlanSummary, s: Setting, owners: int) -> tuple[int, int]:
    """Return (rounds, buckets) of checkpoint-engine's schedule: every owner's share cut into buckets."""
    per_owner = b.model_bytes / owners
    rounds = max(1, math.ceil(per_owner / s.bucket_bytes))
    return rounds, rounds * owners


def checkpoint_engine(plans: dict[str, PlanSummary], profile: HardwareProfile, s: Setting, k: Constants) -> Modelled:
    """checkpoint-engine `ParameterServer.update` (checkpoint_engine/ps.py `_update_per_bucket`), colocated
    with vLLM: the checkpoint is spread over every rank's host memory. Each round, every owner copies its
    next bucket to its GPU (in parallel: the h2d buffer; P2P: the updated ranks read it from the owners'
    host memory over RDMA); then, bucket after bucket, it is broadcast to the group (every GPU of the
    update; one node: NVLink), every vLLM worker loads its part of the bucket's tensors from the IPC buffer
    and replies, and the group all-reduces a status (a round trip whose latency grows with log2 of the group)."""
    b = plans["broadcast"]
    group = b.fleet.ranks
    p2p = bool(s.extra.get("p2p"))
    owners = group if p2p else b.trainer.world
    rounds, buckets = _ckpt_rounds(b, s, owners)
    bucket = min(s.bucket_bytes, b.model_bytes / buckets)
    per_node = [min(group, b.fleet.gpus_per_node)] * max(1, math.ceil(group / b.fleet.gpus_per_node))
    rate = broadcast_rate(profile, per_node)
    fetch = bucket / (min(profile.nic_per_gpu, profile.pcie.value) if p2p else profile.pcie.value)
    tensors = _tensors_per_rank(b)
    parts = {"fetch (host to device, or RDMA read)": rounds * fetch,
             "broadcast": b.model_bytes / rate,
             "vLLM load from the IPC buffer": max(b.shard_bytes) / profile.device_copy + tensors * k.vllm_tensor_s,
             "per-bucket round trips": buckets * math.log2(max(2, group)) * k.bucket_round_s}
    return Modelled(sum(parts.values()) + s.post_s, _most(parts), parts,
                    {"vllm_tensor_s": tensors, "bucket_round_s": buckets * math.log2(max(2, group))})


def rdma_write(plans: dict[str, PlanSummary], profile: HardwareProfile, s: Setting, k: Constants) -> Modelled:
    """Perplexity's static schedule of RDMA WRITEs, GPU to GPU (research.perplexity.ai, le.qun.ch): every
    training GPU rebuilds full tensors of its mesh (full_tensor), projects and quantizes on the GPU, and
    writes them into the inference GPUs; no host copy, no checksum; sends spread over the training GPUs."""
    b = plans["broadcast"]
    nic = profile.nic_per_gpu
    sent = sum(b.shard_bytes)  # every engine written by the trainer: every engine rank's shard
    send = sent / b.trainer.world / nic
    receive = max(b.shard_bytes) / nic
    rebuild = 2 * sent / b.trainer.world / b.fleet.engines / nic  # bf16 sources (2x FP8) of what a GPU sends
    parts = {"sending GPU's NIC": send, "receiving GPU's NIC": receive, "full_tensor rebuild": rebuild}
    return Modelled(max(parts.values()) + 2 * profile.round_s.value + s.post_s, _most(parts), parts)


# ---------------------------------------------------------------- methods of the check rows (written before
# their measured values were read; see published_rows.CHECKS)


def _export_link(b: PlanSummary, profile: HardwareProfile) -> float:
    """Return the rate at which a trainer rank gathers every full tensor: NVLink when its TP, EP and PP
    groups stay inside a node, else its NIC."""
    t, g = b.trainer, b.trainer.gpus_per_node
    crosses = t.tp > g or t.ep * t.etp > g or (t.pp > 1 and t.nodes > 1)
    return profile.nic_per_gpu if crosses else profile.nvlink.value


def export_all(b: PlanSummary, profile: HardwareProfile, *, source_bytes_per_hf_byte: float = 1.0,
               collectives: int = 2) -> float:
    """Return the seconds every trainer rank takes to obtain every full HF tensor (Megatron-Bridge /
    verl's per-tensor generators, FSDP's full_tensor): the model's bytes it does not hold, at the link its
    groups use, plus one collective latency per tensor and group kind."""
    held = 1.0 / max(1, b.trainer.world)
    moved = b.model_bytes * source_bytes_per_hf_byte * (1.0 - held)
    return moved / _export_link(b, profile) + b.tensors * collectives * profile.message_s.value


def verl_nccl(plans: dict[str, PlanSummary], profile: HardwareProfile, s: Setting, k: Constants) -> Modelled:
    """verl `NCCLCheckpointEngine` (verl/checkpoint_engine/nccl_checkpoint_engine.py): every trainer rank
    walks the weights generator (FSDP: full_tensor of fp32 parameters, cast to bf16); trainer rank 0 packs
    them into two alternating buckets and broadcasts each to every rollout rank (one NCCL group of trainer
    rank 0 and the rollout ranks), bucket metadata over ZeroMQ; the rollout ranks only receive."""
    b = plans["broadcast"]
    export = export_all(b, profile, source_bytes_per_hf_byte=2.0, collectives=1) + b.model_bytes / profile.device_copy
    rate = broadcast_rate(profile, members_per_node(b, 0))
    buckets = max(1, math.ceil(b.model_bytes / s.bucket_bytes))
    wire = b.model_bytes / rate + buckets * 2 * profile.message_s.value
    parts = {"trainer: gather + cast + pack": export, "broadcast": wire}
    return Modelled(max(parts.values()) + min(s.bucket_bytes, b.model_bytes) / rate, _most(parts), parts)


def verl_nixl_ring(plans: dict[str, PlanSummary], profile: HardwareProfile, s: Setting, k: Constants) -> Modelled:
    """verl `NIXLCheckpointEngine` (verl/checkpoint_engine/nixl_checkpoint_engine.py): trainer rank 0 packs
    buckets as for NCCL; the rollout ranks form a chain after it, each RDMA-READs bucket i from the one
    before it into one of two buffers and offers it to the next (metadata and completion over ZeroMQ / NIXL
    notifications): a pipeline of buckets through the chain, paced by its slowest hop."""
    b = plans["broadcast"]
    trainer, fleet = b.trainer, b.fleet
    export = export_all(b, profile, source_bytes_per_hf_byte=2.0, collectives=1) + b.model_bytes / profile.device_copy
    nodes = [trainer.node_of(0)] + [fleet.node_of(r, trainer) for r in range(fleet.ranks)]
    slowest = min(profile.nvlink.value if a == c else profile.nic_per_gpu for a, c in zip(nodes, nodes[1:]))
    bucket = min(s.bucket_bytes, b.model_bytes)
    period = bucket / slowest + 2 * profile.message_s.value
    buckets = max(1, math.ceil(b.model_bytes / bucket))
    parts = {"trainer: gather + cast + pack": export, "the chain's buckets": buckets * period}
    return Modelled(max(parts.values()) + (len(nodes) - 2) * period, _most(parts), parts)


def verl_async(plans: dict[str, PlanSummary], profile: HardwareProfile, s: Setting, k: Constants) -> Modelled:
    """verl fully_async `ParameterSynchronizer.sync_weights` (verl/experimental/fully_async_policy), Megatron
    trainer, vLLM rollout, one NCCL group of every trainer and rollout rank. Every trainer rank walks the
    per-tensor generator (every full tensor on every rank). With the checkpoint engine
    (`checkpoint_engine.py`, buckets of device_buffer_size_M): each trainer rank copies its share of the
    buckets to pinned host memory, then round by round the owners copy their next bucket back to the GPU and
    bucket after bucket it is broadcast to the group and loaded by every rollout rank (load_weights), no
    overlap; without it, tensor after tensor: broadcast from trainer rank 0, then load_weights of that one
    tensor. The rollouter's pause is part of the time."""
    b = plans["broadcast"]
    group = b.trainer.world + b.fleet.ranks
    per_node = [b.fleet.gpus_per_node] * max(2, math.ceil(group / b.fleet.gpus_per_node))
    rate = broadcast_rate(profile, per_node if group > b.fleet.gpus_per_node else [group])
    latency = profile.message_s.value * math.log2(max(2, group))
    load = max(b.shard_bytes) / profile.device_copy + _tensors_per_rank(b) * k.vllm_tensor_s
    parts = {"every trainer rank gathers every tensor": export_all(b, profile)}
    if s.extra.get("bucketed"):
        owners = b.trainer.world
        rounds, buckets = _ckpt_rounds(b, s, owners)
        parts["copy to pinned host memory"] = b.model_bytes / owners / profile.pcie.value
        parts["host to device, per round"] = rounds * min(s.bucket_bytes, b.model_bytes / owners) / profile.pcie.value
        parts["broadcast, bucket by bucket"] = b.model_bytes / rate + buckets * latency
    else:
        parts["broadcast, tensor by tensor"] = b.model_bytes / rate + b.tensors * latency
    parts["vLLM load_weights"] = load
    return Modelled(sum(parts.values()) + profile.pause_resume_s.value, _most(parts), parts)


def nemo_nccl(plans: dict[str, PlanSummary], profile: HardwareProfile, s: Setting, k: Constants) -> Modelled:
    """NeMo-RL's collective refit (nemo_rl/utils/packed_tensor.py `packed_broadcast_producer`): every policy
    rank walks Megatron-Bridge's export (every full tensor on every rank); policy rank 0 packs tensors into
    alternating buffers and broadcasts each to every vLLM worker (its group: rank 0, alone on its node, and
    the vLLM ranks), which load them (load_weights); the buffers pipeline packing, wire and load."""
    b = plans["broadcast"]
    rate = broadcast_rate(profile, members_per_node(b, 0))
    parts = {"every policy rank exports every tensor": export_all(b, profile),
             "broadcast from policy rank 0": b.model_bytes / rate,
             "vLLM load_weights": max(b.shard_bytes) / profile.device_copy + b.tensors * k.vllm_tensor_s}
    return Modelled(max(parts.values()) + min(s.bucket_bytes, b.model_bytes) / rate, _most(parts), parts)


def nemo_nixl(plans: dict[str, PlanSummary], profile: HardwareProfile, s: Setting, k: Constants) -> Modelled:
    """NeMo-RL's NIXL checkpoint engine (nemo_rl/utils/checkpoint_engines/nixl.py): policy rank r feeds
    rollout rank r (the first as many policy ranks as rollout ranks), which RDMA-READs from it, through two
    buffers, the tensors it holds (with shard_expert_weights: its own expert shards); every policy rank walks
    Megatron-Bridge's export; the rollout rank loads what it received (load_weights)."""
    b = plans["broadcast"]
    shard, tensors = max(b.shard_bytes), s.extra.get("tensors_per_rank", _tensors_per_rank(b))
    parts = {"every policy rank exports every tensor": export_all(b, profile),
             "each rollout rank reads its shard": shard / profile.nic_per_gpu,
             "vLLM load_weights": shard / profile.device_copy + tensors * k.vllm_tensor_s}
    return Modelled(max(parts.values()) + min(s.bucket_bytes, shard) / profile.nic_per_gpu, _most(parts), parts)


def _ours(transport: str) -> Callable:
    def model(plans: dict[str, PlanSummary], profile: HardwareProfile, s: Setting, k: Constants) -> Modelled:
        prediction = predict(plans[transport], profile, SyncOptions())
        return Modelled(prediction.seconds, prediction.bound)

    model.__doc__ = f"This library's {transport} transport on the same layouts (megatron_sync.scale.timing)."
    return model


VARIANTS: dict[str, Callable] = {
    "miles-broadcast": miles_broadcast,
    "miles-p2p": miles_p2p,
    "checkpoint-engine": checkpoint_engine,
    "rdma-write": rdma_write,
    "verl-nccl": verl_nccl,
    "verl-nixl-ring": verl_nixl_ring,
    "verl-async": verl_async,
    "nemo-nccl": nemo_nccl,
    "nemo-nixl": nemo_nixl,
    "ours-broadcast": _ours("broadcast"),
    "ours-p2p": _ours("p2p"),
}
