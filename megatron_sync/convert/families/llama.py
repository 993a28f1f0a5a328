"""Llama and Qwen2: GQA attention (Qwen2 adds a q/k/v bias), dense gated MLP."""

from __future__ import annotations

from megatron_sync.convert.base import Family
from megatron_sync.convert.families.common import (
    DENSE_MLP_HF, DENSE_MLP_RULES, EMBEDDING_HF, EMBEDDING_RULES, GQA_HF, GQA_RULES,
    INPUT_NORM_RULES, NORM_HF, POST_ATTENTION_NORM_RULES, QKV_BIAS_HF, QKV_BIAS_RULES,
    TIED_OUTPUT_SKIP, reject_unmapped_flags,
)


LLAMA = Family(
    name="llama",
    rules=EMBEDDING_RULES + INPUT_NORM_RULES + POST_ATTENTION_NORM_RULES + GQA_RULES
    + DENSE_MLP_RULES,
    hf_tensors=EMBEDDING_HF + NORM_HF + GQA_HF + DENSE_MLP_HF,
    skip=TIED_OUTPUT_SKIP,
    validate_config=reject_unmapped_flags("attention_bias", "mlp_bias"),
)

QWEN2 = Family(
    name="qwen2",
    rules=LLAMA.rules + QKV_BIAS_RULES,
    hf_tensors=LLAMA.hf_tensors + QKV_BIAS_HF,
    skip=TIED_OUTPUT_SKIP,
)
