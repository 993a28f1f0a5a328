"""Which HF config fields define the model, and a digest of them that both jobs compare at the rendezvous.

The plan handshake compares tensor names, shapes and dtypes. Two configs can
agree on all of those and still describe different models (rope_theta 1e6 on
the trainer, 1e4 on the engine): the engine would serve a model the trainer
never trained. So both sides present the fields below, read from their own HF
config (the trainer: the config its converter was built with; an engine: its
model's config.json), and the rendezvous refuses a join when any differs,
naming the field and both values.

`MODEL_DEFINING_FIELDS` is the list: what changes the function the model
computes. Bookkeeping (`_name_or_path`, `transformers_version`, token ids,
`use_cache`, the checkpoint's `dtype`, `max_position_embeddings`) is not on it;
the dtype the engine computes in is compared separately (`weight_sync.dtype`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Optional

MODEL_DEFINING_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("architecture", ("model_type",)),
    ("sizes", ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim")),
    ("experts", ("num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                 "first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
                 "routed_scaling_factor", "n_group", "topk_group", "scoring_func", "topk_method")),
    ("attention", ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                   "attention_bias", "hidden_act")),
    ("rope", ("rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor", "rope_interleave")),
    ("norm", ("rms_norm_eps", "layer_norm_eps")),
    ("layer kinds", ("layer_types", "sliding_window", "full_attention_interval", "swiglu_limit", "swiglu_alpha",
                     "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")),
    ("vocabulary", ("vocab_size", "tie_word_embeddings")),
    ("quantization", ("quantization_config",)),
)
"""(aspect, HF config fields) rows; a field a config does not have is left out of its digest."""

QUANTIZATION_DEFINING_KEYS = (
    "quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "fmt", "activation_scheme",
    "weight_block_size", "scale_fmt", "ignored_layers", "modules_to_not_convert",
)
"""The keys of a `quantization_config` that define the checkpoint. Engines add their own bookkeeping to
the dict they load (vLLM's compressed-tensors adds the model's head counts), which is not compared."""


def defining_field_names() -> tuple[str, ...]:
    """Return every field of `MODEL_DEFINING_FIELDS`, in table order."""
    return tuple(name for _, names in MODEL_DEFINING_FIELDS for name in names)


def model_fields(hf_config: Any) -> dict[str, Any]:
    """Return the model-defining fields of `hf_config` (a transformers config or a config.json dict).

    A dict is first completed with transformers' defaults for its model_type,
    so a config.json that omits a default value and a loaded config that
    states it give the same fields. Nested values (rope_parameters,
    quantization_config) are flattened to dotted names, so a difference
    names the exact key.
    """
    values = _as_dict(hf_config)
    flat: dict[str, Any] = {}
    for name in defining_field_names():
        value = values.get(name)
        if name == "quantization_config" and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k in QUANTIZATION_DEFINING_KEYS}
        if value is not None:
            _flatten(name, value, flat)
    return flat


def model_digest(fields: Mapping[str, Any]) -> str:
    """Return the sha256 of `fields` (canonical JSON), the short form both sides log."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def model_differences(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Return [(field, our value, their value)] for every field that differs (None where one side lacks it)."""
    return [(name, ours.get(name), theirs.get(name)) for name in sorted(set(ours) | set(theirs))
            if ours.get(name) != theirs.get(name)]


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return _with_transformers_defaults(dict(hf_config))
    if hasattr(hf_config, "to_dict"):
        values = hf_config.to_dict()
        for key in ("head_dim", "num_experts", "tie_word_embeddings"):  # attribute_map aliases to_dict omits
            if values.get(key) is None and getattr(hf_config, key, None) is not None:
                values[key] = getattr(hf_config, key)
        return values
    raise TypeError(f"an HF config must be a transformers config or a config.json dict, got {type(hf_config).__name__}")


def _with_transformers_defaults(values: dict[str, Any]) -> dict[str, Any]:
    model_type: Optional[str] = values.get("model_type")
    if model_type is None:
        return values
    try:
        from transformers import AutoConfig

        from megatron_sync.convert import config_model_type  # kimi_k2 reads as deepseek_v3, on both sides alike

        return _as_dict(AutoConfig.for_model(config_model_type(model_type),
                                             **{k: v for k, v in values.items() if k != "model_type"}))
    except (ImportError, ValueError, KeyError, TypeError):
        return values  # a model_type transformers does not know: compare the fields as written


def _flatten(name: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for key in sorted(value):
            _flatten(f"{name}.{key}", value[key], out)
    elif isinstance(value, tuple):
        out[name] = list(value)
    else:
        out[name] = value
