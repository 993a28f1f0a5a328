"""Qwen3-MoE: Qwen3 attention, routed experts (no shared experts), optional dense `mlp_only_layers`."""

from __future__ import annotations

from megatron_sync.convert.base import Family
from megatron_sync.convert.families.common import (
    DENSE_MLP_HF, DENSE_MLP_RULES, EMBEDDING_HF, EMBEDDING_RULES, GQA_HF, GQA_RULES,
    INPUT_NORM_RULES, NORM_HF, POST_ATTENTION_NORM_RULES, QK_NORM_HF, QK_NORM_RULES,
    ROUTED_EXPERT_RULES, TIED_OUTPUT_SKIP, routed_expert_hf,
)
from megatron_sync.convert.hf_config import HFConfig
from megatron_sync.convert.families.qwen3 import reject_attention_bias


def _validate(cfg: HFConfig) -> None:
    reject_attention_bias(cfg)
    cfg["num_experts"]  # required: config.json spells it num_experts, transformers num_local_experts


def is_moe_layer(cfg: HFConfig, layer: int) -> bool:
    """Return True if HF Qwen3-MoE builds a sparse MLP at `layer` (same test as modeling_qwen3_moe)."""
    return (
        layer not in (cfg.get("mlp_only_layers") or ())
        and cfg.get("num_experts", 0) > 0
        and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0
    )


QWEN3_MOE = Family(
    name="qwen3_moe",
    rules=EMBEDDING_RULES + INPUT_NORM_RULES + POST_ATTENTION_NORM_RULES + GQA_RULES
    + QK_NORM_RULES + DENSE_MLP_RULES + ROUTED_EXPERT_RULES,
    hf_tensors=EMBEDDING_HF + NORM_HF + GQA_HF + QK_NORM_HF + DENSE_MLP_HF
    + routed_expert_hf("num_experts"),
    skip=TIED_OUTPUT_SKIP,
    is_moe_layer=is_moe_layer,
    num_experts_key="num_experts",
    validate_config=_validate,
    layer_kind_keys=("num_experts", "decoder_sparse_step", "mlp_only_layers"),
)
