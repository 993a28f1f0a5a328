"""gpt-oss: GQA with q/k/v/o biases and learnable attention sinks, every layer a biased MoE with a
clamped SwiGLU and a biased router.

Megatron builds it with `add_bias_linear=True`, `softmax_type="learnable"` (the sinks are
`self_attention.core_attention.softmax_offset`, one per head), `window_size` /
`window_attn_skip_freq` for the sliding-window layers (no tensors of their own),
`activation_func=quick_gelu`, `glu_linear_offset=1.0`, `activation_func_clamp_value=swiglu_limit`,
and a softmax router with a bias (`mlp.router.bias`, top-k first). megatron-core 0.16.1 supports
expert biases only with expert TP 1.

Experts leave per expert, in the layout of gpt-oss's checkpoint for one expert: `gate_up_proj`
[hidden, 2*intermediate] with gate and up rows interleaved and transposed (gpt-oss computes
x @ W), `gate_up_proj_bias` interleaved alike, `down_proj` [intermediate, hidden],
`down_proj_bias`. The released checkpoint stacks these over experts
(`mlp.experts.gate_up_proj` [E, hidden, 2*intermediate]); per-expert names are what lets a sync
send each engine rank only its experts, and vLLM's gpt_oss loader takes them one expert at a time
(`experts.{e}.gate_up_proj` -> its streamed-expert path). transformers has no per-expert
spelling: to load into it, stack them (`torch.stack` over e, the only difference).
MXFP4 expert output is not offered: see the README.
"""

from __future__ import annotations

from megatron_sync.convert.base import Family, HFTensor, Rule, Shard
from megatron_sync.convert.families.common import (
    EMBEDDING_HF, EMBEDDING_RULES, GQA_HF, GQA_RULES, H, INPUT_NORM_RULES, L, NORM_HF,
    POST_ATTENTION_NORM_RULES, QKV_BIAS_HF, QKV_BIAS_RULES, TIED_OUTPUT_SKIP,
)
from megatron_sync.convert.errors import ConfigError
from megatron_sync.convert.hf_config import HFConfig
from megatron_sync.convert.layout import interleaved_gate_up, interleaved_gate_up_transposed, transposed


def is_moe_layer(cfg: HFConfig, layer: int) -> bool:
    """Return True: every gpt-oss layer is a mixture of experts."""
    return cfg.get("num_local_experts", 0) > 0


def _validate(cfg: HFConfig) -> None:
    if cfg.get("attention_bias") is False:
        raise ConfigError(
            "family 'gpt_oss' maps the q/k/v/o biases gpt-oss checkpoints hold; attention_bias=false "
            "calls for none: set attention_bias to true (and add_bias_linear in the Megatron model)"
        )
    cfg["num_local_experts"]  # raises ConfigError naming it


_A = H + "self_attn."
_X = H + "mlp.experts.{expert}."
_SEQ = L + "mlp.experts.local_experts.{expert}."  # SequentialMLP
_GROUPED = L + "mlp.experts."  # TEGroupedMLP: linear_fc1.weight{expert}

ATTENTION_RULES = GQA_RULES + QKV_BIAS_RULES + (
    Rule(L + "self_attention.linear_proj.bias", _A + "o_proj.bias"),
    Rule(L + "self_attention.core_attention.softmax_offset", _A + "sinks"),
)
ATTENTION_HF = GQA_HF + QKV_BIAS_HF + (
    HFTensor(_A + "o_proj.bias", ("hidden_size",), Shard.REPLICATED),
    HFTensor(_A + "sinks", ("num_attention_heads",), Shard.COLUMN),
)

MOE_RULES = (
    Rule(L + "mlp.router.weight", H + "mlp.router.weight"),
    Rule(L + "mlp.router.bias", H + "mlp.router.bias"),
    Rule(_SEQ + "linear_fc1.weight", _X + "gate_up_proj", interleaved_gate_up_transposed),  # SequentialMLP
    Rule(_SEQ + "linear_fc1.bias", _X + "gate_up_proj_bias", interleaved_gate_up),
    Rule(_SEQ + "linear_fc2.weight", _X + "down_proj", transposed),
    Rule(_SEQ + "linear_fc2.bias", _X + "down_proj_bias"),
    Rule(_GROUPED + "linear_fc1.weight{expert}", _X + "gate_up_proj", interleaved_gate_up_transposed),  # TEGroupedMLP
    Rule(_GROUPED + "linear_fc1.bias{expert}", _X + "gate_up_proj_bias", interleaved_gate_up),
    Rule(_GROUPED + "linear_fc2.weight{expert}", _X + "down_proj", transposed),
    Rule(_GROUPED + "linear_fc2.bias{expert}", _X + "down_proj_bias"),
)
MOE_HF = (
    HFTensor(H + "mlp.router.weight", ("num_local_experts", "hidden_size"), Shard.REPLICATED),
    HFTensor(H + "mlp.router.bias", ("num_local_experts",), Shard.REPLICATED),
    # Engines split the intermediate dim: columns of gate_up_proj (whole gate/up pairs), rows of down_proj.
    HFTensor(_X + "gate_up_proj", ("hidden_size", "2*intermediate_size"), Shard.ROW),
    HFTensor(_X + "gate_up_proj_bias", ("2*intermediate_size",), Shard.COLUMN),
    HFTensor(_X + "down_proj", ("intermediate_size", "hidden_size"), Shard.COLUMN),
    HFTensor(_X + "down_proj_bias", ("hidden_size",), Shard.REPLICATED),
)

GPT_OSS = Family(
    name="gpt_oss",
    rules=EMBEDDING_RULES + INPUT_NORM_RULES + POST_ATTENTION_NORM_RULES + ATTENTION_RULES + MOE_RULES,
    hf_tensors=EMBEDDING_HF + NORM_HF + ATTENTION_HF + MOE_HF,
    skip=TIED_OUTPUT_SKIP,
    is_moe_layer=is_moe_layer,
    num_experts_key="num_local_experts",
    validate_config=_validate,
    layer_kind_keys=("num_local_experts",),
)
