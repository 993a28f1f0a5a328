"""The reference engine's draft (multi-token-prediction) layers: held next to transformers' model and run.

transformers' DeepSeek-V3 and GLM-4.5 models drop a checkpoint's draft layers. The reference engine
builds the model with them as extra decoder layers past `num_hidden_layers` (transformers' own layer
class at that index: MLA or GQA, dense or MoE as the config says) and gives each the draft's own
modules under the checkpoint's names (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`). So every
draft tensor has a place in memory under its checkpoint name and is sharded like a main layer's,
while the main forward still runs the main layers only (transformers iterates
`layers[:num_hidden_layers]`).

`draft_logits` is the MTP forward as Megatron trains it and vLLM's `deepseek_mtp` / `glm4_moe_mtp`
run it: depth d combines the previous depth's hidden state h_i (depth 0: the main model's
final-norm output) with the embedding of the token d + 1 places ahead,
`eh_proj([enorm(embedding); hnorm(h)])`, runs the draft decoder layer over the sequence (causal,
the same positions), normalizes with `shared_head.norm` (which is also the next depth's h), and
reads logits through the main lm_head. Like Megatron, positions past the end see token id 0; vLLM
additionally zeroes the embedding at position 0, which this forward does not.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def build_causal_lm(config: Any, *, dtype: torch.dtype, draft_layers: int = 0) -> nn.Module:
    """Return transformers' causal LM of `config` with `draft_layers` draft layers after the main ones
    (build it under `torch.device("meta")` to allocate nothing)."""
    from transformers import AutoModelForCausalLM

    if draft_layers == 0:
        return AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager")
    main = config.num_hidden_layers
    longer = copy.deepcopy(config)
    longer.num_hidden_layers = main + draft_layers
    model = AutoModelForCausalLM.from_config(longer, dtype=dtype, experts_implementation="eager")
    model.config.num_hidden_layers = main  # the main forward (and its KV cache) covers the main layers only
    hidden, eps = config.hidden_size, config.rms_norm_eps
    norm = type(model.model.norm)
    for layer in model.model.layers[main:]:
        layer.enorm, layer.hnorm = norm(hidden, eps=eps), norm(hidden, eps=eps)
        layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False, dtype=dtype)
        layer.shared_head = nn.Module()
        layer.shared_head.norm = norm(hidden, eps=eps)
    return model


@torch.no_grad()
def draft_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Return the draft layers' logits [depth, B, S, V] for `tokens` [B, S] (see the module docstring)."""
    from transformers.masking_utils import create_causal_mask

    inner = model.model
    drafts = inner.layers[model.config.num_hidden_layers:]
    if len(drafts) == 0:
        raise ValueError("this model holds no draft layers (its HF config declares none, or the engine was built "
                         "with draft=False)")
    hidden = inner(input_ids=tokens, use_cache=False).last_hidden_state
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    ahead, logits = tokens, []
    for layer in drafts:
        ahead = torch.cat([ahead[:, 1:], torch.zeros_like(ahead[:, :1])], dim=1)
        x = layer.eh_proj(torch.cat([layer.enorm(inner.embed_tokens(ahead)), layer.hnorm(hidden)], dim=-1))
        mask = create_causal_mask(config=inner.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=positions)
        x = layer(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=inner.rotary_emb(x, positions))
        hidden = layer.shared_head.norm(x)
        logits.append(model.lm_head(hidden))
    return torch.stack(logits)
