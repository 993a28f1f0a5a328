"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`): grouped-query attention with q/k/v biases and optional
per-head QK norm, dense first layers, routed + shared experts behind a sigmoid router with a
score-correction bias, and multi-token-prediction draft layers.

Partial rotary (`partial_rotary_factor`, Megatron's `rotary_percent`) changes no tensor: it only
says how much of each head RoPE rotates. The router and its correction bias stay float32 (vLLM
builds GLM's gate in float32). Whether the projections carry biases (`attention_bias`) and whether
queries and keys are normalized per head (`use_qk_norm`) are read from the config; a Megatron
tensor the config does not call for is refused by name.
"""

from __future__ import annotations

import dataclasses

from megatron_sync.convert.base import Family
from megatron_sync.convert.families.common import (
    DENSE_MLP_HF, DENSE_MLP_RULES, EMBEDDING_HF, EMBEDDING_RULES, EXPERT_RULES, GQA_HF, GQA_RULES,
    INPUT_NORM_RULES, NORM_HF, POST_ATTENTION_NORM_RULES, QK_NORM_HF, QK_NORM_RULES, QKV_BIAS_HF,
    QKV_BIAS_RULES, TIED_OUTPUT_SKIP, routed_expert_hf,
)
from megatron_sync.convert.families.deepseek_v3 import FP32_ROUTER_RULES, MOE_EXTRA_HF, MOE_EXTRA_RULES, ROUTER_BIAS
from megatron_sync.convert.hf_config import HFConfig
from megatron_sync.convert.families.mtp import DRAFT_HF, DRAFT_LAYERS_KEY, DRAFT_SKIP, draft_buffers, draft_rules


def _attention_bias(cfg: HFConfig) -> bool:
    """attention_bias=true: the q/k/v projections carry biases"""
    return bool(cfg.get("attention_bias"))


def _qk_norm(cfg: HFConfig) -> bool:
    """use_qk_norm=true: queries and keys get a per-head RMSNorm"""
    return bool(cfg.get("use_qk_norm"))


def is_moe_layer(cfg: HFConfig, layer: int) -> bool:
    """Return True if HF GLM-4.5 builds a MoE MLP at `layer` (every layer from `first_k_dense_replace` on)."""
    return bool(cfg.get("n_routed_experts")) and layer >= cfg["first_k_dense_replace"]


def _validate(cfg: HFConfig) -> None:
    for key in ("n_routed_experts", "moe_intermediate_size", "first_k_dense_replace"):
        cfg[key]  # raises ConfigError naming the missing key


_DECODER_RULES = (INPUT_NORM_RULES + POST_ATTENTION_NORM_RULES + GQA_RULES + QKV_BIAS_RULES + QK_NORM_RULES
                  + DENSE_MLP_RULES + FP32_ROUTER_RULES + EXPERT_RULES + MOE_EXTRA_RULES)

GLM4_MOE = Family(
    name="glm4_moe",
    rules=EMBEDDING_RULES + _DECODER_RULES + draft_rules(_DECODER_RULES),
    hf_tensors=EMBEDDING_HF + NORM_HF + GQA_HF
    + tuple(dataclasses.replace(row, when=_attention_bias) for row in QKV_BIAS_HF)
    + tuple(dataclasses.replace(row, when=_qk_norm) for row in QK_NORM_HF)
    + DENSE_MLP_HF + routed_expert_hf("n_routed_experts") + MOE_EXTRA_HF + DRAFT_HF,
    skip=TIED_OUTPUT_SKIP + DRAFT_SKIP,
    buffers=(ROUTER_BIAS,) + draft_buffers((ROUTER_BIAS,)),
    is_moe_layer=is_moe_layer,
    num_experts_key="n_routed_experts",
    validate_config=_validate,
    layer_kind_keys=("n_routed_experts", "first_k_dense_replace"),
    draft_layers_key=DRAFT_LAYERS_KEY,
)
