"""The models the scale model knows by name: bundled HF configs (written from published values) and families.

Each bundled `configs/*.json` is a config.json reduced to the fields that define the tensors (sizes,
experts, attention, vocabulary, quantization), copied from the model's published config.json on the
Hugging Face Hub (`MODELS[...].source`); no file is downloaded at run time. Any other model is given
as a path to its config.json plus a family name.

GLM-4.5 (`model_type: glm4_moe`) has no family in `converters/` yet. Until one is registered, its
tensors come from `GLM4_MOE_STANDIN` below: a `converters.Family` composed only of the shared row
groups (`converters.common`) and DeepSeek-V3's MoE extras, labelled as a stand-in. It is never
registered, so the real family can take the name `glm4_moe`; `model_named` prefers a registered one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from converters import FAMILIES, Converter, Family, get_family
from converters.base import HFTensor, Rule
from converters.common import (
    DENSE_MLP_HF, DENSE_MLP_RULES, EMBEDDING_HF, EMBEDDING_RULES, EXPERT_RULES, GQA_HF, GQA_RULES, H, L,
    INPUT_NORM_RULES, NORM_HF, POST_ATTENTION_NORM_RULES, QK_NORM_HF, QK_NORM_RULES, QKV_BIAS_HF,
    QKV_BIAS_RULES, TIED_OUTPUT_SKIP, routed_expert_hf,
)
from converters.deepseek_v3 import MOE_EXTRA_HF, MOE_EXTRA_RULES, ROUTER_BIAS, is_moe_layer
from megatron_sync.meta import dtype_from_name

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

# GLM-4.5 keeps its router in the model dtype in the checkpoint; its score-correction bias is fp32
# like DeepSeek-V3's (MOE_EXTRA_RULES).
_GLM_ROUTER = (Rule(L + "mlp.router.weight", H + "mlp.gate.weight"),)
GLM4_MOE_STANDIN = Family(
    name="glm4_moe_standin",
    rules=EMBEDDING_RULES + INPUT_NORM_RULES + POST_ATTENTION_NORM_RULES + GQA_RULES + QKV_BIAS_RULES
    + QK_NORM_RULES + DENSE_MLP_RULES + _GLM_ROUTER + EXPERT_RULES + MOE_EXTRA_RULES,
    hf_tensors=EMBEDDING_HF + NORM_HF + GQA_HF + QKV_BIAS_HF
    + tuple(HFTensor(r.name, r.shape, r.shard, r.layers, when=lambda cfg: bool(cfg.get("use_qk_norm")))
            for r in QK_NORM_HF)
    + DENSE_MLP_HF + routed_expert_hf("n_routed_experts") + MOE_EXTRA_HF,
    skip=TIED_OUTPUT_SKIP,
    buffers=(ROUTER_BIAS,),
    is_moe_layer=is_moe_layer,
    num_experts_key="n_routed_experts",
    hf_model_types=("glm4_moe",),
)
"""Stand-in for GLM-4.5 until converters/ registers a glm4_moe family (not registered anywhere)."""


@dataclass(frozen=True)
class ModelEntry:
    """A bundled model: its config file, the family that converts it, and where the values come from."""

    name: str
    config_file: str
    family: str
    params: str  # as published: total (active)
    source: str

    def hf_config(self) -> dict[str, Any]:
        """Return the bundled config.json as a dict."""
        with open(os.path.join(CONFIG_DIR, self.config_file)) as f:
            return json.load(f)


MODELS: dict[str, ModelEntry] = {m.name: m for m in (
    ModelEntry("deepseek-v3", "deepseek_v3_671b.json", "deepseek_v3", "671B (37B)",
               "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json"),
    ModelEntry("kimi-k2", "kimi_k2_1t.json", "deepseek_v3", "1.04T (32B)",
               "https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json"),
    ModelEntry("qwen3-235b-a22b", "qwen3_235b_a22b.json", "qwen3_moe", "235B (22B)",
               "https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json"),
    ModelEntry("glm-4.5", "glm4_5_355b.json", "glm4_moe", "355B (32B)",
               "https://huggingface.co/zai-org/GLM-4.5/blob/main/config.json"),
    # smaller models of the published rows the scale model is validated on (bench/RESULTS.md)
    ModelEntry("qwen3-30b-a3b", "qwen3_30b_a3b.json", "qwen3_moe", "30B (3B)",
               "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json"),
    ModelEntry("moonlight-16b-a3b", "moonlight_16b_a3b.json", "deepseek_v3", "16B (3B)",
               "https://huggingface.co/moonshotai/Moonlight-16B-A3B/blob/main/config.json"),
    ModelEntry("glm-4.5-air", "glm4_5_air.json", "glm4_moe", "106B (12B)",
               "https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json"),
)}


def family_for(name: str) -> Family:
    """Return the registered family `name`; for "glm4_moe" the stand-in while none is registered."""
    if name in FAMILIES:
        return FAMILIES[name]
    if name == "glm4_moe":
        return GLM4_MOE_STANDIN
    return get_family(name)  # raises UnknownFamilyError listing the known ones


def converter_for(family: str, hf_config: Any, *, dtype: str = "bfloat16",
                  quantized: bool = True) -> Converter:
    """Return the converter of `family` over `hf_config` at engine dtype `dtype`; `quantized=False` drops the
    config's quantization_config (the engine then computes with float weights of `dtype`)."""
    if not quantized:
        hf_config = {k: v for k, v in (hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()).items()
                     if k != "quantization_config"}
    return Converter(family_for(family), hf_config, dtype=dtype_from_name(dtype))


def model_named(name_or_path: str, family: str | None = None) -> tuple[str, dict[str, Any]]:
    """Return (family, HF config dict) of a bundled model name, or of a config.json path with `family`.

    Raises ValueError naming the bundled models when `name_or_path` is neither.
    """
    if name_or_path in MODELS:
        entry = MODELS[name_or_path]
        return family or entry.family, entry.hf_config()
    if os.path.isfile(name_or_path):
        if family is None:
            raise ValueError(f"{name_or_path}: a config.json path needs its family (--family qwen3_moe, ...)")
        with open(name_or_path) as f:
            return family, json.load(f)
    raise ValueError(f"unknown model {name_or_path!r}: use one of {sorted(MODELS)} or a path to a config.json "
                     "(with its family)")
