"""DeepSeek-V3: Multi-Latent Attention, dense first-k layers, routed + shared experts, biased router.

MLA names follow megatron-core 0.16.1 `MLASelfAttention`: with the TE spec the
q/kv latent norms are fused into `linear_q_up_proj` / `linear_kv_up_proj`
(`.layer_norm_weight`); with the local spec they are separate `q_layernorm` /
`kv_layernorm` modules. Without `q_lora_rank` the query is one `linear_q_proj`.
The multi-token-prediction block (`mtp.layers.{d}`) becomes the draft layer
`model.layers.{num_hidden_layers + d}` (megatron_sync.convert/mtp.py).

Kimi-K2 is this architecture at 384 experts: its config.json says `"model_type": "kimi_k2"`
(architecture `DeepseekV3ForCausalLM`), so the family converts that model type too.
"""

from __future__ import annotations

import torch

from megatron_sync.convert.base import Family, HFTensor, Rule, Shard
from megatron_sync.convert.families.common import (
    DENSE_MLP_HF, DENSE_MLP_RULES, EMBEDDING_HF, EMBEDDING_RULES, H, L, NORM_HF,
    POST_ATTENTION_NORM_RULES, EXPERT_RULES, TIED_OUTPUT_SKIP, routed_expert_hf,
)
from megatron_sync.convert.errors import ConfigError
from megatron_sync.convert.hf_config import HFConfig
from megatron_sync.convert.layout import gate_up
from megatron_sync.convert.families.mtp import DRAFT_HF, DRAFT_LAYERS_KEY, DRAFT_SKIP, draft_buffers, draft_rules


def _has_q_lora(cfg: HFConfig) -> bool:
    return cfg.get("q_lora_rank") is not None


def _no_q_lora(cfg: HFConfig) -> bool:
    return cfg.get("q_lora_rank") is None


def _has_shared_experts(cfg: HFConfig) -> bool:
    return bool(cfg.get("n_shared_experts"))


def is_moe_layer(cfg: HFConfig, layer: int) -> bool:
    """Return True if `layer` has routed experts: past `first_k_dense_replace`, every `moe_layer_freq`-th."""
    return (
        bool(cfg.get("n_routed_experts"))
        and layer >= cfg.get("first_k_dense_replace", 0)
        and layer % cfg.get("moe_layer_freq", 1) == 0
    )


def _validate(cfg: HFConfig) -> None:
    if cfg.get("attention_bias"):
        raise ConfigError("family 'deepseek_v3' has no rules for attention_bias=true; set it to false")
    for key in ("n_routed_experts", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        cfg[key]  # raises ConfigError naming the missing key


_A = H + "self_attn."
_S = H + "mlp.shared_experts."
_QK = "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)"

MLA_RULES = (
    Rule(L + "input_layernorm.weight", H + "input_layernorm.weight"),
    Rule(L + "self_attention.linear_q_down_proj.weight", _A + "q_a_proj.weight"),
    Rule(L + "self_attention.linear_q_up_proj.layer_norm_weight", _A + "q_a_layernorm.weight"),  # TE
    Rule(L + "self_attention.q_layernorm.weight", _A + "q_a_layernorm.weight"),  # local spec
    Rule(L + "self_attention.linear_q_up_proj.weight", _A + "q_b_proj.weight"),
    Rule(L + "self_attention.linear_q_proj.weight", _A + "q_proj.weight"),  # q_lora_rank null
    Rule(L + "self_attention.linear_kv_down_proj.weight", _A + "kv_a_proj_with_mqa.weight"),
    Rule(L + "self_attention.linear_kv_up_proj.layer_norm_weight", _A + "kv_a_layernorm.weight"),  # TE
    Rule(L + "self_attention.kv_layernorm.weight", _A + "kv_a_layernorm.weight"),  # local spec
    Rule(L + "self_attention.linear_kv_up_proj.weight", _A + "kv_b_proj.weight"),
    Rule(L + "self_attention.linear_proj.weight", _A + "o_proj.weight"),
)
MLA_HF = (
    HFTensor(_A + "q_a_proj.weight", ("q_lora_rank", "hidden_size"), Shard.REPLICATED, when=_has_q_lora),
    HFTensor(_A + "q_a_layernorm.weight", ("q_lora_rank",), Shard.REPLICATED, when=_has_q_lora),
    HFTensor(_A + "q_b_proj.weight", (_QK, "q_lora_rank"), Shard.COLUMN, when=_has_q_lora),
    HFTensor(_A + "q_proj.weight", (_QK, "hidden_size"), Shard.COLUMN, when=_no_q_lora),
    HFTensor(_A + "kv_a_proj_with_mqa.weight", ("kv_lora_rank+qk_rope_head_dim", "hidden_size"), Shard.REPLICATED),
    HFTensor(_A + "kv_a_layernorm.weight", ("kv_lora_rank",), Shard.REPLICATED),
    HFTensor(_A + "kv_b_proj.weight",
             ("num_attention_heads*(qk_nope_head_dim+v_head_dim)", "kv_lora_rank"), Shard.COLUMN),
    HFTensor(_A + "o_proj.weight", ("hidden_size", "num_attention_heads*v_head_dim"), Shard.ROW),
)

# DeepSeek-V3 routes in fp32: the gate and its score-correction bias stay float32 whatever the
# model dtype (transformers keeps them fp32; a bf16 gate flips near-tie top-k choices).
FP32_ROUTER_RULES = (Rule(L + "mlp.router.weight", H + "mlp.gate.weight", dtype=torch.float32),)
ROUTER_BIAS = L + "mlp.router.expert_bias"
MOE_EXTRA_RULES = (
    Rule(ROUTER_BIAS, H + "mlp.gate.e_score_correction_bias", dtype=torch.float32),
    Rule(L + "mlp.shared_experts.linear_fc1.weight",
         (_S + "gate_proj.weight", _S + "up_proj.weight"), gate_up),
    Rule(L + "mlp.shared_experts.linear_fc2.weight", _S + "down_proj.weight"),
)
_SHARED_F = "moe_intermediate_size*n_shared_experts"
MOE_EXTRA_HF = (
    HFTensor(H + "mlp.gate.e_score_correction_bias", ("n_routed_experts",), Shard.REPLICATED, layers="moe"),
    HFTensor(_S + "gate_proj.weight", (_SHARED_F, "hidden_size"), Shard.COLUMN, layers="moe", when=_has_shared_experts),
    HFTensor(_S + "up_proj.weight", (_SHARED_F, "hidden_size"), Shard.COLUMN, layers="moe", when=_has_shared_experts),
    HFTensor(_S + "down_proj.weight", ("hidden_size", _SHARED_F), Shard.ROW, layers="moe", when=_has_shared_experts),
)

_DECODER_RULES = (MLA_RULES + POST_ATTENTION_NORM_RULES + DENSE_MLP_RULES + FP32_ROUTER_RULES + EXPERT_RULES
                  + MOE_EXTRA_RULES)

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    rules=EMBEDDING_RULES + _DECODER_RULES + draft_rules(_DECODER_RULES),
    hf_tensors=EMBEDDING_HF + NORM_HF + MLA_HF + DENSE_MLP_HF + routed_expert_hf("n_routed_experts")
    + MOE_EXTRA_HF + DRAFT_HF,
    skip=TIED_OUTPUT_SKIP + DRAFT_SKIP,
    buffers=(ROUTER_BIAS,) + draft_buffers((ROUTER_BIAS,)),
    is_moe_layer=is_moe_layer,
    num_experts_key="n_routed_experts",
    validate_config=_validate,
    layer_kind_keys=("n_routed_experts", "first_k_dense_replace", "moe_layer_freq"),
    # SGLang fuses q_a_proj and kv_a_proj_with_mqa (and their FP8 scales) into one projection only
    # when both arrive in the same load_weights call: they travel in one bucket.
    keep_together=(
        (_A + "q_a_proj.weight", _A + "kv_a_proj_with_mqa.weight"),
        (_A + "q_a_proj.weight_scale_inv", _A + "kv_a_proj_with_mqa.weight_scale_inv"),
    ),
    hf_model_types=("deepseek_v3", "kimi_k2"),
    draft_layers_key=DRAFT_LAYERS_KEY,
)
