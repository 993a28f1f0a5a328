"""Multi-token-prediction (MTP) draft layers as engines load them: Megatron's `mtp.layers.{d}` block
becomes the checkpoint's layer `num_hidden_layers + d`.

Megatron (megatron-core 0.16.1 `MultiTokenPredictionLayer`, all on the last pipeline stage) gives
each depth d: `enorm` and `hnorm` (RMSNorms of the next token's embedding and of the previous
depth's hidden state), `eh_proj` (a [hidden, 2*hidden] projection of their concatenation, embedding
first), a whole decoder layer `transformer_layer`, and `final_layernorm`; the embedding and the
output layer are the main model's. DeepSeek-V3 and GLM-4.5 checkpoints hold depth d as layer
`num_hidden_layers + d`: the decoder layer's tensors under their usual names, plus `enorm`, `hnorm`,
`eh_proj` and `shared_head.norm`. The engines' draft models (vLLM `deepseek_mtp` / `glm4_moe_mtp`,
SGLang's NextN) load exactly these names.

Left out on purpose: the checkpoint's `model.layers.{N+d}.embed_tokens` and `shared_head.head`,
copies of the main embedding and lm_head. Megatron trains one embedding and one head for both, and
the engines' MTP drafts use the main model's (vLLM's proposer shares the target's lm_head with the
draft, and its embedding when the engine runs PP=1; SGLang's EAGLE worker shares both), so syncing
the main tensors updates the draft's. A vLLM engine with PP>1 keeps a separate draft embedding,
which no sync updates.
"""

from __future__ import annotations

import dataclasses

from megatron_sync.convert.base import HFTensor, Rule, Shard, Skip
from megatron_sync.convert.families.common import H, L

DRAFT_LAYERS_KEY = "num_nextn_predict_layers"  # DeepSeek-V3 and GLM-4.5 config.json
MTP = "mtp.layers.{layer}."  # Megatron's MTP block; {layer} is the draft depth d
_T = MTP + "transformer_layer."

DRAFT_OWN_RULES = (
    Rule(MTP + "enorm.weight", H + "enorm.weight", draft=True),
    Rule(MTP + "hnorm.weight", H + "hnorm.weight", draft=True),
    Rule(MTP + "eh_proj.weight", H + "eh_proj.weight", draft=True),
    Rule(MTP + "final_layernorm.weight", H + "shared_head.norm.weight", draft=True),
)
DRAFT_HF = (
    HFTensor(H + "enorm.weight", ("hidden_size",), Shard.REPLICATED, layers="draft"),
    HFTensor(H + "hnorm.weight", ("hidden_size",), Shard.REPLICATED, layers="draft"),
    # Engines build eh_proj as a plain Linear on every rank, outside any quantization scheme.
    HFTensor(H + "eh_proj.weight", ("hidden_size", "2*hidden_size"), Shard.REPLICATED, layers="draft", linear=False),
    HFTensor(H + "shared_head.norm.weight", ("hidden_size",), Shard.REPLICATED, layers="draft"),
)
MTP_STAGE_EMBEDDING = "mtp.embedding.word_embeddings.weight"
DRAFT_SKIP = (
    Skip(MTP_STAGE_EMBEDDING, "Megatron's copy of embedding.word_embeddings.weight on a pipeline stage that holds "
         "the MTP block but not the first layer (kept equal to the first stage's; the source walk names it apart)"),
)


def draft_buffers(buffers: tuple[str, ...]) -> tuple[str, ...]:
    """Return the Megatron buffer patterns of the draft layers for a family's decoder-layer `buffers`."""
    return tuple(_T + b.removeprefix(L) for b in buffers if b.startswith(L))


def draft_rules(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """Return a family's draft rows: the MTP block's own, then every decoder-layer row of `rules`
    re-rooted under the block's `transformer_layer` (the same HF names, at layer num_hidden_layers + d)."""
    layer_rows = tuple(dataclasses.replace(r, megatron=_T + r.megatron.removeprefix(L), draft=True)
                       for r in rules if r.megatron.startswith(L))
    return DRAFT_OWN_RULES + layer_rows
