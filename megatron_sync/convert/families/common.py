"""Row groups shared by several families: Megatron GPT names that mean the same HF tensor everywhere.

Each group lists both Megatron namings side by side: the local spec
(`input_layernorm`, `pre_mlp_layernorm`, SequentialMLP experts) and the
Transformer Engine spec (layernorm fused into `linear_qkv` / `linear_fc1`,
TEGroupedMLP experts `linear_fc1.weight{E}`). Only one of each pair is
present in a given model, so both rows produce the same HF name.
"""

from __future__ import annotations

from megatron_sync.convert.base import HFTensor, Rule, Shard, Skip, tied, untied
from megatron_sync.convert.layout import gate_up, qkv, vocab

L = "decoder.layers.{layer}."  # Megatron, global layer index
H = "model.layers.{layer}."  # HF checkpoint

# -- embedding, final norm, output layer ------------------------------------------------------

EMBEDDING_RULES = (
    Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", vocab),
    Rule("decoder.final_layernorm.weight", "model.norm.weight"),
    Rule("output_layer.weight", "lm_head.weight", vocab),
)
EMBEDDING_HF = (
    HFTensor("model.embed_tokens.weight", ("vocab_size", "hidden_size"), Shard.VOCAB, linear=False),
    HFTensor("model.norm.weight", ("hidden_size",), Shard.REPLICATED),
    HFTensor("lm_head.weight", ("vocab_size", "hidden_size"), Shard.VOCAB, when=untied),
)
TIED_OUTPUT_SKIP = (
    Skip("output_layer.weight", "a copy of embedding.word_embeddings.weight when "
         "tie_word_embeddings is true (Megatron keeps it on the last pipeline stage)", when=tied),
)

# -- per-layer norms, both namings ---------------------------------------------------------------

INPUT_NORM_RULES = (
    Rule(L + "input_layernorm.weight", H + "input_layernorm.weight"),  # local spec, MLA
    Rule(L + "self_attention.linear_qkv.layer_norm_weight", H + "input_layernorm.weight"),  # TE
)
POST_ATTENTION_NORM_RULES = (
    Rule(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),  # local, TE MoE
    Rule(L + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight"),  # TE dense
)
NORM_HF = (
    HFTensor(H + "input_layernorm.weight", ("hidden_size",), Shard.REPLICATED),
    HFTensor(H + "post_attention_layernorm.weight", ("hidden_size",), Shard.REPLICATED),
)

# -- grouped-query attention -----------------------------------------------------------------------

_A = H + "self_attn."
GQA_RULES = (
    Rule(L + "self_attention.linear_qkv.weight",
         (_A + "q_proj.weight", _A + "k_proj.weight", _A + "v_proj.weight"), qkv),
    Rule(L + "self_attention.linear_proj.weight", _A + "o_proj.weight"),
)
GQA_HF = (
    HFTensor(_A + "q_proj.weight", ("num_attention_heads*head_dim", "hidden_size"), Shard.COLUMN),
    HFTensor(_A + "k_proj.weight", ("num_key_value_heads*head_dim", "hidden_size"), Shard.KV_HEADS),
    HFTensor(_A + "v_proj.weight", ("num_key_value_heads*head_dim", "hidden_size"), Shard.KV_HEADS),
    HFTensor(_A + "o_proj.weight", ("hidden_size", "num_attention_heads*head_dim"), Shard.ROW),
)
QKV_BIAS_RULES = (
    Rule(L + "self_attention.linear_qkv.bias",
         (_A + "q_proj.bias", _A + "k_proj.bias", _A + "v_proj.bias"), qkv),
)
QKV_BIAS_HF = (
    HFTensor(_A + "q_proj.bias", ("num_attention_heads*head_dim",), Shard.COLUMN),
    HFTensor(_A + "k_proj.bias", ("num_key_value_heads*head_dim",), Shard.KV_HEADS),
    HFTensor(_A + "v_proj.bias", ("num_key_value_heads*head_dim",), Shard.KV_HEADS),
)
QK_NORM_RULES = (
    Rule(L + "self_attention.q_layernorm.weight", _A + "q_norm.weight"),
    Rule(L + "self_attention.k_layernorm.weight", _A + "k_norm.weight"),
)
QK_NORM_HF = (
    HFTensor(_A + "q_norm.weight", ("head_dim",), Shard.REPLICATED),
    HFTensor(_A + "k_norm.weight", ("head_dim",), Shard.REPLICATED),
)

# -- dense gated MLP (every layer of a dense model, the dense layers of a MoE model) ---------------

DENSE_MLP_RULES = (
    Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), gate_up),
    Rule(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight"),
)
DENSE_MLP_HF = (
    HFTensor(H + "mlp.gate_proj.weight", ("intermediate_size", "hidden_size"), Shard.COLUMN, layers="dense"),
    HFTensor(H + "mlp.up_proj.weight", ("intermediate_size", "hidden_size"), Shard.COLUMN, layers="dense"),
    HFTensor(H + "mlp.down_proj.weight", ("hidden_size", "intermediate_size"), Shard.ROW, layers="dense"),
)

# -- routed experts and router -----------------------------------------------------------------

_X = H + "mlp.experts.{expert}."
EXPERT_RULES = (
    Rule(L + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
         (_X + "gate_proj.weight", _X + "up_proj.weight"), gate_up),  # SequentialMLP
    Rule(L + "mlp.experts.local_experts.{expert}.linear_fc2.weight", _X + "down_proj.weight"),
    Rule(L + "mlp.experts.linear_fc1.weight{expert}",
         (_X + "gate_proj.weight", _X + "up_proj.weight"), gate_up),  # TEGroupedMLP
    Rule(L + "mlp.experts.linear_fc2.weight{expert}", _X + "down_proj.weight"),
)
# The router is fp32 in Megatron; Qwen3-MoE checkpoints hold it in the model dtype.
ROUTED_EXPERT_RULES = (Rule(L + "mlp.router.weight", H + "mlp.gate.weight"),) + EXPERT_RULES


def routed_expert_hf(num_experts_key: str) -> tuple[HFTensor, ...]:
    """Return the HF layout of a MoE layer's router and routed experts; the expert count is `num_experts_key`."""
    return (
        HFTensor(H + "mlp.gate.weight", (num_experts_key, "hidden_size"), Shard.REPLICATED, layers="moe"),
        HFTensor(_X + "gate_proj.weight", ("moe_intermediate_size", "hidden_size"), Shard.COLUMN, layers="moe"),
        HFTensor(_X + "up_proj.weight", ("moe_intermediate_size", "hidden_size"), Shard.COLUMN, layers="moe"),
        HFTensor(_X + "down_proj.weight", ("hidden_size", "moe_intermediate_size"), Shard.ROW, layers="moe"),
    )


def reject_unmapped_flags(*keys: str):
    """Return a config validator raising ConfigError when any of `keys` is true (no rows map it)."""
    from megatron_sync.convert.errors import ConfigError

    def validate(cfg) -> None:
        for key in keys:
            if cfg.get(key):
                raise ConfigError(
                    f"family {cfg.family!r} has no rules for {key}=true (biases on the projections); "
                    f"add Rules for those tensors or use a config with {key}=false"
                )

    return validate
