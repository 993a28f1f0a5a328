"""The trainer's own scores of a token sequence: Megatron's forward over its chunks, every stage in turn.

What the canary check compares an engine's log-probabilities with. Eval mode, no gradients; the hidden
states walk the pipeline stages in Megatron's order (chunk v of stage 0, 1, ..., then chunk v + 1) over plain
point-to-point sends on the pipeline group, the last stage's logits go to every stage, and the
vocabulary-parallel logits are gathered over TP. Collective over the trainer job: every rank calls it with
the same tokens and gets the same scores.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_sync.core.grid import ParallelLayout


def _model(chunk: Any) -> Any:
    """Return the GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _stage_logits(chunks: list, layout: ParallelLayout, tokens: torch.Tensor) -> torch.Tensor:
    """Return the last stage's local logits [B, S, V/tp] on every rank of the pipeline."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    models = [_model(c) for c in chunks]
    if layout.pp == 1 and len(models) == 1:
        return models[0](input_ids=tokens, position_ids=positions, attention_mask=None)
    group, rank, pp = layout.pp_group, layout.pp_rank, layout.pp
    members = dist.get_process_group_ranks(group)
    hidden_shape = (tokens.shape[1], tokens.shape[0], models[0].config.hidden_size)  # [seq, batch, hidden]
    logits = None
    for model in models:
        if not model.pre_process:
            hidden = torch.empty(hidden_shape, dtype=model.config.params_dtype, device=tokens.device)
            dist.recv(hidden, src=members[(rank - 1) % pp], group=group)
            model.set_input_tensor(hidden)
        out = model(input_ids=tokens, position_ids=positions, attention_mask=None)
        if model.post_process:
            logits = out
        else:
            dist.send(out.contiguous(), dst=members[(rank + 1) % pp], group=group)
    shape = torch.tensor(list(logits.shape) if logits is not None else [0, 0, 0], device=tokens.device)
    dist.broadcast(shape, src=members[-1], group=group)
    if logits is None:
        logits = torch.empty(tuple(shape.tolist()), dtype=models[0].config.params_dtype, device=tokens.device)
    dist.broadcast(logits.contiguous(), src=members[-1], group=group)
    return logits


@torch.no_grad()
def token_logprobs(chunks: list, layout: ParallelLayout, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Return log p(token i + 1 | tokens 0..i) for every position of `tokens` [S] (float32, [S - 1]), from
    Megatron's forward over `chunks` (collective; see the module doc). `vocab_size` trims the padded vocabulary."""
    models = [_model(c) for c in chunks]
    training = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        device = next(models[0].parameters()).device
        batch = tokens.to(device).view(1, -1)
        logits = _stage_logits(chunks, layout, batch)
        if layout.tp > 1:
            pieces = [torch.empty_like(logits) for _ in range(layout.tp)]
            dist.all_gather(pieces, logits.contiguous(), group=layout.tp_group)
            logits = torch.cat(pieces, dim=-1)
        logp = torch.log_softmax(logits[0, :-1, :vocab_size].float(), dim=-1)
        return logp.gather(-1, batch[0, 1:].view(-1, 1)).view(-1).cpu()
    finally:
        for m, was in zip(models, training):
            m.train(was)
