"""Qwen3 dense: Llama layout plus per-head q/k RMSNorm (`q_norm`, `k_norm`, shape [head_dim])."""

from __future__ import annotations

from megatron_sync.convert.base import Family
from megatron_sync.convert.families.common import (
    DENSE_MLP_HF, DENSE_MLP_RULES, EMBEDDING_HF, EMBEDDING_RULES, GQA_HF, GQA_RULES,
    INPUT_NORM_RULES, NORM_HF, POST_ATTENTION_NORM_RULES, QK_NORM_HF, QK_NORM_RULES,
    TIED_OUTPUT_SKIP, reject_unmapped_flags,
)


reject_attention_bias = reject_unmapped_flags("attention_bias")


QWEN3 = Family(
    name="qwen3",
    rules=EMBEDDING_RULES + INPUT_NORM_RULES + POST_ATTENTION_NORM_RULES + GQA_RULES
    + QK_NORM_RULES + DENSE_MLP_RULES,
    hf_tensors=EMBEDDING_HF + NORM_HF + GQA_HF + QK_NORM_HF + DENSE_MLP_HF,
    skip=TIED_OUTPUT_SKIP,
    validate_config=reject_attention_bias,
)
