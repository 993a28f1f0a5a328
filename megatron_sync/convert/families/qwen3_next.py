"""Qwen3-Next: gated-delta-net linear-attention layers mixed with gated full-attention layers
(`layer_types`), many small routed experts plus a shared expert with a sigmoid gate.

Megatron builds it with `experimental_attention_variant="gated_delta_net"`,
`linear_attention_freq`, `attention_output_gate=True`, `qk_layernorm=True`, `rotary_percent`
= `partial_rotary_factor`, `moe_shared_expert_gate=True` and `layernorm_zero_centered_gamma=True`
(Qwen3-Next's RMSNorms compute x * (1 + weight), so their weights map as they are).

The linear-attention layer is megatron-core's `GatedDeltaNet` (`self_attention.*`): its
`in_proj` stacks q, k, v, z, beta, alpha over all heads, which Qwen3-Next's checkpoint groups
by key head into `in_proj_qkvz` and `in_proj_ba`; `conv1d` ([q; k; v] channels, depthwise),
`A_log`, `dt_bias` and `out_proj` map as they are. Its output norm is the one plain-gamma norm
of Qwen3-Next (`linear_attn.norm`, gated by z), while Megatron builds it from the same
zero-centered config: the checkpoint holds Megatron's weight + 1. With the TE spec the input
norm is fused into `in_proj` (`in_proj.layer_norm_weight`).

The full-attention `linear_qkv` holds a gate head after each group's query heads; Qwen3-Next's
q_proj holds each query head followed by its gate head. The MTP layers (`mtp.*`) are not mapped.
"""

from __future__ import annotations

from megatron_sync.convert.base import Family, HFTensor, Rule, Shard
from megatron_sync.convert.families.common import (
    DENSE_MLP_HF, DENSE_MLP_RULES, EMBEDDING_HF, EMBEDDING_RULES, H, INPUT_NORM_RULES, L, NORM_HF,
    POST_ATTENTION_NORM_RULES, QK_NORM_RULES, ROUTED_EXPERT_RULES, TIED_OUTPUT_SKIP, routed_expert_hf,
)
from megatron_sync.convert.errors import ConfigError
from megatron_sync.convert.hf_config import HFConfig
from megatron_sync.convert.layout import gamma, gate_up, gated_qkv, gdn_in_proj
from megatron_sync.convert.families.qwen3 import reject_attention_bias
from megatron_sync.convert.families.qwen3_moe import is_moe_layer

LINEAR, FULL = "linear_attention", "full_attention"


def layer_type(cfg: HFConfig, layer: int) -> str:
    """Return "linear_attention" or "full_attention" for `layer`: `layer_types`, else every
    `full_attention_interval`-th layer is full attention (as transformers derives it)."""
    types = cfg.get("layer_types")
    if types is not None:
        return types[layer]
    return FULL if (layer + 1) % cfg["full_attention_interval"] == 0 else LINEAR


def _validate(cfg: HFConfig) -> None:
    reject_attention_bias(cfg)
    cfg["num_experts"]  # required: the routed experts' count
    types = cfg.get("layer_types")
    if types is not None and (len(types) != cfg["num_hidden_layers"] or set(types) - {LINEAR, FULL}):
        raise ConfigError(
            f"family 'qwen3_next' needs layer_types of num_hidden_layers={cfg['num_hidden_layers']} entries, "
            f"each {LINEAR!r} or {FULL!r}; got {types}: fix layer_types in the HF config"
        )


_A = H + "self_attn."
_G = H + "linear_attn."
_S = H + "mlp.shared_expert."
_QKVZ = "2*linear_num_key_heads*linear_key_head_dim+2*linear_num_value_heads*linear_value_head_dim"
_CONV = "2*linear_num_key_heads*linear_key_head_dim+linear_num_value_heads*linear_value_head_dim"
_V = "linear_num_value_heads*linear_value_head_dim"

GATED_ATTENTION_RULES = (
    Rule(L + "self_attention.linear_qkv.weight", (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"),
         gated_qkv),
    Rule(L + "self_attention.linear_proj.weight", _A + "o_proj.weight"),
) + QK_NORM_RULES
GATED_ATTENTION_HF = (
    HFTensor(_A + "q_proj.weight", ("num_attention_heads*head_dim*2", "hidden_size"), Shard.COLUMN, layers=FULL),
    HFTensor(_A + "k_proj.weight", ("num_key_value_heads*head_dim", "hidden_size"), Shard.KV_HEADS, layers=FULL),
    HFTensor(_A + "v_proj.weight", ("num_key_value_heads*head_dim", "hidden_size"), Shard.KV_HEADS, layers=FULL),
    HFTensor(_A + "o_proj.weight", ("hidden_size", "num_attention_heads*head_dim"), Shard.ROW, layers=FULL),
    HFTensor(_A + "q_norm.weight", ("head_dim",), Shard.REPLICATED, layers=FULL),
    HFTensor(_A + "k_norm.weight", ("head_dim",), Shard.REPLICATED, layers=FULL),
)

LINEAR_ATTENTION_RULES = (
    Rule(L + "self_attention.in_proj.layer_norm_weight", H + "input_layernorm.weight"),  # TE
    Rule(L + "self_attention.in_proj.weight", (_G + "in_proj_qkvz.weight", _G + "in_proj_ba.weight"), gdn_in_proj),
    Rule(L + "self_attention.conv1d.weight", _G + "conv1d.weight"),
    Rule(L + "self_attention.A_log", _G + "A_log"),
    Rule(L + "self_attention.dt_bias", _G + "dt_bias"),
    Rule(L + "self_attention.out_norm.weight", _G + "norm.weight", gamma),
    Rule(L + "self_attention.out_proj.weight", _G + "out_proj.weight"),
)
LINEAR_ATTENTION_HF = (
    # Both projections are grouped by key head: equal row chunks are whole key-head groups.
    HFTensor(_G + "in_proj_qkvz.weight", (_QKVZ, "hidden_size"), Shard.COLUMN, layers=LINEAR),
    HFTensor(_G + "in_proj_ba.weight", ("2*linear_num_value_heads", "hidden_size"), Shard.COLUMN, layers=LINEAR),
    # The conv channels are [q; k; v] over all heads: an engine cuts each of the three apart (no equal-chunk
    # role says that), so it travels whole.
    HFTensor(_G + "conv1d.weight", (_CONV, "1", "linear_conv_kernel_dim"), Shard.REPLICATED, layers=LINEAR),
    HFTensor(_G + "A_log", ("linear_num_value_heads",), Shard.COLUMN, layers=LINEAR),
    HFTensor(_G + "dt_bias", ("linear_num_value_heads",), Shard.COLUMN, layers=LINEAR),
    HFTensor(_G + "norm.weight", ("linear_value_head_dim",), Shard.REPLICATED, layers=LINEAR),
    HFTensor(_G + "out_proj.weight", ("hidden_size", _V), Shard.ROW, layers=LINEAR),
)

SHARED_EXPERT_RULES = (
    Rule(L + "mlp.shared_experts.linear_fc1.weight", (_S + "gate_proj.weight", _S + "up_proj.weight"), gate_up),
    Rule(L + "mlp.shared_experts.linear_fc2.weight", _S + "down_proj.weight"),
    Rule(L + "mlp.shared_experts.gate_weight", H + "mlp.shared_expert_gate.weight"),
)
SHARED_EXPERT_HF = (
    HFTensor(_S + "gate_proj.weight", ("shared_expert_intermediate_size", "hidden_size"), Shard.COLUMN, layers="moe"),
    HFTensor(_S + "up_proj.weight", ("shared_expert_intermediate_size", "hidden_size"), Shard.COLUMN, layers="moe"),
    HFTensor(_S + "down_proj.weight", ("hidden_size", "shared_expert_intermediate_size"), Shard.ROW, layers="moe"),
    HFTensor(H + "mlp.shared_expert_gate.weight", ("1", "hidden_size"), Shard.REPLICATED, layers="moe"),
)

QWEN3_NEXT = Family(
    name="qwen3_next",
    rules=EMBEDDING_RULES + INPUT_NORM_RULES + POST_ATTENTION_NORM_RULES + GATED_ATTENTION_RULES
    + LINEAR_ATTENTION_RULES + DENSE_MLP_RULES + ROUTED_EXPERT_RULES + SHARED_EXPERT_RULES,
    hf_tensors=EMBEDDING_HF + NORM_HF + GATED_ATTENTION_HF + LINEAR_ATTENTION_HF + DENSE_MLP_HF
    + routed_expert_hf("num_experts") + SHARED_EXPERT_HF,
    skip=TIED_OUTPUT_SKIP,
    is_moe_layer=is_moe_layer,
    num_experts_key="num_experts",
    validate_config=_validate,
    layer_kind_keys=("layer_types", "full_attention_interval", "num_experts", "decoder_sparse_step",
                     "mlp_only_layers"),
    layer_kinds=((LINEAR, lambda cfg, layer: layer_type(cfg, layer) == LINEAR),
                 (FULL, lambda cfg, layer: layer_type(cfg, layer) == FULL)),
)
