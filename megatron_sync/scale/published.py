"""Published syncs of other systems, modelled with the same planners and hardware profiles.

Each row is one measurement a project published (model, both layouts, fabric, seconds, source). Its
system does not always do what this library does, so each row names the *variant* that models its
method: a function over the same plan summaries and profile. `faithful` says whether that variant is
the published method as its authors describe it (True), or an approximation with stated assumptions
(False). `VARIANTS` also holds this library's own transports ("ours-broadcast", "ours-p2p"), which
`compare` reports beside each row: what this library would do on the same layouts.

Sources:
- LMSYS, "Updating 1T parameters in seconds — P2P weight transfer in Large Scale Distributed RL"
  (Miles + SGLang, H100 8-GPU hosts with InfiniBand), https://lmsys.org/blog/2026-04-29-p2p-update
- MoonshotAI checkpoint-engine README, benchmark table (vLLM v0.10.2rc1),
  https://github.com/MoonshotAI/checkpoint-engine (also PyPI checkpoint-engine 0.1.3)
- Perplexity, "Weight Transfer for RL Post-Training in under 2 seconds",
  https://research.perplexity.ai/articles/weight-transfer-for-rl-post-training-in-under-2-seconds and
  https://le.qun.ch/en/blog/2025/09/07/rl-weight-transfer (AWS p5, EFA)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

from megatron_sync.scale.hardware import HardwareProfile, profile_named
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.models import model_named
from megatron_sync.scale.plans import ScalePlanner
from megatron_sync.scale.summary import PlanSummary
from megatron_sync.scale.timing import SyncOptions, _gather_seconds, predict

LMSYS = "https://lmsys.org/blog/2026-04-29-p2p-update"
CKPT_ENGINE = "https://github.com/MoonshotAI/checkpoint-engine#benchmark"
PPLX = "https://research.perplexity.ai/articles/weight-transfer-for-rl-post-training-in-under-2-seconds"
PPLX_QWEN = "https://le.qun.ch/en/blog/2025/09/07/rl-weight-transfer"
FP8_64 = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [64, 64]}}
FP8_128 = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                   "weight_block_size": [128, 128]}}
BF16 = {"quantization_config": None}


@dataclass(frozen=True)
class Published:
    """One published sync: what ran, where, how long it took, and which variant models its method."""

    system: str
    model: str
    overrides: dict
    trainer: TrainerLayout
    fleet: FleetLayout
    profile: str
    seconds: float
    source: str
    variant: str
    faithful: bool
    note: str = ""

    def hf_config(self) -> tuple[str, dict]:
        family, config = model_named(self.model)
        config = copy.deepcopy(config)
        for key, value in self.overrides.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = copy.deepcopy(value)
        return family, config


@dataclass(frozen=True)
class Modelled:
    """A variant's predicted seconds for a row, and what bounds it."""

    seconds: float
    bound: str
    parts: dict[str, float] = field(default_factory=dict)


def _stage_heads(b: PlanSummary, profile: HardwareProfile) -> list[tuple[int, float, int]]:
    """Return per stage (stage, gather seconds of its head rank, stage bytes) from a broadcast summary."""
    return [(b.sender_stage[s.rank], _gather_seconds(b.gather.get(s.rank), profile), s.bytes) for s in b.senders]


def _engine_load(b: PlanSummary, profile: HardwareProfile, share: float = 1.0) -> float:
    rank = max(range(len(b.shard_bytes)), key=b.shard_bytes.__getitem__)
    return share * (b.shard_bytes[rank] / profile.device_copy + b.shard_tensors[rank] * profile.apply_tensor_s.value)


def miles_broadcast(plans: dict[str, PlanSummary], profile: HardwareProfile) -> Modelled:
    """Miles + SGLang NCCL broadcast: every PP stage's head rank all-gathers its stage (TP, then EP) and
    broadcasts each bucket to every engine rank in its own group; a bucket is gathered, sent and loaded
    before the next (no overlap inside a stage); every engine rank receives the whole model."""
    b = plans["broadcast"]
    nic = profile.nic_per_gpu
    per_stage = max(gather + nbytes / nic + _engine_load(b, profile, nbytes / b.model_bytes)
                    for _, gather, nbytes in _stage_heads(b, profile))
    receive = b.model_bytes / nic + _engine_load(b, profile)
    seconds = max(per_stage, receive) + profile.pause_resume_s.value
    bound = "a stage's gather + broadcast + load, bucket after bucket" if per_stage > receive else \
        "every engine rank receives the whole model through its NIC"
    return Modelled(seconds, bound, {"stage chain": per_stage, "receive all": receive})


def miles_p2p(plans: dict[str, PlanSummary], profile: HardwareProfile) -> Modelled:
    """Miles + SGLang RDMA P2P: every training rank all-gathers its stage, loads it into a CPU replica of
    one target engine rank's shard at a time and RDMA-writes it from host memory to that rank (targets of
    a stage spread round-robin over its ranks); the target applies (post-processing) at the end."""
    b = plans["broadcast"]
    fleet, trainer = b.fleet, b.trainer
    targets = -(-fleet.ranks // trainer.stage_ranks)  # engine ranks each training rank serves per stage
    worst = 0.0
    for _, gather, nbytes in _stage_heads(b, profile):
        shard = nbytes / fleet.tp  # this stage's part of one engine rank's shard
        per_target = shard / profile.host_copy.value + shard / min(profile.nic_per_gpu, profile.pcie.value)
        worst = max(worst, gather + targets * per_target)
    seconds = worst + _engine_load(b, profile) + profile.pause_resume_s.value
    return Modelled(seconds, "a training rank: all-gather, then CPU replica load + RDMA write per target",
                    {"source chain": worst})


def checkpoint_engine_broadcast(plans: dict[str, PlanSummary], profile: HardwareProfile) -> Modelled:
    """checkpoint-engine (colocated with vLLM): the checkpoint is spread over the GPUs' host memory; bucket
    by bucket its owner copies it to the GPU and it is broadcast to every rank of the update group (all
    GPUs of a node are in it, so NCCL drives every NIC of the node); each vLLM worker copies its shard
    out of the IPC buffer (its load_weights). Copy and broadcast are pipelined."""
    b = plans["broadcast"]
    fleet = b.fleet
    h2d = b.model_bytes / profile.pcie.value  # one owner per bucket, buckets in turn
    bcast_rate = profile.nvlink.value if fleet.nodes == 1 else profile.node_nic
    bcast = b.model_bytes / bcast_rate
    reload = _engine_load(b, profile)
    seconds = max(h2d, bcast, reload) + profile.pause_resume_s.value
    bound = max((("host-to-device copy of every bucket by its owner", h2d), ("broadcast", bcast),
                 ("vLLM reload", reload)), key=lambda kv: kv[1])[0]
    return Modelled(seconds, bound, {"h2d": h2d, "broadcast": bcast, "reload": reload})


def rdma_write(plans: dict[str, PlanSummary], profile: HardwareProfile) -> Modelled:
    """Perplexity: a static schedule of RDMA WRITEs, GPU to GPU; every training GPU rebuilds full tensors
    of its mesh (full_tensor), projects and quantizes on the GPU, and writes them straight into the
    inference GPUs; no host copy, no checksum. Sends are spread evenly over the training GPUs."""
    p = plans["p2p"]
    nic = profile.nic_per_gpu
    send = sum(s.bytes for s in p.senders) / p.trainer.world / nic
    receive = max(r.bytes for r in p.receivers) / nic
    # full_tensor of what a GPU sends: the bf16 sources (2x FP8 bytes) over the NIC, expert meshes span nodes
    rebuild = 2 * sum(s.bytes for s in p.senders) / p.trainer.world / p.fleet.engines / nic
    seconds = max(send, receive, rebuild) + 2 * profile.round_s.value
    bound = max((("sending GPU's NIC", send), ("receiving GPU's NIC", receive), ("full_tensor rebuild", rebuild)),
                key=lambda kv: kv[1])[0]
    return Modelled(seconds, bound, {"send": send, "receive": receive, "rebuild": rebuild})


def _ours(transport: str) -> Callable[[dict[str, PlanSummary], HardwareProfile], Modelled]:
    def model(plans: dict[str, PlanSummary], profile: HardwareProfile) -> Modelled:
        prediction = predict(plans[transport], profile, SyncOptions())
        return Modelled(prediction.seconds, prediction.bound)

    model.__doc__ = f"This library's {transport} transport on the same layouts (megatron_sync.scale.timing)."
    return model


VARIANTS: dict[str, Callable[[dict[str, PlanSummary], HardwareProfile], Modelled]] = {
    "miles-broadcast": miles_broadcast,
    "miles-p2p": miles_p2p,
    "checkpoint-engine-broadcast": checkpoint_engine_broadcast,
    "rdma-write": rdma_write,
    "ours-broadcast": _ours("broadcast"),
    "ours-p2p": _ours("p2p"),
}


def _miles(model: str, trainer: TrainerLayout, fleet: FleetLayout, nccl: float, rdma: float, note: str = "",
           overrides: dict | None = None) -> tuple[Published, Published]:
    overrides = overrides or {}
    return (Published("Miles+SGLang NCCL broadcast", model, overrides, trainer, fleet, "h100", nccl, LMSYS,
                      "miles-broadcast", True, note),
            Published("Miles+SGLang RDMA P2P (CPU replica)", model, overrides, trainer, fleet, "h100", rdma, LMSYS,
                      "miles-p2p", True, note))


def _ep(engines: int, tp: int) -> FleetLayout:
    return FleetLayout(engines=engines, tp=tp, expert_parallel=True)


ROWS: tuple[Published, ...] = (
    *_miles("moonlight-16b-a3b", TrainerLayout(tp=2, dp=4, ep=8), _ep(1, 8), 1.4820, 1.0733),
    *_miles("qwen3-30b-a3b", TrainerLayout(tp=4, dp=4, ep=8), _ep(2, 8), 2.6700, 2.1602),
    *_miles("glm-4.5-air", TrainerLayout(pp=4, dp=8, ep=8), _ep(4, 8), 5.0011, 2.6372,
            "GLM-4.5-Air with its draft (MTP) layer"),
    *_miles("qwen3-235b-a22b", TrainerLayout(tp=4, pp=4, cp=2, dp=2, ep=16), _ep(2, 32), 10.7536, 3.1620),
    *_miles("kimi-k2", TrainerLayout(tp=8, pp=8, cp=4, ep=32), _ep(8, 32), 53.2791, 7.2273,
            "FP8 with [64, 64] blocks, as published", FP8_64),
    Published("checkpoint-engine broadcast", "qwen3-235b-a22b", {}, TrainerLayout(dp=8), FleetLayout(engines=1, tp=8),
              "h800", 6.75, CKPT_ENGINE, "checkpoint-engine-broadcast", False,
              "colocated; 8xH800 TP8; vLLM reload assumed at the profile's per-tensor cost"),
    Published("checkpoint-engine broadcast", "glm-4.5-air", {}, TrainerLayout(dp=8), FleetLayout(engines=1, tp=8),
              "h800", 3.94, CKPT_ENGINE, "checkpoint-engine-broadcast", False,
              "colocated; 8xH800 TP8; GLM-4.5-Air with its draft (MTP) layer"),
    Published("checkpoint-engine broadcast", "kimi-k2", {}, TrainerLayout(dp=16), FleetLayout(engines=1, tp=16),
              "h20", 15.45, CKPT_ENGINE, "checkpoint-engine-broadcast", False, "colocated; 16xH20 TP16; FP8"),
    Published("checkpoint-engine broadcast", "kimi-k2", {}, TrainerLayout(dp=256), FleetLayout(engines=16, tp=16),
              "h20", 21.50, CKPT_ENGINE, "checkpoint-engine-broadcast", False, "colocated; 256xH20, 16 x TP16; FP8"),
    Published("checkpoint-engine broadcast", "deepseek-v3", {}, TrainerLayout(dp=256), FleetLayout(engines=16, tp=16),
              "h20", 13.88, CKPT_ENGINE, "checkpoint-engine-broadcast", False,
              "colocated; 256xH20, 16 x TP16; DeepSeek-V3.1 (same tensors as V3), FP8"),
    Published("Perplexity RDMA WRITE", "qwen3-235b-a22b", FP8_128, TrainerLayout(dp=128, ep=8),
              _ep(4, 8), "p5-efa", 2.0, PPLX_QWEN, "rdma-write", False,
              "FSDP trainer (modelled as its 128 GPUs); inference layout not published: assumed 4 engines of 8 "
              "GPUs (EP); FP8 inference"),
    Published("Perplexity RDMA WRITE", "kimi-k2", {}, TrainerLayout(dp=256, ep=32), _ep(8, 16),
              "p5-efa", 1.3, PPLX, "rdma-write", False,
              "FSDP trainer (modelled as its 256 GPUs); inference layout not published: assumed 8 engines of 16 "
              "GPUs (EP), the smallest H100 engine that holds Kimi-K2's 1 TB of FP8 weights (64 GB per GPU)"),
)


def planner_for(row: Published) -> ScalePlanner:
    family, config = row.hf_config()
    return ScalePlanner(family, config, row.trainer, row.fleet)


def compare(row: Published, planner: ScalePlanner | None = None, *, bucket_bytes: int = 1 << 30) -> dict:
    """Return the row's measurement beside its variant's prediction (and this library's transports)."""
    planner = planner or planner_for(row)
    profile = profile_named(row.profile)
    plans = {t: planner.plan(t, bucket_bytes=bucket_bytes) for t in ("broadcast", "p2p")}
    modelled = VARIANTS[row.variant](plans, profile)
    ours = {name: VARIANTS[name](plans, profile).seconds for name in ("ours-broadcast", "ours-p2p")}
    return {"row": row, "predicted": modelled.seconds, "bound": modelled.bound, "parts": modelled.parts,
            "error": (modelled.seconds - row.seconds) / row.seconds, "ours": ours,
            "plan_seconds": {t: p.seconds for t, p in plans.items()}}
