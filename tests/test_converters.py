"""Family tables: complete synthetic Megatron state dicts convert back to the exact HF tensors.

Each Megatron state dict is written here by hand from HF tensors, inverting the
layouts with the `merge_*` functions, so the names on both sides are checked
independently of the converter's own tables. HF names and shapes are also
checked against what transformers itself saves for the same config.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sync.convert import (
    FAMILIES, ConfigError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError,
    UnknownFamilyError, UnmappedParameterError, get_converter,
)
from megatron_sync.convert.layout import merge_gate_up, merge_qkv, pad_vocab

PADDED_VOCAB = 16

CONFIGS = {
    # 12 layers so that layers.1 and layers.11 both exist; head_dim != hidden/heads.
    "llama": dict(vocab_size=10, hidden_size=8, intermediate_size=6, num_hidden_layers=12,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=3, tie_word_embeddings=False),
    # MQA, qkv bias, tied embeddings, head_dim derived from hidden/heads.
    "qwen2": dict(vocab_size=10, hidden_size=8, intermediate_size=6, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(vocab_size=10, hidden_size=8, intermediate_size=6, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=3, tie_word_embeddings=False),
    "qwen3_moe": dict(vocab_size=10, hidden_size=8, intermediate_size=6, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=3, num_experts=3,
                      num_experts_per_tok=1, moe_intermediate_size=5, decoder_sparse_step=1,
                      mlp_only_layers=[0], tie_word_embeddings=False),
    # one multi-token-prediction draft layer (model.layers.3)
    "deepseek_v3": dict(vocab_size=10, hidden_size=8, intermediate_size=6, num_hidden_layers=3,
                        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=4, kv_lora_rank=5,
                        qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3, n_routed_experts=3,
                        n_shared_experts=1, moe_intermediate_size=5, first_k_dense_replace=1,
                        num_experts_per_tok=1, n_group=1, topk_group=1, num_nextn_predict_layers=1,
                        tie_word_embeddings=False),
    # GLM-4.5: q/k/v biases, QK norm, dense first layers, two draft layers (model.layers.3 and .4)
    "glm4_moe": dict(vocab_size=10, hidden_size=8, intermediate_size=6, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=3, n_routed_experts=3,
                     n_shared_experts=1, moe_intermediate_size=5, first_k_dense_replace=1, num_experts_per_tok=1,
                     attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
                     num_nextn_predict_layers=2, tie_word_embeddings=False),
}
CONFIGS["deepseek_v3_no_q_lora"] = dict(CONFIGS["deepseek_v3"], q_lora_rank=None, num_nextn_predict_layers=0)
# GLM-4.5-Air-like: no QK norm; no draft
CONFIGS["glm4_moe_air"] = dict(CONFIGS["glm4_moe"], use_qk_norm=False, num_nextn_predict_layers=0)
# Kimi-K2's config.json says model_type kimi_k2 and maps onto DeepSeek-V3 (here: more experts, no draft)
CONFIGS["kimi_k2"] = dict(CONFIGS["deepseek_v3"], model_type="kimi_k2", n_routed_experts=16, num_experts_per_tok=2,
                          num_nextn_predict_layers=0)
FAMILY_OF = {k: {"kimi_k2": "deepseek_v3", "glm4_moe_air": "glm4_moe"}.get(k, k.removesuffix("_no_q_lora"))
             for k in CONFIGS}
MLA = ("deepseek_v3",)

SPECS = ["local", "te", "te_grouped"]


def hf_state(conv) -> dict[str, torch.Tensor]:
    """Arange-based HF tensors, each with distinct values, for every expected name."""
    out, base = {}, 0
    for name, (shape, _) in conv.expected_hf_tensors().items():
        n = math.prod(shape)
        out[name] = (torch.arange(n, dtype=torch.float32) + base).reshape(shape)
        base += n
    return out


# -- hand-written Megatron state dicts (the inverse direction) ---------------------------------

def gqa_attention(hf, cfg, i, te):
    m, a = f"decoder.layers.{i}.", f"model.layers.{i}.self_attn."
    heads = dict(num_attention_heads=cfg["num_attention_heads"],
                 num_key_value_heads=cfg["num_key_value_heads"],
                 head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    sd = {
        m + norm: hf[f"model.layers.{i}.input_layernorm.weight"],
        m + "self_attention.linear_qkv.weight": merge_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], **heads),
        m + "self_attention.linear_proj.weight": hf[a + "o_proj.weight"],
    }
    if a + "q_proj.bias" in hf:
        sd[m + "self_attention.linear_qkv.bias"] = merge_qkv(
            hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], **heads)
    if a + "q_norm.weight" in hf:
        sd[m + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
        sd[m + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
    return sd


def mla_attention(hf, cfg, i, te):
    m, a = f"decoder.layers.{i}.self_attention.", f"model.layers.{i}.self_attn."
    sd = {
        f"decoder.layers.{i}.input_layernorm.weight": hf[f"model.layers.{i}.input_layernorm.weight"],
        m + "linear_kv_down_proj.weight": hf[a + "kv_a_proj_with_mqa.weight"],
        m + ("linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight"):
            hf[a + "kv_a_layernorm.weight"],
        m + "linear_kv_up_proj.weight": hf[a + "kv_b_proj.weight"],
        m + "linear_proj.weight": hf[a + "o_proj.weight"],
    }
    if cfg["q_lora_rank"] is None:
        sd[m + "linear_q_proj.weight"] = hf[a + "q_proj.weight"]
    else:
        sd[m + "linear_q_down_proj.weight"] = hf[a + "q_a_proj.weight"]
        sd[m + ("linear_q_up_proj.layer_norm_weight" if te else "q_layernorm.weight")] = \
            hf[a + "q_a_layernorm.weight"]
        sd[m + "linear_q_up_proj.weight"] = hf[a + "q_b_proj.weight"]
    return sd


def mlp(hf, cfg, i, te, grouped):
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    post_norm = hf[h + "post_attention_layernorm.weight"]
    if h + "mlp.gate_proj.weight" in hf:  # dense layer
        return {
            m + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"): post_norm,
            m + "mlp.linear_fc1.weight": merge_gate_up(hf[h + "mlp.gate_proj.weight"],
                                                       hf[h + "mlp.up_proj.weight"]),
            m + "mlp.linear_fc2.weight": hf[h + "mlp.down_proj.weight"],
        }
    sd = {m + "pre_mlp_layernorm.weight": post_norm,
          m + "mlp.router.weight": hf[h + "mlp.gate.weight"]}
    n_experts = cfg.get("num_experts") or cfg["n_routed_experts"]
    for e in range(n_experts):
        x = f"{h}mlp.experts.{e}."
        fc1 = merge_gate_up(hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"])
        if grouped:
            sd[f"{m}mlp.experts.linear_fc1.weight{e}"] = fc1
            sd[f"{m}mlp.experts.linear_fc2.weight{e}"] = hf[x + "down_proj.weight"]
        else:
            sd[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
            sd[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = hf[x + "down_proj.weight"]
    if h + "mlp.gate.e_score_correction_bias" in hf:
        sd[m + "mlp.router.expert_bias"] = hf[h + "mlp.gate.e_score_correction_bias"]
    if h + "mlp.shared_experts.gate_proj.weight" in hf:
        s = h + "mlp.shared_experts."
        sd[m + "mlp.shared_experts.linear_fc1.weight"] = merge_gate_up(
            hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"])
        sd[m + "mlp.shared_experts.linear_fc2.weight"] = hf[s + "down_proj.weight"]
    return sd


def decoder_layer(hf, cfg, i, te, grouped, mla):
    """One decoder layer's Megatron tensors (`decoder.layers.{i}.`) from HF layer i."""
    return {**(mla_attention if mla else gqa_attention)(hf, cfg, i, te), **mlp(hf, cfg, i, te, grouped)}


def mtp_layer(hf, cfg, depth, te, grouped, mla):
    """Megatron's MTP depth `depth` (`mtp.layers.{depth}.`) from the HF draft layer num_hidden_layers + depth."""
    i = cfg["num_hidden_layers"] + depth
    m, h = f"mtp.layers.{depth}.", f"model.layers.{i}."
    layer = decoder_layer(hf, cfg, i, te, grouped, mla)
    sd = {m + "transformer_layer." + name.removeprefix(f"decoder.layers.{i}."): t for name, t in layer.items()}
    sd.update({m + "enorm.weight": hf[h + "enorm.weight"], m + "hnorm.weight": hf[h + "hnorm.weight"],
               m + "eh_proj.weight": hf[h + "eh_proj.weight"],
               m + "final_layernorm.weight": hf[h + "shared_head.norm.weight"]})
    return sd


def megatron_state(hf, cfg, spec, mla=False):
    """A full TP=1 Megatron state dict in `spec` naming, with a padded vocabulary (and the MTP block)."""
    te, grouped = spec != "local", spec == "te_grouped"
    embed = hf["model.embed_tokens.weight"]
    sd = {
        "embedding.word_embeddings.weight": pad_vocab(embed, padded_vocab_size=PADDED_VOCAB),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        # present on the last PP stage even when tied (then a copy of the embedding)
        "output_layer.weight": pad_vocab(hf.get("lm_head.weight", embed), padded_vocab_size=PADDED_VOCAB),
    }
    for i in range(cfg["num_hidden_layers"]):
        sd.update(decoder_layer(hf, cfg, i, te, grouped, mla))
    for depth in range(cfg.get("num_nextn_predict_layers") or 0):
        sd.update(mtp_layer(hf, cfg, depth, te, grouped, mla))
    return sd


def convert_all(conv, megatron_sd):
    produced = []
    for name, tensor in megatron_sd.items():
        out = conv.convert(name, tensor)
        metas = conv.convert_meta(name, tensor.shape, tensor.dtype)
        assert [(m.name, m.shape, m.dtype) for m in metas] == \
            [(n, tuple(t.shape), t.dtype) for n, t in out], name
        produced += out
    return produced


# -- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("key", CONFIGS)
def test_family_converts_full_state_dict_exactly(key, spec):
    cfg = CONFIGS[key]
    conv = get_converter(FAMILY_OF[key], cfg, dtype=torch.float32)
    hf = hf_state(conv)
    sd = megatron_state(hf, cfg, spec, mla=FAMILY_OF[key] in MLA)
    produced = convert_all(conv, sd)
    names = [n for n, _ in produced]
    assert len(names) == len(set(names))
    assert set(names) == set(hf)
    for name, tensor in produced:
        assert torch.equal(tensor, hf[name]), name
        assert tensor.is_contiguous()
    conv.check_complete(names)


@pytest.mark.parametrize("key", CONFIGS)
def test_every_megatron_name_matches_exactly_one_rule(key):
    cfg = CONFIGS[key]
    family = FAMILIES[FAMILY_OF[key]]
    conv = get_converter(FAMILY_OF[key], cfg, dtype=torch.float32)
    hf = hf_state(conv)
    for spec in SPECS:
        for name in megatron_state(hf, cfg, spec, mla=family.name in MLA):
            hits = [r.megatron for r in family.rules if r.megatron_pattern.match(name) is not None]
            assert len(hits) == 1, (name, hits)


def _hf_model_class(family):
    import transformers
    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
    }[family]


DRAFT_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _saved_shapes(model_cls, config, path) -> dict[str, tuple]:
    from safetensors import safe_open

    torch.manual_seed(0)
    model_cls(config).save_pretrained(path)
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("key", CONFIGS)
def test_expected_layout_equals_what_transformers_saves(key, tmp_path):
    """Names and shapes from the config alone match transformers' own save_pretrained checkpoint.

    transformers drops the draft layers (DeepSeek-V3 and GLM-4.5 ignore them on load), so a draft
    layer is checked against a model with that many more layers: its decoder-layer tensors are
    what transformers saves for those layers, plus the draft's own enorm, hnorm, eh_proj and
    shared_head.norm.
    """
    config_cls, model_cls = _hf_model_class(FAMILY_OF[key])
    values = {k: v for k, v in CONFIGS[key].items() if k != "model_type"}
    hf_config = config_cls(**values)
    saved = _saved_shapes(model_cls, hf_config, tmp_path / "main")
    conv = get_converter(FAMILY_OF[key], hf_config)  # a PretrainedConfig, not a dict
    main, drafts = values["num_hidden_layers"], values.get("num_nextn_predict_layers", 0)
    draft = {f"model.layers.{main + d}.": d for d in range(drafts)}
    expected = {n: s for n, (s, _) in conv.expected_hf_tensors().items()}
    assert conv.draft_layers == drafts
    assert {n: s for n, s in expected.items() if not n.startswith(tuple(draft))} == saved
    if drafts:
        longer = _saved_shapes(model_cls, config_cls(**dict(values, num_hidden_layers=main + drafts)), tmp_path / "all")
        own = {f"{prefix}{t}" for prefix in draft for t in DRAFT_ONLY}
        assert {n: s for n, s in expected.items() if n.startswith(tuple(draft)) and n not in own} == \
            {n: s for n, s in longer.items() if n.startswith(tuple(draft))}
        assert own <= set(expected)
    assert conv.expected_hf_tensors() == get_converter(FAMILY_OF[key], CONFIGS[key]).expected_hf_tensors()


# -- dtypes, skips, buffers ----------------------------------------------------------------------

def test_target_dtype_and_float32_router_bias():
    conv = get_converter("deepseek_v3", CONFIGS["deepseek_v3"])  # bfloat16 default
    router = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8) / 7
    # DeepSeek-V3 routes in fp32 (transformers keeps the gate fp32): the gate is not rounded to bf16.
    [(name, gate)] = conv.convert("decoder.layers.1.mlp.router.weight", router)
    assert name == "model.layers.1.mlp.gate.weight" and gate.dtype == torch.float32
    assert torch.equal(gate, router)
    # Qwen3-MoE checkpoints hold the gate in the model dtype.
    qwen = get_converter("qwen3_moe", CONFIGS["qwen3_moe"])
    [(_, qwen_gate)] = qwen.convert("decoder.layers.1.mlp.router.weight", router)
    assert qwen_gate.dtype == torch.bfloat16 and torch.equal(qwen_gate, router.to(torch.bfloat16))
    bias = torch.arange(3, dtype=torch.float32) / 7
    [(name, out)] = conv.convert("decoder.layers.2.mlp.router.expert_bias", bias)
    assert name == "model.layers.2.mlp.gate.e_score_correction_bias"
    assert out.dtype == torch.float32 and torch.equal(out, bias)
    expected = conv.expected_hf_tensors()
    assert expected["model.layers.2.mlp.gate.e_score_correction_bias"][1] == torch.float32
    assert expected["model.layers.2.mlp.gate.weight"][1] == torch.float32
    assert conv.is_buffer("decoder.layers.2.mlp.router.expert_bias")
    assert not conv.is_buffer("decoder.layers.2.mlp.router.weight")
    assert conv.buffer_patterns == ("decoder.layers.{layer}.mlp.router.expert_bias",
                                    "mtp.layers.{layer}.transformer_layer.mlp.router.expert_bias")
    assert conv.is_buffer("mtp.layers.0.transformer_layer.mlp.router.expert_bias")


def test_tied_output_layer_is_an_explicit_skip():
    tied = get_converter("qwen2", CONFIGS["qwen2"])
    assert tied.is_skipped("output_layer.weight")
    assert tied.convert("output_layer.weight", torch.zeros(PADDED_VOCAB, 8)) == []
    assert tied.convert_meta("output_layer.weight", (PADDED_VOCAB, 8), torch.float32) == []
    assert "lm_head.weight" not in tied.expected_hf_tensors()
    untied = get_converter("qwen3", CONFIGS["qwen3"])
    assert not untied.is_skipped("output_layer.weight")
    [(name, t)] = untied.convert("output_layer.weight", torch.arange(PADDED_VOCAB * 8.).reshape(-1, 8))
    assert name == "lm_head.weight" and t.shape == (10, 8)


def test_user_skip_list_is_the_only_way_to_drop_a_name():
    name = "decoder.layers.1.mlp.router.local_tokens_per_expert"
    with pytest.raises(UnmappedParameterError):
        get_converter("qwen3_moe", CONFIGS["qwen3_moe"]).convert(name, torch.zeros(3))
    conv = get_converter("qwen3_moe", CONFIGS["qwen3_moe"],
                         skip=["decoder.layers.{layer}.mlp.router.local_tokens_per_expert"])
    assert conv.is_skipped(name) and conv.convert(name, torch.zeros(3)) == []
    assert not conv.is_skipped("decoder.layers.1.mlp.router.weight")


# -- errors -------------------------------------------------------------------------------------------

def test_unmapped_name_says_add_rule_or_skip():
    conv = get_converter("llama", CONFIGS["llama"])
    with pytest.raises(UnmappedParameterError) as e:
        conv.convert("decoder.layers.0.self_attention.linear_qkv.bias", torch.zeros(24))
    msg = str(e.value)
    assert "no rule for 'decoder.layers.0.self_attention.linear_qkv.bias' in family 'llama'" in msg
    assert "add a Rule" in msg and "skip=" in msg
    assert isinstance(e.value, ValueError)


def test_missing_tensor_names_it_and_its_megatron_source():
    conv = get_converter("qwen3_moe", CONFIGS["qwen3_moe"])
    names = list(conv.expected_hf_tensors())
    names.remove("model.layers.2.mlp.experts.1.down_proj.weight")
    with pytest.raises(MissingTensorError) as e:
        conv.check_complete(names)
    msg = str(e.value)
    assert "model.layers.2.mlp.experts.1.down_proj.weight" in msg
    assert "decoder.layers.{layer}.mlp.experts.linear_fc2.weight{expert}" in msg


def test_unexpected_and_duplicate_names_in_check_complete():
    conv = get_converter("qwen3", CONFIGS["qwen3"])
    names = list(conv.expected_hf_tensors())
    with pytest.raises(UnexpectedTensorError, match="model.layers.7.mlp.gate_proj.weight"):
        conv.check_complete(names + ["model.layers.7.mlp.gate_proj.weight"])
    with pytest.raises(UnexpectedTensorError, match="more than once.*model.norm.weight"):
        conv.check_complete(names + ["model.norm.weight"])


@pytest.mark.parametrize("family, name, shape, fragment", [
    ("qwen3", "decoder.layers.2.self_attention.linear_proj.weight", (8, 12),
     "layer 2 >= num_hidden_layers=2"),
    ("qwen3_moe", "decoder.layers.1.mlp.experts.linear_fc2.weight3", (8, 5),
     "expert 3 >= num_experts=3"),
    ("qwen3_moe", "decoder.layers.1.mlp.linear_fc1.weight", (12, 8),
     "layer 1 is a MoE layer per the config (num_experts=3, decoder_sparse_step=1, mlp_only_layers=[0])"),
    ("deepseek_v3", "decoder.layers.0.mlp.router.weight", (3, 8),
     "layer 0 is a dense layer per the config (n_routed_experts=3, first_k_dense_replace=1"),
])
def test_convert_rejects_names_the_config_does_not_call_for(family, name, shape, fragment):
    conv = get_converter(family, CONFIGS[family])
    with pytest.raises(UnexpectedTensorError) as e:
        conv.convert(name, torch.zeros(shape))
    assert fragment in str(e.value) and name in str(e.value)


@pytest.mark.parametrize("family, name, shape, fragment", [
    ("qwen3", "decoder.layers.0.self_attention.linear_proj.weight", (8, 8),
     "dim 1 is 8 but num_attention_heads*head_dim = 12 (head_dim=3, num_attention_heads=4)"),
    ("qwen3", "decoder.layers.0.self_attention.q_layernorm.weight", (2,),
     "dim 0 is 2 but head_dim = 3 (head_dim=3)"),
    ("qwen3", "decoder.layers.0.mlp.linear_fc1.weight", (10, 8),
     "dim 0 is 5 but intermediate_size = 6 (intermediate_size=6)"),
    ("deepseek_v3", "decoder.layers.0.self_attention.linear_kv_up_proj.weight", (8, 5),
     "num_attention_heads*(qk_nope_head_dim+v_head_dim) = 10"),
])
def test_shape_contradicting_config_names_the_config_value(family, name, shape, fragment):
    conv = get_converter(family, CONFIGS[family])
    for call in (lambda: conv.convert(name, torch.zeros(shape)),
                 lambda: conv.convert_meta(name, shape, torch.float32)):
        with pytest.raises(ShapeMismatchError) as e:
            call()
        assert fragment in str(e.value) and name in str(e.value)


def test_qkv_rows_contradicting_heads_names_the_config_values():
    conv = get_converter("qwen3", CONFIGS["qwen3"])  # expects 2*(2+2)*3 = 24 rows
    with pytest.raises(ShapeMismatchError, match="num_attention_heads, num_key_value_heads and head_dim"):
        conv.convert("decoder.layers.0.self_attention.linear_qkv.weight", torch.zeros(16, 8))


def test_vocab_smaller_than_config_is_an_error():
    conv = get_converter("llama", CONFIGS["llama"])
    with pytest.raises(ShapeMismatchError, match="vocab_size=10"):
        conv.convert("embedding.word_embeddings.weight", torch.zeros(9, 8))


def test_unknown_family_lists_known_ones():
    with pytest.raises(UnknownFamilyError) as e:
        get_converter("gpt2", {})
    assert all(f in str(e.value) for f in ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"))


@pytest.mark.parametrize("family, cfg, fragment", [
    ("qwen3_moe", {k: v for k, v in CONFIGS["qwen3_moe"].items() if k != "num_experts"},
     "no value for 'num_experts'"),
    ("llama", dict(CONFIGS["llama"], attention_bias=True), "attention_bias=true"),
    ("deepseek_v3", {k: v for k, v in CONFIGS["deepseek_v3"].items() if k != "kv_lora_rank"},
     "no value for 'kv_lora_rank'"),
])
def test_config_errors_name_the_key(family, cfg, fragment):
    with pytest.raises(ConfigError, match=fragment):
        get_converter(family, cfg)


# -- multi-token-prediction draft layers ------------------------------------------------------------

def test_draft_depth_is_the_layer_after_the_main_ones():
    conv = get_converter("glm4_moe", CONFIGS["glm4_moe"], dtype=torch.float32)  # 3 main layers, 2 drafts
    fc2 = torch.arange(8 * 5, dtype=torch.float32).reshape(8, 5)
    assert conv.convert("mtp.layers.1.transformer_layer.mlp.experts.local_experts.2.linear_fc2.weight", fc2) == \
        [("model.layers.4.mlp.experts.2.down_proj.weight", fc2)]
    [(name, _)] = conv.convert("mtp.layers.0.final_layernorm.weight", torch.ones(8))
    assert name == "model.layers.3.shared_head.norm.weight"
    assert conv.shard_role("model.layers.3.eh_proj.weight").value == "replicated"


def test_draft_false_leaves_the_mtp_block_out_by_name():
    cfg = CONFIGS["glm4_moe"]
    conv = get_converter("glm4_moe", cfg, dtype=torch.float32, draft=False)
    assert conv.draft_layers == 0
    assert not [n for n in conv.expected_hf_tensors() if n.startswith(("model.layers.3.", "model.layers.4."))]
    sd = megatron_state(hf_state(get_converter("glm4_moe", cfg, dtype=torch.float32)), cfg, "local")
    mtp = [n for n in sd if n.startswith("mtp.")]
    assert mtp and all(conv.is_skipped(n) and conv.convert(n, sd[n]) == [] for n in mtp)
    conv.check_complete(n for name, t in sd.items() for n, _ in conv.convert(name, t))


@pytest.mark.parametrize("family, key, error, fragments", [
    ("glm4_moe", "glm4_moe_air", UnexpectedTensorError,
     ["mtp.layers.0.eh_proj.weight", "num_nextn_predict_layers=0", "weight_sync.draft: skip"]),
    ("deepseek_v3", "kimi_k2", UnexpectedTensorError, ["mtp.layers.0.eh_proj.weight", "num_nextn_predict_layers=0"]),
    ("qwen3", "qwen3", UnmappedParameterError, ["no rule for 'mtp.layers.0.eh_proj.weight'"]),
])
def test_an_mtp_block_without_a_draft_layer_is_refused_by_name(family, key, error, fragments):
    conv = get_converter(family, CONFIGS[key])
    with pytest.raises(error) as e:
        conv.convert("mtp.layers.0.eh_proj.weight", torch.zeros(8, 16))
    assert all(f in str(e.value) for f in fragments), str(e.value)


def test_missing_draft_layers_say_build_the_mtp_block_or_skip_the_draft():
    conv = get_converter("glm4_moe", CONFIGS["glm4_moe"])
    main = [n for n in conv.expected_hf_tensors() if not n.startswith(("model.layers.3.", "model.layers.4."))]
    with pytest.raises(MissingTensorError) as e:
        conv.check_complete(main)
    msg = str(e.value)
    assert "model.layers.3.eh_proj.weight" in msg and "mtp.layers.{layer}.eh_proj.weight" in msg
    assert "mtp_num_layers=2" in msg and "weight_sync.draft: skip" in msg


# Kimi-K2-Instruct's config.json as released (the fields that shape tensors; no weights bundled).
KIMI_K2_INSTRUCT = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", vocab_size=163840, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=0,
    num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384,
    routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=1, topk_group=1, num_experts_per_tok=8, moe_layer_freq=1,
    first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid", tie_word_embeddings=False,
    quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                         "weight_block_size": [128, 128]},
)


def test_kimi_k2_config_maps_onto_deepseek_v3_at_384_experts():
    from megatron_sync.convert import family_of_model_type

    assert family_of_model_type("kimi_k2").name == "deepseek_v3"
    conv = get_converter("deepseek_v3", KIMI_K2_INSTRUCT)
    plain = conv.expected_hf_tensors(quantized=False)
    # 3 outside the layers; dense layer 0: 2 norms + 7 MLA + 3 MLP; 60 MoE layers: 2 + 7 + gate + bias
    # + 3 shared + 384 * 3 experts
    assert len(plain) == 3 + 12 + 60 * (2 + 7 + 2 + 3 + 384 * 3)
    assert conv.draft_layers == 0 and "model.layers.61.eh_proj.weight" not in plain
    assert plain["model.layers.60.mlp.experts.383.down_proj.weight"] == ((7168, 2048), torch.bfloat16)
    assert plain["model.layers.1.self_attn.q_b_proj.weight"][0] == (64 * (128 + 64), 1536)
    assert plain["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"][0] == (512 + 64, 7168)
    assert "model.layers.0.mlp.gate.weight" not in plain  # first_k_dense_replace=1
    stored = conv.expected_hf_tensors()
    assert stored["model.layers.60.mlp.experts.383.down_proj.weight"] == ((7168, 2048), torch.float8_e4m3fn)
    assert stored["model.layers.60.mlp.experts.383.down_proj.weight_scale_inv"] == ((56, 16), torch.float32)
    assert stored["model.layers.60.mlp.gate.weight"] == ((384, 7168), torch.float32)  # routers stay unquantized


def test_a_glm_tensor_the_config_switches_off_is_refused_naming_the_switch():
    conv = get_converter("glm4_moe", CONFIGS["glm4_moe_air"])  # use_qk_norm false
    with pytest.raises(UnexpectedTensorError) as e:
        conv.convert("decoder.layers.0.self_attention.q_layernorm.weight", torch.ones(3))
    assert "model.layers.0.self_attn.q_norm.weight" in str(e.value) and "use_qk_norm" in str(e.value)
    no_bias = get_converter("glm4_moe", dict(CONFIGS["glm4_moe"], attention_bias=False))
    with pytest.raises(UnexpectedTensorError, match="attention_bias"):
        no_bias.convert("decoder.layers.0.self_attention.linear_qkv.bias", torch.zeros(24))


def test_kimi_k2_config_json_is_read_and_compared_as_deepseek_v3(tmp_path):
    """transformers has no kimi_k2 config class; engines read Kimi-K2's config.json as DeepSeek-V3's (vLLM does),
    and the rendezvous compares a trainer's config.json dict with an engine's config of it field by field."""
    import json

    import transformers

    from megatron_sync.convert import config_model_type
    from megatron_sync.convert.model_digest import model_differences, model_fields
    from megatron_sync.drivers.serve import load_model_config

    assert config_model_type("kimi_k2") == "deepseek_v3" and config_model_type("qwen3") == "qwen3"
    values = {k: v for k, v in KIMI_K2_INSTRUCT.items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(values))
    config = load_model_config(str(tmp_path))
    assert isinstance(config, transformers.DeepseekV3Config) and config.n_routed_experts == 384
    assert model_differences(model_fields(values), model_fields(config)) == []
    assert get_converter("deepseek_v3", config).expected_hf_tensors() == \
        get_converter("deepseek_v3", values).expected_hf_tensors()
