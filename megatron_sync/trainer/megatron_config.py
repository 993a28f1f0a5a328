"""The trainer's own Megatron model config, against the HF config it sends its weights under.

Shapes and names catch a wrong layer count or head size, but a Megatron model
can agree on every tensor shape with the HF config and still compute another
function: trained with rotary base 1e6 and served with rope_theta 1e4, or
another norm epsilon, router top-k or score function. The engine would serve a
model the trainer never trained. So before the first sync the trainer reads the
model-defining values of its own Megatron model (`megatron_values`, at the edge)
and `disagreements` compares them, row by row of `MEGATRON_TO_HF`, with the
fields of the HF config that `model_digest.model_fields` reads (the same fields
the two jobs compare at the rendezvous). A row is skipped when the HF config
does not state its field and the row gives no default, or when the Megatron
value does not apply (`None`: e.g. a head dim under Multi-Latent Attention).
What names and shapes already pin (the MoE layer pattern, q/k norms, biases
besides the QKV one) is not repeated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from megatron_sync.convert.model_digest import model_fields
from megatron_sync.trainer.source import unwrap_chunk

Values = Mapping[str, Any]


@dataclass(frozen=True)
class FieldRow:
    """One model-defining value: its Megatron name, the HF fields that state it, how they compare."""

    megatron: str  # key of `megatron_values` (a TransformerConfig field or a GPTModel attribute)
    hf: tuple[str, ...]  # `model_fields` names, the first the HF config states is compared
    what: str  # in words, for the message
    fix: str  # the Megatron option that sets it
    to_hf: Callable[[Any, Values], Any] = lambda value, megatron: value  # the HF spelling (None: does not apply)
    hf_default: Any = None  # what an HF config that states none of `hf` means (None: skip the row)
    agree: Callable[[Any, Any], bool] = lambda megatron, hf: megatron == hf
    hf_means: Callable[[Any, Values], Any] = lambda stated, hf: stated  # an HF value in its plainest spelling


def _unless_mla(value: Any, megatron: Values) -> Any:
    return None if megatron.get("multi_latent_attention") else value


def _dense_mlp(size: Any, megatron: Values) -> Any:
    """The dense MLP size, when some layer has a dense MLP (HF's intermediate_size is the experts' size in
    a model whose every layer is MoE, gpt-oss)."""
    freq = megatron.get("moe_layer_freq")
    all_moe = megatron.get("num_moe_experts") and (freq == 1 or (isinstance(freq, (list, tuple)) and all(freq)))
    return None if all_moe else size


def _activation(name: Any, megatron: Values) -> Any:
    """HF's hidden_act for a gated MLP of Megatron's activation function (None: not one HF names)."""
    if not megatron.get("gated_linear_unit"):
        return f"{name} (not gated)"
    return {"silu": "silu", "gelu": "gelu", "relu": "relu"}.get(name)


def _normalized_topk(pre_softmax: Any, megatron: Values) -> Any:
    """HF's norm_topk_prob: softmax after the top-k (Megatron's default) normalizes over the k chosen;
    Megatron's sigmoid router always normalizes (for top-k > 1)."""
    if megatron.get("num_moe_experts") is None:
        return None
    return True if megatron.get("moe_router_score_function") == "sigmoid" else not pre_softmax


def _shared_experts(size: Any, megatron: Values) -> Any:
    expert = megatron.get("moe_ffn_hidden_size")
    return None if size is None or not expert else size / expert


def _rope_type(megatron_type: Any, megatron: Values) -> Any:
    return {"rope": "default", "yarn": "yarn", "llama3": "llama3"}.get(megatron_type)


def _plain_rope_type(stated: Any, hf: Values) -> Any:
    """YaRN with factor 1 is the plain RoPE (gpt-oss checkpoints state it so)."""
    return "default" if stated == "yarn" and hf.get("rope_parameters.factor", 1.0) == 1.0 else stated


MEGATRON_TO_HF: tuple[FieldRow, ...] = (
    FieldRow("num_layers", ("num_hidden_layers",), "number of layers", "num_layers (--num-layers)"),
    FieldRow("hidden_size", ("hidden_size",), "hidden size", "hidden_size (--hidden-size)"),
    FieldRow("ffn_hidden_size", ("intermediate_size",), "MLP size", "ffn_hidden_size (--ffn-hidden-size)",
             to_hf=_dense_mlp),
    FieldRow("num_attention_heads", ("num_attention_heads",), "attention heads",
             "num_attention_heads (--num-attention-heads)"),
    FieldRow("num_query_groups", ("num_key_value_heads",), "KV groups", "num_query_groups (--num-query-groups)",
             to_hf=_unless_mla),
    FieldRow("kv_channels", ("head_dim",), "head dim", "kv_channels (--kv-channels)", to_hf=_unless_mla),
    FieldRow("padded_vocab_size", ("vocab_size",), "vocabulary (Megatron's padded size must hold HF's)",
             "the tokenizer / vocab size the model was built with",
             agree=lambda megatron, hf: megatron >= hf),
    FieldRow("share_embeddings_and_output_weights", ("tie_word_embeddings",), "tied embedding and output",
             "share_embeddings_and_output_weights (--untie-embeddings-and-output-weights)"),
    FieldRow("layernorm_epsilon", ("rms_norm_eps", "layer_norm_eps"), "norm epsilon",
             "layernorm_epsilon (--norm-epsilon)"),
    FieldRow("activation", ("hidden_act",), "MLP activation", "activation_func / gated_linear_unit (--swiglu)",
             to_hf=_activation),
    FieldRow("add_qkv_bias", ("attention_bias",), "QKV bias", "add_qkv_bias (--add-qkv-bias)"),
    FieldRow("rotary_base", ("rope_parameters.rope_theta", "rope_theta"), "rotary base",
             "rotary_base (--rotary-base)"),
    FieldRow("rotary_percent", ("rope_parameters.partial_rotary_factor", "partial_rotary_factor"),
             "rotary fraction of the head dim", "rotary_percent (--rotary-percent)", hf_default=1.0),
    FieldRow("rope_type", ("rope_parameters.rope_type",), "RoPE scaling type",
             "rope_scaling / rope_type (--use-rope-scaling, --rope-type)", to_hf=_rope_type, hf_default="default",
             hf_means=_plain_rope_type),
    FieldRow("num_moe_experts", ("num_experts", "n_routed_experts", "num_local_experts"), "routed experts",
             "num_moe_experts (--num-experts)"),
    FieldRow("moe_ffn_hidden_size", ("moe_intermediate_size",), "expert MLP size",
             "moe_ffn_hidden_size (--moe-ffn-hidden-size)"),
    FieldRow("moe_router_topk", ("num_experts_per_tok",), "experts per token", "moe_router_topk (--moe-router-topk)",
             to_hf=lambda topk, megatron: topk if megatron.get("num_moe_experts") else None),
    FieldRow("moe_router_score_function", ("scoring_func",), "router score function",
             "moe_router_score_function (--moe-router-score-function)",
             to_hf=lambda fn, megatron: fn if megatron.get("num_moe_experts") else None),
    FieldRow("moe_router_pre_softmax", ("norm_topk_prob",), "router weights normalized over the top-k",
             "moe_router_pre_softmax (--moe-router-pre-softmax)", to_hf=_normalized_topk),
    FieldRow("moe_router_topk_scaling_factor", ("routed_scaling_factor",), "routed scaling factor",
             "moe_router_topk_scaling_factor (--moe-router-topk-scaling-factor)",
             to_hf=lambda factor, megatron: (factor or 1.0) if megatron.get("num_moe_experts") else None),
    FieldRow("moe_router_num_groups", ("n_group",), "router expert groups",
             "moe_router_num_groups (--moe-router-num-groups)",
             to_hf=lambda groups, megatron: (groups or 1) if megatron.get("num_moe_experts") else None),
    FieldRow("moe_router_group_topk", ("topk_group",), "router groups per token",
             "moe_router_group_topk (--moe-router-group-topk)",
             to_hf=lambda groups, megatron: (groups or 1) if megatron.get("num_moe_experts") else None),
    FieldRow("moe_shared_expert_intermediate_size", ("n_shared_experts",), "shared experts",
             "moe_shared_expert_intermediate_size (--moe-shared-expert-intermediate-size)", to_hf=_shared_experts),
    FieldRow("q_lora_rank", ("q_lora_rank",), "MLA query rank", "q_lora_rank (--q-lora-rank)",
             to_hf=lambda rank, megatron: rank if megatron.get("multi_latent_attention") else None),
    FieldRow("kv_lora_rank", ("kv_lora_rank",), "MLA key-value rank", "kv_lora_rank (--kv-lora-rank)",
             to_hf=lambda rank, megatron: rank if megatron.get("multi_latent_attention") else None),
    FieldRow("qk_head_dim", ("qk_nope_head_dim",), "MLA query-key head dim (no RoPE)", "qk_head_dim (--qk-head-dim)",
             to_hf=lambda dim, megatron: dim if megatron.get("multi_latent_attention") else None),
    FieldRow("qk_pos_emb_head_dim", ("qk_rope_head_dim",), "MLA RoPE head dim",
             "qk_pos_emb_head_dim (--qk-pos-emb-head-dim)",
             to_hf=lambda dim, megatron: dim if megatron.get("multi_latent_attention") else None),
    FieldRow("v_head_dim", ("v_head_dim",), "MLA value head dim", "v_head_dim (--v-head-dim)",
             to_hf=lambda dim, megatron: dim if megatron.get("multi_latent_attention") else None),
)
"""Megatron value -> HF config field(s), in the order a refusal lists differences."""

IMPLIED_BY_MODEL_TYPE: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"scoring_func": "sigmoid"},  # transformers' DeepSeek-V3 has no field: its router is sigmoid
    "qwen3_moe": {"scoring_func": "softmax"},
    "qwen2_moe": {"scoring_func": "softmax"},
    "mixtral": {"scoring_func": "softmax"},
}
"""HF fields an architecture fixes without stating them in its config (added when the config is silent)."""


def disagreements(megatron: Values, hf: Values) -> list[str]:
    """Return one sentence per row of `MEGATRON_TO_HF` on which the Megatron values and the HF config differ.

    `megatron`: `megatron_values` of the trainer's model; `hf`: `model_digest.model_fields` of its HF config.
    """
    implied = {name: value for name, value in IMPLIED_BY_MODEL_TYPE.get(hf.get("model_type"), {}).items()
               if hf.get(name) is None}
    hf = {**hf, **implied}
    out = []
    for row in MEGATRON_TO_HF:
        if row.megatron not in megatron:
            continue
        value = row.to_hf(megatron[row.megatron], megatron)
        field = next((name for name in row.hf if hf.get(name) is not None), None)
        stated = row.hf_means(hf[field], hf) if field is not None else row.hf_default
        if value is None or stated is None or row.agree(value, stated):
            continue
        shown = f"{row.megatron}={megatron[row.megatron]!r}"
        if value != megatron[row.megatron]:
            shown += f" (HF: {value!r})"
        how = (" (its default)" if field is None else
               f" (implied by its model_type {hf['model_type']!r})" if field in implied else "")
        out.append(f"{row.what}: the Megatron model has {shown}, the HF config {field or row.hf[0]}={stated!r}{how}"
                   f" (set {row.fix} to match, or send under the HF config of the model being trained: "
                   "weight_sync.hf_config_path)")
    return out


def check_model_config(chunks: Sequence[Any], hf_config: Any) -> None:
    """Raise ValueError naming every value on which the trainer's Megatron model chunks and `hf_config`
    (a transformers config or a config.json dict) define different models."""
    problems = disagreements(megatron_values(unwrap_chunk(chunks[0])), model_fields(hf_config))
    if problems:
        raise ValueError("the Megatron model being trained and the HF config its weights are sent under define "
                         "different models:\n  " + "\n  ".join(problems))


def megatron_values(chunk: Any) -> dict[str, Any]:
    """Return the model-defining values of a (bare) Megatron GPTModel chunk: its TransformerConfig's fields
    that `MEGATRON_TO_HF` reads, and the model's own rotary base, vocabulary and embedding tie."""
    config = chunk.config
    values = {row.megatron: getattr(config, row.megatron) for row in MEGATRON_TO_HF if hasattr(config, row.megatron)}
    activation = getattr(config, "activation_func", None)
    values.update(
        moe_layer_freq=getattr(config, "moe_layer_freq", None),
        activation=getattr(activation, "__name__", None),
        gated_linear_unit=getattr(config, "gated_linear_unit", False),
        multi_latent_attention=getattr(config, "multi_latent_attention", False),
        padded_vocab_size=getattr(chunk, "vocab_size", None),
        share_embeddings_and_output_weights=getattr(chunk, "share_embeddings_and_output_weights", None),
        rotary_base=getattr(chunk, "rotary_base", None),
        rotary_percent=getattr(chunk, "rotary_percent", None),
        rope_type=_megatron_rope_type(chunk, config),
    )
    return values


def _megatron_rope_type(chunk: Any, config: Any) -> Optional[str]:
    if getattr(config, "multi_latent_attention", False):
        return getattr(config, "rope_type", None)
    if getattr(chunk, "position_embedding_type", None) != "rope":
        return None
    return "llama3" if getattr(chunk, "rotary_scaling", False) else "rope"
