"""gpt-oss and Qwen3-Next tables: complete hand-written Megatron state dicts convert to the exact HF
tensors, the HF names and shapes are what transformers itself saves, and bad input is refused by name.

The Megatron state dicts are written here from HF tensors with the `merge_*` / inverse layout
functions (the other direction of the converter's), in both the local and the TE namings.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sync.convert import FAMILIES, ConfigError, ShapeMismatchError, UnexpectedTensorError, get_converter
from megatron_sync.convert.layout import (
    deinterleave_gate_up, gamma_to_zero_centered, merge_gate_up, merge_gated_qkv, merge_gdn_in_proj, merge_qkv,
    pad_vocab,
)
from tests.support.hf_check import transformers_checkpoint

PADDED_VOCAB = 16

GPT_OSS = dict(vocab_size=10, hidden_size=8, intermediate_size=6, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=3, num_local_experts=3, num_experts_per_tok=2,
               tie_word_embeddings=False)
QWEN3_NEXT = dict(vocab_size=10, hidden_size=8, intermediate_size=7, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=3, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=3, linear_value_head_dim=2, linear_conv_kernel_dim=4, num_experts=3,
                  num_experts_per_tok=2, moe_intermediate_size=5, shared_expert_intermediate_size=6,
                  mlp_only_layers=[1], full_attention_interval=2, tie_word_embeddings=False)
CONFIGS = {"gpt_oss": GPT_OSS, "qwen3_next": QWEN3_NEXT}
SPECS = ["local", "te", "te_grouped"]


def hf_state(conv) -> dict[str, torch.Tensor]:
    """Arange-based HF tensors, each with distinct values (exact in float32), for every expected name."""
    out, base = {}, 0
    for name, (shape, _) in conv.expected_hf_tensors().items():
        n = math.prod(shape)
        out[name] = ((torch.arange(n, dtype=torch.float32) + base) / 4).reshape(shape)
        base += n
    return out


def _embedding(hf):
    return {
        "embedding.word_embeddings.weight": pad_vocab(hf["model.embed_tokens.weight"], padded_vocab_size=PADDED_VOCAB),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": pad_vocab(hf["lm_head.weight"], padded_vocab_size=PADDED_VOCAB),
    }


def _heads(cfg):
    return dict(num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                head_dim=cfg["head_dim"])


def _experts(hf, i, grouped, per_expert):
    """Megatron routed-expert tensors of layer `i` from `per_expert(e) -> {tail: tensor}`."""
    sd = {}
    for e in range(3):
        for tail, tensor in per_expert(e).items():
            fc, kind = tail.split(".")
            name = f"mlp.experts.{fc}.{kind}{e}" if grouped else f"mlp.experts.local_experts.{e}.{tail}"
            sd[f"decoder.layers.{i}.{name}"] = tensor
    return sd


def gpt_oss_megatron(hf, cfg, spec):
    te, grouped = spec != "local", spec == "te_grouped"
    sd = _embedding(hf)
    for i in range(cfg["num_hidden_layers"]):
        m, h, a = f"decoder.layers.{i}.", f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        sd[m + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")] = \
            hf[h + "input_layernorm.weight"]
        for kind in ("weight", "bias"):
            sd[m + f"self_attention.linear_qkv.{kind}"] = merge_qkv(
                *(hf[a + f"{p}_proj.{kind}"] for p in "qkv"), **_heads(cfg))
            sd[m + f"self_attention.linear_proj.{kind}"] = hf[a + f"o_proj.{kind}"]
        sd[m + "self_attention.core_attention.softmax_offset"] = hf[a + "sinks"]
        sd[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        sd[m + "mlp.router.weight"] = hf[h + "mlp.router.weight"]
        sd[m + "mlp.router.bias"] = hf[h + "mlp.router.bias"]
        x = h + "mlp.experts.{}."
        sd.update(_experts(hf, i, grouped, lambda e: {
            "linear_fc1.weight": deinterleave_gate_up(hf[x.format(e) + "gate_up_proj"].t()),
            "linear_fc1.bias": deinterleave_gate_up(hf[x.format(e) + "gate_up_proj_bias"]),
            "linear_fc2.weight": hf[x.format(e) + "down_proj"].t(),
            "linear_fc2.bias": hf[x.format(e) + "down_proj_bias"],
        }))
    return sd


def qwen3_next_megatron(hf, cfg, spec):
    te, grouped = spec != "local", spec == "te_grouped"
    sd = _embedding(hf)
    gdn = dict(num_key_heads=cfg["linear_num_key_heads"], num_value_heads=cfg["linear_num_value_heads"],
               key_head_dim=cfg["linear_key_head_dim"], value_head_dim=cfg["linear_value_head_dim"])
    for i in range(cfg["num_hidden_layers"]):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        a, g, s = h + "self_attn.", h + "linear_attn.", m + "self_attention."
        full = f"{a}q_proj.weight" in hf
        fused_norm = s + ("linear_qkv" if full else "in_proj") + ".layer_norm_weight"
        sd[fused_norm if te else m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        if full:
            sd[s + "linear_qkv.weight"] = merge_gated_qkv(*(hf[a + f"{p}_proj.weight"] for p in "qkv"), **_heads(cfg))
            sd[s + "linear_proj.weight"] = hf[a + "o_proj.weight"]
            sd[s + "q_layernorm.weight"] = hf[a + "q_norm.weight"]
            sd[s + "k_layernorm.weight"] = hf[a + "k_norm.weight"]
        else:
            sd[s + "in_proj.weight"] = merge_gdn_in_proj(hf[g + "in_proj_qkvz.weight"], hf[g + "in_proj_ba.weight"], **gdn)
            for tail in ("conv1d.weight", "A_log", "dt_bias"):
                sd[s + tail] = hf[g + tail]
            sd[s + "out_norm.weight"] = gamma_to_zero_centered(hf[g + "norm.weight"])
            sd[s + "out_proj.weight"] = hf[g + "out_proj.weight"]
        post_norm = hf[h + "post_attention_layernorm.weight"]
        if h + "mlp.gate_proj.weight" in hf:  # a dense layer
            sd[m + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight")] = post_norm
            sd[m + "mlp.linear_fc1.weight"] = merge_gate_up(hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"])
            sd[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
            continue
        sd[m + "pre_mlp_layernorm.weight"] = post_norm
        sd[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
        x = h + "mlp.experts.{}."
        sd.update(_experts(hf, i, grouped, lambda e: {
            "linear_fc1.weight": merge_gate_up(hf[x.format(e) + "gate_proj.weight"], hf[x.format(e) + "up_proj.weight"]),
            "linear_fc2.weight": hf[x.format(e) + "down_proj.weight"],
        }))
        shared = h + "mlp.shared_expert."
        sd[m + "mlp.shared_experts.linear_fc1.weight"] = merge_gate_up(hf[shared + "gate_proj.weight"],
                                                                       hf[shared + "up_proj.weight"])
        sd[m + "mlp.shared_experts.linear_fc2.weight"] = hf[shared + "down_proj.weight"]
        sd[m + "mlp.shared_experts.gate_weight"] = hf[h + "mlp.shared_expert_gate.weight"]
    return sd


MEGATRON_STATE = {"gpt_oss": gpt_oss_megatron, "qwen3_next": qwen3_next_megatron}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", CONFIGS)
def test_family_converts_full_state_dict_exactly(family, spec):
    cfg = CONFIGS[family]
    conv = get_converter(family, cfg, dtype=torch.float32)
    hf = hf_state(conv)
    produced = []
    for name, tensor in MEGATRON_STATE[family](hf, cfg, spec).items():
        out = conv.convert(name, tensor)
        assert [(m.name, m.shape, m.dtype) for m in conv.convert_meta(name, tensor.shape, tensor.dtype)] == \
            [(n, tuple(t.shape), t.dtype) for n, t in out], name
        produced += out
    names = [n for n, _ in produced]
    assert len(names) == len(set(names)) and set(names) == set(hf)
    for name, tensor in produced:
        assert torch.equal(tensor, hf[name]) and tensor.is_contiguous(), name
    conv.check_complete(names)


@pytest.mark.parametrize("family", CONFIGS)
def test_every_megatron_name_matches_exactly_one_rule(family):
    cfg = CONFIGS[family]
    hf = hf_state(get_converter(family, cfg, dtype=torch.float32))
    for spec in SPECS:
        for name in MEGATRON_STATE[family](hf, cfg, spec):
            hits = [r.megatron for r in FAMILIES[family].rules if r.megatron_pattern.match(name) is not None]
            assert len(hits) == 1, (name, hits)


@pytest.mark.parametrize("family", CONFIGS)
def test_expected_layout_equals_what_transformers_saves(family, tmp_path):
    """Names and shapes from the config alone are transformers' own checkpoint (gpt-oss experts stacked)."""
    import transformers
    from safetensors import safe_open

    config_cls, model_cls = {
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    }[family]
    hf_config = config_cls(**CONFIGS[family])
    torch.manual_seed(0)
    model_cls(hf_config).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    conv = get_converter(family, hf_config)  # a PretrainedConfig, not a dict
    ours = {n: torch.empty(s, device="meta") for n, (s, _) in conv.expected_hf_tensors().items()}
    assert {n: tuple(t.shape) for n, t in transformers_checkpoint(ours).items()} == saved
    assert conv.expected_hf_tensors() == get_converter(family, CONFIGS[family]).expected_hf_tensors()


def test_qwen3_next_layer_kinds_follow_layer_types():
    conv = get_converter("qwen3_next", dict(QWEN3_NEXT, layer_types=["full_attention"] * 2 + ["linear_attention"] * 2))
    names = conv.expected_hf_tensors()
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.linear_attn.A_log" not in names
    assert "model.layers.3.linear_attn.A_log" in names and "model.layers.3.self_attn.q_proj.weight" not in names
    with pytest.raises(UnexpectedTensorError) as e:
        conv.convert("decoder.layers.0.self_attention.A_log", torch.zeros(4))
    assert "layer 0 is not a linear_attention layer per the config (layer_types=" in str(e.value)


@pytest.mark.parametrize("family, name, shape, fragment", [
    ("gpt_oss", "decoder.layers.0.self_attention.core_attention.softmax_offset", (2,),
     "dim 0 is 2 but num_attention_heads = 4"),
    ("gpt_oss", "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", (10, 8),
     "dim 1 is 10 but 2*intermediate_size = 12"),
    ("qwen3_next", "decoder.layers.0.self_attention.conv1d.weight", (20, 1, 3),
     "dim 2 is 3 but linear_conv_kernel_dim = 4"),
    ("qwen3_next", "decoder.layers.0.self_attention.in_proj.weight", (27, 8), "in_proj has 27 rows"),
])
def test_shape_contradicting_config_names_the_config_value(family, name, shape, fragment):
    with pytest.raises(ShapeMismatchError) as e:
        get_converter(family, CONFIGS[family]).convert(name, torch.zeros(shape))
    assert fragment in str(e.value)


@pytest.mark.parametrize("family, cfg, fragment", [
    ("gpt_oss", dict(GPT_OSS, attention_bias=False), "attention_bias=false"),
    ("gpt_oss", {k: v for k, v in GPT_OSS.items() if k != "num_local_experts"}, "no value for 'num_local_experts'"),
    ("qwen3_next", dict(QWEN3_NEXT, layer_types=["linear_attention"] * 3), "layer_types of num_hidden_layers=4"),
    ("qwen3_next", dict(QWEN3_NEXT, attention_bias=True), "attention_bias=true"),
])
def test_config_errors_name_the_key(family, cfg, fragment):
    with pytest.raises(ConfigError, match=fragment):
        get_converter(family, cfg)


def test_gpt_oss_mxfp4_checkpoint_is_refused_by_name():
    # The released gpt-oss checkpoints quantize the experts to MXFP4; this package has no MXFP4 output.
    mxfp4 = dict(GPT_OSS, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})
    with pytest.raises(ConfigError, match="mxfp4"):
        get_converter("gpt_oss", mxfp4)
