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
from megatron_sync.scale.phases import SyncOptions, broadcast_rate, gather_seconds
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
    "ours-broadcast": _ours("broadcast"),
    "ours-p2p": _ours("p2p"),
}
