"""Megatron -> HF checkpoint-format converters, one rule table per model family.

    conv = get_converter("qwen3", hf_config, dtype=torch.bfloat16)
    for megatron_name, full_tensor in gathered:
        for hf_name, hf_tensor in conv.convert(megatron_name, full_tensor):
            ...
    conv.check_complete(sent_names)
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from converters.base import Converter, Family, HFTensor, Rule, Skip
from converters.deepseek_v3 import DEEPSEEK_V3
from converters.errors import (
    ConfigError, ConversionError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError,
    UnknownFamilyError, UnmappedParameterError,
)
from converters.llama import LLAMA, QWEN2
from converters.qwen3 import QWEN3
from converters.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, DEEPSEEK_V3)}


def get_converter(family: str, hf_config: Any, *, dtype: torch.dtype = torch.bfloat16,
                  skip: Iterable[str] = ()) -> Converter:
    """Return a `Converter` for `family` bound to `hf_config` (PretrainedConfig or config.json dict)."""
    try:
        table = FAMILIES[family]
    except KeyError:
        raise UnknownFamilyError(
            f"unknown model family {family!r}; use one of {sorted(FAMILIES)} "
            f"or add a module under converters/ and register it in FAMILIES"
        ) from None
    return Converter(table, hf_config, dtype=dtype, skip=skip)


__all__ = [
    "get_converter", "FAMILIES", "Converter", "Family", "Rule", "HFTensor", "Skip",
    "ConversionError", "ConfigError", "UnknownFamilyError", "UnmappedParameterError",
    "MissingTensorError", "UnexpectedTensorError", "ShapeMismatchError",
]
