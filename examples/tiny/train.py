"""Megatron training on CPU for the demo and the test suite: the real DDP wrapper, a torch optimizer.

What runs is Megatron's own `DistributedDataParallel` (its grad buffers
allocated on CPU by the test shim) and Megatron's `finalize_model_grads`
(data-parallel and expert-data-parallel gradient all-reduce, QK-layernorm
gradients summed over TP, tied embeddings). Two pieces of megatron-core
0.16.1 allocate on "cuda" and are replaced: its optimizer (torch Adam over
the DDP `main_grad`s instead) and its pipeline schedules (with PP > 1 each
stage takes a real optimizer step on a stage-local loss; the weights still
change every step, which is what a weight sync must follow).
"""

from __future__ import annotations

import torch

from megatron_sync.core.grid import ParallelLayout


def wrap_in_ddp(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Return the chunks wrapped in Megatron's DistributedDataParallel (plain all-reduce, no overlap)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False, overlap_grad_reduce=False)
    return [
        # Megatron buckets only the first virtual chunk's grads; the others reduce as one bucket each.
        DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def make_optimizer(chunks: list[torch.nn.Module], lr: float = 1e-3) -> torch.optim.Optimizer:
    """Return Adam over every parameter of this rank's model chunks."""
    return torch.optim.Adam([p for chunk in chunks for p in chunk.parameters()], lr=lr)


def train_step(
    chunks: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    layout: ParallelLayout,
) -> float:
    """Run one optimizer update of DDP-wrapped `chunks` on `tokens` [batch, seq]; return the loss."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    for chunk in chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)
    if layout.pp == 1 and len(chunks) == 1:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        loss = chunks[0](tokens, positions, None, labels=tokens).float().mean()
    else:
        # Stage-local loss: a fixed pseudo-random direction per parameter (see module docstring).
        gen = torch.Generator().manual_seed(int(tokens.sum()))
        loss = sum(
            (p.float() * torch.randn(p.shape, generator=gen)).sum() * 1e-3
            for chunk in chunks for p in chunk.parameters()
        )
    loss.backward()
    finalize_model_grads(chunks)
    for chunk in chunks:
        for param in chunk.parameters():
            param.grad = param.main_grad
    optimizer.step()
    return float(loss.detach())
