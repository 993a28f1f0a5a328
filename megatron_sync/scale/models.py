"""The models the scale model knows by name: bundled HF configs (written from published values) and families.

Each bundled `configs/*.json` is a config.json reduced to the fields that define the tensors (sizes,
experts, attention, vocabulary, draft layers, quantization), copied from the model's published
config.json on the Hugging Face Hub (`MODELS[...].source`); no file is downloaded at run time. Any other
model is given as a path to its config.json plus a family name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from megatron_sync.convert import Converter, get_family
from megatron_sync.core.meta import dtype_from_name

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


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
    ModelEntry("qwen2.5-math-7b", "qwen2_5_7b.json", "qwen2", "7.6B",
               "https://huggingface.co/Qwen/Qwen2.5-Math-7B/blob/main/config.json (the tensor-defining values, equal "
               "to Qwen2.5-7B's: quoted in full in Lightning-AI/lightning-thunder's benchmark of Qwen2.5-7B-Instruct)"),
)}


def converter_for(family: str, hf_config: Any, *, dtype: str = "bfloat16", quantized: bool = True,
                  draft: bool = True) -> Converter:
    """Return the converter of `family` over `hf_config` at engine dtype `dtype`; `quantized=False` drops the
    config's quantization_config (the engine then computes with float weights of `dtype`), `draft=False`
    the multi-token-prediction draft layers (engines that serve no draft)."""
    if not quantized:
        hf_config = {k: v for k, v in (hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()).items()
                     if k != "quantization_config"}
    return Converter(get_family(family), hf_config, dtype=dtype_from_name(dtype), draft=draft)


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
