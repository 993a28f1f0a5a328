"""The trainer's Megatron model config against the HF config it sends under (`megatron_sync.trainer.megatron_config`).

Pure cases: each row of the table, changed on one side, is refused naming both values and the Megatron
option to set; the values that only look different (None routing groups and n_group 1, a softmax after
the top-k and norm_topk_prob) agree. One multi-process case reads the values off real Megatron models
of every built-in family (and Kimi-K2's shape, GLM-4.5 with partial rotary, routed scaling and an MTP
layer) and finds them equal to the tiny models' HF configs.
"""

from __future__ import annotations

import pytest

from megatron_sync.trainer.megatron_config import MEGATRON_TO_HF, disagreements
from megatron_sync.convert.model_digest import model_fields
from tests.support.dist import run_distributed
from tests.support.models import ModelSpec, hf_config

QWEN3_MOE = {  # what megatron_values reads off the tiny Qwen3-MoE (tests/support/models.py)
    "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
    "kv_channels": 16, "layernorm_epsilon": 1e-6, "add_qkv_bias": False, "rotary_base": 10000, "rotary_percent": 1.0,
    "rope_type": "rope", "num_moe_experts": 8, "moe_ffn_hidden_size": 32, "moe_router_topk": 2,
    "moe_router_score_function": "softmax", "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None, "moe_router_group_topk": None, "moe_shared_expert_intermediate_size": None,
    "activation": "silu", "gated_linear_unit": True, "multi_latent_attention": False, "padded_vocab_size": 256,
    "share_embeddings_and_output_weights": False, "moe_layer_freq": [1, 1, 1, 1],
}
DEEPSEEK_V3 = {**QWEN3_MOE, "num_query_groups": 4, "moe_router_score_function": "sigmoid",
               "moe_router_topk_scaling_factor": 1.0, "moe_shared_expert_intermediate_size": 32,
               "multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_head_dim": 16,
               "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "moe_layer_freq": [0, 1, 1, 1]}
DENSE = {**QWEN3_MOE, "num_moe_experts": None, "moe_layer_freq": 1}


def _hf(family: str) -> dict:
    return model_fields(hf_config(ModelSpec(family)))


def test_the_tiny_models_agree_with_their_hf_configs():
    assert disagreements(QWEN3_MOE, _hf("qwen3_moe")) == []
    assert disagreements(DEEPSEEK_V3, _hf("deepseek_v3")) == []


@pytest.mark.parametrize("megatron, hf, words", [
    ({"rotary_base": 1e6}, {}, "rotary base: the Megatron model has rotary_base=1000000.0, the HF config "
                               "rope_parameters.rope_theta=10000.0 (set rotary_base (--rotary-base) to match"),
    ({"layernorm_epsilon": 1e-5}, {}, "norm epsilon: the Megatron model has layernorm_epsilon=1e-05, the HF config "
                                      "rms_norm_eps=1e-06 (set layernorm_epsilon (--norm-epsilon)"),
    ({"num_layers": 5}, {}, "number of layers: the Megatron model has num_layers=5, the HF config "
                            "num_hidden_layers=4"),
    ({"num_attention_heads": 8}, {}, "attention heads: the Megatron model has num_attention_heads=8"),
    ({"num_query_groups": 4}, {}, "KV groups: the Megatron model has num_query_groups=4, the HF config "
                                  "num_key_value_heads=2"),
    ({"kv_channels": 32}, {}, "head dim: the Megatron model has kv_channels=32, the HF config head_dim=16"),
    ({"padded_vocab_size": 128}, {}, "vocabulary (Megatron's padded size must hold HF's): the Megatron model has "
                                     "padded_vocab_size=128, the HF config vocab_size=250"),
    ({"share_embeddings_and_output_weights": True}, {}, "tied embedding and output: the Megatron model has "
                                                        "share_embeddings_and_output_weights=True"),
    ({"activation": "gelu"}, {}, "MLP activation: the Megatron model has activation='gelu', the HF config "
                                 "hidden_act='silu'"),
    ({"gated_linear_unit": False}, {}, "activation='silu' (HF: 'silu (not gated)')"),
    ({"rotary_percent": 0.5}, {}, "the Megatron model has rotary_percent=0.5, the HF config "
                                  "rope_parameters.partial_rotary_factor=1.0 (its default)"),
    ({"rope_type": "llama3"}, {}, "RoPE scaling type: the Megatron model has rope_type='llama3', the HF config "
                                  "rope_parameters.rope_type='default'"),
    ({"num_moe_experts": 16}, {}, "routed experts: the Megatron model has num_moe_experts=16, the HF config "
                                  "num_experts=8"),
    ({"moe_router_topk": 4}, {}, "experts per token: the Megatron model has moe_router_topk=4, the HF config "
                                 "num_experts_per_tok=2 (set moe_router_topk (--moe-router-topk)"),
    ({"moe_router_pre_softmax": True}, {}, "router weights normalized over the top-k: the Megatron model has "
                                           "moe_router_pre_softmax=True (HF: False), the HF config norm_topk_prob=True"),
    ({"moe_router_score_function": "sigmoid"}, {}, "router score function: the Megatron model has "
                                                   "moe_router_score_function='sigmoid', the HF config "
                                                   "scoring_func='softmax' (implied by its model_type 'qwen3_moe')"),
    ({}, {"norm_topk_prob": False}, "moe_router_pre_softmax=False (HF: True), the HF config norm_topk_prob=False"),
    ({}, {"rms_norm_eps": 1e-5}, "the Megatron model has layernorm_epsilon=1e-06, the HF config rms_norm_eps=1e-05"),
])
def test_a_disagreement_is_named_with_both_values_and_the_option_to_set(megatron, hf, words):
    problems = disagreements({**QWEN3_MOE, **megatron}, {**_hf("qwen3_moe"), **hf})
    assert len(problems) == 1 and words in problems[0], problems
    assert "weight_sync.hf_config_path" in problems[0]


@pytest.mark.parametrize("megatron, hf, words", [
    ({"moe_router_score_function": "softmax"}, {}, "moe_router_score_function='softmax', the HF config "
                                                   "scoring_func='sigmoid'"),
    ({"moe_router_topk_scaling_factor": None}, {"routed_scaling_factor": 2.5},
     "moe_router_topk_scaling_factor=None (HF: 1.0), the HF config routed_scaling_factor=2.5"),
    ({}, {"n_group": 8}, "moe_router_num_groups=None (HF: 1), the HF config n_group=8"),
    ({"moe_router_group_topk": 4}, {}, "moe_router_group_topk=4, the HF config topk_group=1"),
    ({"moe_shared_expert_intermediate_size": 64}, {}, "moe_shared_expert_intermediate_size=64 (HF: 2.0), the HF "
                                                      "config n_shared_experts=1"),
    ({"kv_lora_rank": 64}, {}, "MLA key-value rank: the Megatron model has kv_lora_rank=64, the HF config "
                               "kv_lora_rank=32"),
    ({"qk_head_dim": 32}, {}, "qk_head_dim=32, the HF config qk_nope_head_dim=16"),
    ({"qk_pos_emb_head_dim": 16}, {}, "qk_pos_emb_head_dim=16, the HF config qk_rope_head_dim=8"),
    ({"v_head_dim": 8}, {}, "v_head_dim=8, the HF config v_head_dim=16"),
    ({"ffn_hidden_size": 256}, {}, "MLP size: the Megatron model has ffn_hidden_size=256, the HF config "
                                   "intermediate_size=128"),  # its first layer is dense
])
def test_deepseek_routing_and_mla_disagreements_are_named(megatron, hf, words):
    problems = disagreements({**DEEPSEEK_V3, **megatron}, {**_hf("deepseek_v3"), **hf})
    assert len(problems) == 1 and words in problems[0], problems


def test_a_value_its_architecture_implies_is_compared_when_the_config_is_silent():
    hf = {name: value for name, value in _hf("deepseek_v3").items() if name != "scoring_func"}
    (problem,) = disagreements({**DEEPSEEK_V3, "moe_router_score_function": "softmax"}, hf)
    assert "the HF config scoring_func='sigmoid' (implied by its model_type 'deepseek_v3')" in problem


def test_values_that_only_look_different_agree():
    hf = _hf("deepseek_v3")
    assert hf["head_dim"] != DEEPSEEK_V3["kv_channels"]  # MLA: kv_channels does not define the model
    assert disagreements({**DEEPSEEK_V3, "moe_router_num_groups": None, "moe_router_topk_scaling_factor": None},
                         {**hf, "n_group": 1, "routed_scaling_factor": 1.0}) == []
    assert disagreements({**QWEN3_MOE, "rotary_base": 10000}, {**_hf("qwen3_moe"), "rope_parameters.rope_theta": 1e4}) == []
    assert disagreements(DENSE, _hf("qwen3")) == []  # no MoE rows for a dense model
    # every layer MoE: HF's intermediate_size is not the (unused) dense MLP size (gpt-oss states the experts')
    assert disagreements({**QWEN3_MOE, "ffn_hidden_size": 256}, _hf("qwen3_moe")) == []
    yarn = {"rope_parameters.rope_type": "yarn", "rope_parameters.factor": 1.0}
    assert disagreements(DENSE, {**_hf("qwen3"), **yarn}) == []  # YaRN of factor 1 is the plain RoPE


def test_what_only_looks_alike_is_told_apart():
    assert "MLP size: the Megatron model has ffn_hidden_size=256" in disagreements(
        {**DENSE, "ffn_hidden_size": 256}, _hf("qwen3"))[0]
    yarn = {"rope_parameters.rope_type": "yarn", "rope_parameters.factor": 32.0}
    assert "rope_type='rope' (HF: 'default'), the HF config rope_parameters.rope_type='yarn'" in disagreements(
        DENSE, {**_hf("qwen3"), **yarn})[0]


def test_every_row_names_hf_fields_the_rendezvous_compares():
    from megatron_sync.convert.model_digest import defining_field_names

    compared = set(defining_field_names())
    for row in MEGATRON_TO_HF:
        assert {name.split(".")[0] for name in row.hf} <= compared, row


def _read_real_models(rank: int, world_size: int, specs: list[dict]) -> list[list[str]]:
    from megatron_sync.trainer.megatron_config import megatron_values
    from tests.support.dist import init_megatron
    from tests.support.models import build_model_chunks

    init_megatron(seed=1)
    return [disagreements(megatron_values(build_model_chunks(ModelSpec(**spec))[0]),
                          model_fields(hf_config(ModelSpec(**spec)))) for spec in specs]


@pytest.mark.multiproc
def test_values_read_off_real_megatron_models_agree_with_their_hf_configs():
    from megatron_sync.convert import BUILTIN_FAMILIES
    from tests.support.models import KIMI_K2

    specs = [{"family": family} for family in BUILTIN_FAMILIES] + [
        KIMI_K2, {"family": "glm4_moe", "partial_rotary_factor": 0.5, "routed_scaling_factor": 2.5, "mtp_layers": 1}]
    assert run_distributed(_read_real_models, 1, specs, timeout=240)[0] == [[] for _ in specs]
