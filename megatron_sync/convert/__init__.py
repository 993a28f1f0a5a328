"""Megatron -> HF checkpoint-format megatron_sync.convert, one rule table per model family.

    conv = get_converter("qwen3", hf_config, dtype=torch.bfloat16)
    for megatron_name, full_tensor in gathered:
        for hf_name, hf_tensor in conv.convert(megatron_name, full_tensor):
            ...
    conv.check_complete(sent_names)
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from megatron_sync.convert.base import Converter, Family, HFTensor, Rule, Shard, Skip, keep_together_of
from megatron_sync.convert.families.deepseek_v3 import DEEPSEEK_V3
from megatron_sync.convert.families.glm4_moe import GLM4_MOE
from megatron_sync.convert.errors import (
    ConfigError, ConversionError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError,
    UnknownFamilyError, UnmappedParameterError,
)
from megatron_sync.convert.families.gpt_oss import GPT_OSS
from megatron_sync.convert.families.llama import LLAMA, QWEN2
from megatron_sync.convert.families.qwen3 import QWEN3
from megatron_sync.convert.families.qwen3_moe import QWEN3_MOE
from megatron_sync.convert.families.qwen3_next import QWEN3_NEXT

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, DEEPSEEK_V3, GLM4_MOE, GPT_OSS,
                                                  QWEN3_NEXT)}
BUILTIN_FAMILIES: tuple[str, ...] = tuple(FAMILIES)  # the families this package ships (others register)


def register_family(family: Family) -> None:
    """Make `family` available by its name (a new family is one module plus this call)."""
    if family.name in FAMILIES and FAMILIES[family.name] is not family:
        raise ValueError(f"a different family is already registered as {family.name!r}")
    FAMILIES[family.name] = family


def get_family(name: str) -> Family:
    """Return the registered family `name`; UnknownFamilyError lists the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownFamilyError(
            f"unknown model family {name!r}; use one of {sorted(FAMILIES)} "
            f"or add a module under megatron_sync.convert/ and register it with register_family"
        ) from None


def family_of_model_type(model_type: str) -> Family:
    """Return the family that converts HF configs of `model_type` (config.json's "model_type")."""
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise UnknownFamilyError(f"no model family converts HF model_type {model_type!r}; known: {known}")


def config_model_type(model_type: str) -> str:
    """Return the model_type whose transformers config class reads a config.json of `model_type`: its family's
    first model type (Kimi-K2's "kimi_k2", which transformers has no class for, reads as "deepseek_v3", as vLLM
    reads it); a model type no family converts, as is."""
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family.hf_model_types[0]
    return model_type


def get_converter(family: str, hf_config: Any, *, dtype: torch.dtype = torch.bfloat16,
                  skip: Iterable[str] = (), draft: bool = True) -> Converter:
    """Return a `Converter` for `family` bound to `hf_config` (PretrainedConfig or config.json dict).

    `draft=False`: the engines hold no multi-token-prediction draft, so the layout has no draft layers
    and Megatron's MTP block is skipped by name (see `Converter`)."""
    return Converter(get_family(family), hf_config, dtype=dtype, skip=skip, draft=draft)


__all__ = [
    "get_converter", "get_family", "register_family", "family_of_model_type", "config_model_type", "FAMILIES",
    "BUILTIN_FAMILIES",
    "Converter", "Family", "Rule", "HFTensor", "Shard", "Skip", "keep_together_of",
    "ConversionError", "ConfigError", "UnknownFamilyError", "UnmappedParameterError",
    "MissingTensorError", "UnexpectedTensorError", "ShapeMismatchError",
]
