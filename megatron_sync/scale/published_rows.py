"""The published rows: every figure with its source, the date read, the setup as stated, what is guessed.

Calibration rows were used to write their variant or fit a constant (`variants.FITTED`); they cannot
test the model. Check rows were added after the model was frozen (see `published.py`).

A guessed inference layout follows one rule, fixed before any check was predicted (`smallest_engine`):
the smallest power-of-two tensor-parallel engine (expert parallel for MoE models) whose per-GPU shard is
at most half the GPU's memory.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.models import converter_for, model_named
from megatron_sync.scale.variants import Setting

GIB = 1 << 30
READ = "2026-12-05"
MILES = ("https://github.com/radixark/miles/blob/31f1ca961a94cb860cec3b2dea34ec332bfa8f76/"
         "docs/advanced/p2p-weight-transfer.md")
MILES_SETUP = ("H100-80GB clusters, 1 GB transfer bucket; timed after pause_generation returns and before "
               "update_weight exits; steps 3-12 averaged")
CKPT = ("https://github.com/MoonshotAI/checkpoint-engine/blob/59a3c4ffa2e14c0c26e81f62642e2d3ed68253ab/"
        "README.md#benchmark")
CKPT_SETUP = ("examples/update.py, vLLM v0.10.2rc1, ParameterServer colocated with vLLM; 'a 256-GPU TP16 setup "
              "means 16 vLLM instances, each TP16'; bucket size as in the table; GPUs bound to their NUMA node")
PPLX = ("https://research.perplexity.ai/articles/weight-transfer-for-rl-post-training-in-under-2-seconds and "
        "https://le.qun.ch/en/blog/2025/09/17/rl-weight-transfer-2")
FP8_64 = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [64, 64]}}
GPU_MEMORY_GB = {"h100": 80, "h200": 141, "h800": 80, "h20": 96, "p5-efa": 80}


@dataclass(frozen=True)
class Published:
    """One published sync: what ran, where, how long it took, and how the model treats it."""

    key: str
    system: str
    model: str
    trainer: TrainerLayout
    fleet: FleetLayout
    profile: str
    seconds: Optional[float]  # None: a check whose measured value is not recorded yet
    source: str
    read: str  # the date the source was read
    setup: str  # as the source states it
    guessed: tuple[str, ...]
    variant: str
    role: str  # "calibration" | "check"
    seen: str = "-"  # checks: "blind" (masked while read) or "seen" (in view, not used)
    setting: Setting = field(default_factory=Setting)
    overrides: dict = field(default_factory=dict)
    draft: bool = True

    def hf_config(self) -> tuple[str, dict]:
        family, config = model_named(self.model)
        config = copy.deepcopy(config)
        for key, value in self.overrides.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = copy.deepcopy(value)
        return family, config


def smallest_engine(model: str, profile: str, overrides: dict | None = None) -> int:
    """Return the guessed engine size (see the module doc): the smallest power-of-two TP whose shard of the
    model's bytes fits in half of a GPU of `profile`."""
    family, config = model_named(model)
    config = {**config, **(overrides or {})}
    nbytes = sum(s.nbytes for s in converter_for(family, config).tensor_specs())
    tp = 1
    while nbytes / tp > GPU_MEMORY_GB[profile] * 1e9 / 2:
        tp *= 2
    return tp


def _miles(model: str, trainer: TrainerLayout, fleet: FleetLayout, nccl: float, rdma: float, *, stated: str,
           guessed: tuple[str, ...] = (), overrides: dict | None = None, post_s: float = 0.0) -> tuple:
    setup = f"{MILES_SETUP}; {stated}"
    common = dict(model=model, trainer=trainer, fleet=fleet, profile="h100", source=MILES, read=READ, setup=setup,
                  guessed=guessed + ("NICs: 8 x 400 Gb/s per node (the docs say InfiniBand H100 clusters)",),
                  role="calibration", overrides=overrides or {})
    slug = model.split("-")[0] + "-" + model.split("-")[1]
    return (Published(f"miles-nccl/{slug}", "Miles+SGLang NCCL broadcast", seconds=nccl, variant="miles-broadcast",
                      **common),
            Published(f"miles-rdma/{slug}", "Miles+SGLang RDMA P2P (CPU replica)", seconds=rdma, variant="miles-p2p",
                      setting=Setting(post_s=post_s), **common))


def _ckpt(key: str, model: str, gpus: int, tp: int, profile: str, seconds: float | None, bucket_gib: float, *,
          p2p: bool, role: str, seen: str = "-") -> Published:
    updated = tp if p2p else gpus
    fleet = FleetLayout(engines=updated // tp, tp=tp, colocated=True)
    how = ("P2P: ParameterServer.update(ranks=range(0, TP)), 'no more than two nodes (16 GPUs) out of the "
           "entire cluster'" if p2p else "broadcast to every rank")
    return Published(key, f"checkpoint-engine {'P2P' if p2p else 'broadcast'}", model, TrainerLayout(dp=gpus), fleet,
                     profile, seconds, CKPT, READ, f"{CKPT_SETUP}; {gpus}x{profile.upper()} TP{tp}; {how}",
                     ("NICs: 8 x 400 Gb/s per node (not stated)", "the checkpoint in every rank's host memory, "
                      "split evenly (examples/update.py splits the files)"),
                     "checkpoint-engine", role, seen,
                     Setting(bucket_bytes=int(bucket_gib * GIB), extra={"p2p": p2p}))


CALIBRATION = (
    *_miles("qwen3-30b-a3b", TrainerLayout(tp=4, dp=4, ep=8), FleetLayout(engines=2, tp=8, expert_parallel=True),
            2.6700, 2.1602, stated="train TP=4 PP=1 CP=1 EP=8 ETP=1, 2 nodes; inference TP=8 EP=8, 2 nodes"),
    *_miles("glm-4.5-air", TrainerLayout(pp=4, dp=8, ep=8), FleetLayout(engines=4, tp=8, expert_parallel=True),
            5.0011, 2.6372, stated="train TP=1 PP=4 CP=1 EP=8 ETP=1, 4 nodes; inference TP=8 EP=8, 4 nodes",
            guessed=("the engines hold the draft (MTP) layer",)),
    *_miles("qwen3-235b-a22b", TrainerLayout(tp=4, pp=4, cp=2, dp=2, ep=16),
            FleetLayout(engines=2, tp=32, expert_parallel=True), 10.7536, 3.1620,
            stated="train TP=4 PP=4 CP=2 EP=16 ETP=1, 8 nodes; inference TP=32 EP=32, 8 nodes"),
    *_miles("kimi-k2", TrainerLayout(tp=8, pp=8, cp=4, ep=32), FleetLayout(engines=8, tp=32, expert_parallel=True),
            53.2791, 7.2273, overrides=FP8_64, post_s=0.884,
            stated="train TP=8 PP=8 CP=4 EP=32 ETP=1, 32 nodes; inference TP=32 EP=32, 32 nodes; FP8 re-quantized "
                   "to [64, 64] blocks; the RDMA time includes ~884 ms post_load_weights"),
    _ckpt("ckpt-bcast/glm-4.5-air-8", "glm-4.5-air", 8, 8, "h800", 3.47, 3.02, p2p=False, role="calibration"),
    _ckpt("ckpt-bcast/qwen3-235b-8", "qwen3-235b-a22b", 8, 8, "h800", 6.22, 2.67, p2p=False, role="calibration"),
    _ckpt("ckpt-bcast/deepseek-v3.1-16", "deepseek-v3", 16, 16, "h20", 10.19, 5.39, p2p=False, role="calibration"),
    _ckpt("ckpt-bcast/kimi-k2-16", "kimi-k2", 16, 16, "h20", 14.36, 5.89, p2p=False, role="calibration"),
    _ckpt("ckpt-bcast/deepseek-v3.1-256", "deepseek-v3", 256, 16, "h20", 11.33, 8.00, p2p=False, role="calibration"),
    _ckpt("ckpt-bcast/kimi-k2-256", "kimi-k2", 256, 16, "h20", 16.04, 8.00, p2p=False, role="calibration"),
    Published("pplx/kimi-k2", "Perplexity RDMA WRITE", "kimi-k2", TrainerLayout(dp=256, ep=32),
              FleetLayout(engines=4, tp=32, expert_parallel=True), "p5-efa", 1.3, PPLX, READ,
              "Kimi-K2 (1T), 256 training GPUs (BF16, FSDP: non-MoE sharded over NVLink, MoE across nodes) to 128 "
              "inference GPUs (FP8), 'less than 1.3 seconds'; RDMA WRITE from GPU to GPU, static schedule",
              ("hardware: AWS p5 (H100, EFA) as their earlier post", "FSDP modelled as Megatron DP=256 EP=32",
               "inference layout by the rule: 4 engines of TP=32 with EP (the smallest whose shard fits half of "
               "80 GB)", "FP8 in [64, 64] blocks (the published [128, 128] do not divide TP=32; Miles' choice)"),
              "rdma-write", "calibration", overrides=FP8_64),
)

VERL = "https://github.com/volcengine/verl/blob/b178a3cd56f58b2d502255daba591e92833930a7/"
VERL_CKPT = VERL + "verl/checkpoint_engine/README.md#benchmark"
VERL_ASYNC = VERL + "docs/advance/fully_async.md#checkpoint-engine-ablation-experiment"
NEMO = ("https://github.com/NVIDIA-NeMo/RL/blob/7ea279abfbeb698b092856d0dab61e7cf39bc909/"
        "docs/guides/checkpoint-engine-refit.md#deepseek-v3-benchmark")
BF16 = {"quantization_config": None}


def _verl_ckpt(key: str, variant: str, backend: str, seconds: float) -> Published:
    return Published(
        key, f"verl checkpoint engine ({backend})", "qwen3-30b-a3b", TrainerLayout(dp=2), FleetLayout(engines=30, tp=1),
        "h100", seconds, VERL_CKPT, READ,
        f"model Qwen/Qwen3-30B-A3B-Base; trainer: fsdp world_size=2; rollout: num_rollout=30 (only receive weight "
        f"without cuda ipc to vllm/sglang); 4*8 H100, ConnectX-7 400 Gbps (InfiniBand); backend {backend}",
        ("bucket: the default update_weights_bucket_megabytes (2048)", "the 30 rollout workers on the GPUs after "
         "the trainer's two", "Qwen3-30B-A3B-Base has Qwen3-30B-A3B's tensors"), variant, "check", "blind",
        Setting(bucket_bytes=2048 << 20))


def _verl_async(key: str, model: str, trainer: TrainerLayout, fleet: FleetLayout, bucketed: bool, ranks: int,
                guessed: tuple[str, ...], seconds: float) -> Published:
    return Published(
        key, f"verl fully_async {'checkpoint engine' if bucketed else 'per-tensor'} sync", model, trainer, fleet,
        "h20", seconds, VERL_ASYNC, READ,
        f"'single-step parameter synchronization time of the checkpoint-engine', default checkpoint-engine "
        f"configuration, H20 machines, Megatron for training; trainer rank {ranks}, rollout rank {ranks}, "
        f"checkpoint-engine {bucketed}",
        guessed + ("vLLM rollout (verl uses its checkpoint engine only for vLLM)", "8 x 400 Gb/s NICs per H20 node",
                   "bucket: the default device_buffer_size_M (4096)"),
        "verl-async", "check", "blind", Setting(bucket_bytes=4096 << 20, extra={"bucketed": bucketed}))


def _nemo(key: str, variant: str, bucket: int, extra: dict, seconds: float) -> Published:
    return Published(
        key, f"NeMo-RL {'NIXL checkpoint engine' if variant == 'nemo-nixl' else 'NCCL collective'} refit",
        "deepseek-v3", TrainerLayout(pp=16, dp=16, ep=16), FleetLayout(engines=1, tp=32), "h100", seconds, NEMO, READ,
        "DeepSeek-V3 BF16; 36 eight-GPU nodes: 32 policy nodes with Megatron TP1/PP16/EP16 and four rollout nodes "
        "with vLLM TP32/PP1/EP1; NIXL: CUDA buffers, UCX over eight RDMA rails, a 4096 MiB bucket, "
        "shard_expert_weights: true; each vLLM rank loaded 45,395 destination-local tensors, 69.95 GiB; "
        "'dedicated async refit timer'",
        ("H100 GPUs with 8 x 400 Gb/s NICs (the section names eight RDMA rails, not the GPU)",
         "the engines serve no draft (MTP) layer", "NCCL: NeMo-RL's default packed buffer, 2% of 80 GB"),
        variant, "check", "blind", Setting(bucket_bytes=bucket, extra=extra), overrides=BF16, draft=False)


CHECKS = (
    _ckpt("ckpt-p2p/glm-4.5-air-8", "glm-4.5-air", 8, 8, "h800", 4.12, 3.02, p2p=True, role="check", seen="seen"),
    _ckpt("ckpt-p2p/qwen3-235b-8", "qwen3-235b-a22b", 8, 8, "h800", 7.10, 2.68, p2p=True, role="check", seen="seen"),
    _ckpt("ckpt-p2p/deepseek-v3.1-16", "deepseek-v3", 16, 16, "h20", 11.80, 5.41, p2p=True, role="check", seen="seen"),
    _ckpt("ckpt-p2p/kimi-k2-16", "kimi-k2", 16, 16, "h20", 17.49, 5.91, p2p=True, role="check", seen="seen"),
    _ckpt("ckpt-p2p/deepseek-v3.1-256", "deepseek-v3", 256, 16, "h20", 11.81, 8.00, p2p=True, role="check",
          seen="seen"),
    _ckpt("ckpt-p2p/kimi-k2-256", "kimi-k2", 256, 16, "h20", 16.75, 8.00, p2p=True, role="check", seen="seen"),
    _verl_ckpt("verl-ckpt/nccl", "verl-nccl", "NCCL: all_gather + broadcast", 7.0),  # "~7"
    _verl_ckpt("verl-ckpt/nixl", "verl-nixl-ring", "NIXL: all_gather + ring p2p", 7.0),  # "~7"
    *(_verl_async(f"verl-async/qwen2.5-math-7b-{'ckpt' if b else 'tensor'}", "qwen2.5-math-7b",
                  TrainerLayout(tp=2, dp=2), FleetLayout(engines=4, tp=1), b, 4,
                  ("trainer TP=2 and rollout TP=1 from verl's 7B Megatron script "
                   "(shell/geo3k_qwen25vl_7b_megatron_4_4.sh)",
                   "Qwen2.5-Math-7B has Qwen2.5-7B's tensors", "the 8 GPUs on one node"), {False: 0.12, True: 0.02}[b])
      for b in (False, True)),
    *(_verl_async(f"verl-async/qwen3-30b-{'ckpt' if b else 'tensor'}", "qwen3-30b-a3b",
                  TrainerLayout(tp=2, dp=8, ep=8), FleetLayout(engines=4, tp=4), b, 16,
                  ("trainer TP=2 EP=8 and rollout TP=4 from verl's shell/grpo_30b_a3b_base_math_megatron_96_32.sh",),
                  {False: 15.76, True: 4.38}[b])
      for b in (False, True)),
    *(_verl_async(f"verl-async/qwen3-235b-{'ckpt' if b else 'tensor'}", "qwen3-235b-a22b",
                  TrainerLayout(tp=4, pp=4, cp=2, dp=2, ep=16), FleetLayout(engines=4, tp=16, expert_parallel=True),
                  b, 64, ("trainer: Miles' 64-GPU layout for this model (TP=4 PP=4 CP=2 EP=16)",
                          "rollout by the rule: engines of TP=16 with EP (the smallest whose shard fits half "
                          "of 96 GB)"),
                  {False: 58.57, True: 23.70}[b])
      for b in (False, True)),
    _nemo("nemo/deepseek-v3-nixl", "nemo-nixl", 4096 << 20, {"tensors_per_rank": 45395}, 9.25),
    _nemo("nemo/deepseek-v3-nccl", "nemo-nccl", int(0.02 * 80e9), {}, 14.21),
)

ROWS: tuple[Published, ...] = CALIBRATION + CHECKS
