"""A minimal Megatron training step for CPU tests and the demo.

megatron-core 0.16.1's DistributedDataParallel allocates its grad buffers on
`torch.cuda.current_device()` and its pipeline schedules build tensors on
"cuda", so neither runs on CPU. This step does what they do for our layouts,
plainly: forward with labels, backward, average gradients over the data-
parallel replicas (dense parameters over DP, routed experts over expert-DP),
and an optimizer step. With PP > 1 there is no CPU pipeline schedule, so each
stage takes a real optimizer step on a stage-local loss instead (documented in
the tests that use it); the weights still change every step, which is what a
weight sync must follow.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sync.parallel import ParallelLayout


def make_optimizer(chunks: list[torch.nn.Module], lr: float = 1e-3) -> torch.optim.Optimizer:
    """Return Adam over every parameter of this rank's model chunks."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    return torch.optim.Adam(params, lr=lr)


def _reduce_replicated_tp_gradients(chunks: list[torch.nn.Module], layout: ParallelLayout) -> None:
    """Sum over TP the gradients of replicated params that see only local heads (QK layernorm).

    Megatron's finalize_model_grads does this; without it TP ranks' copies drift apart.
    """
    if layout.tp == 1:
        return
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if param.grad is None or getattr(param, "tensor_model_parallel", False):
                continue
            if getattr(param, "average_gradients_across_tp_domain", False):
                dist.all_reduce(param.grad, group=layout.tp_group)
                param.grad /= layout.tp
            elif chunk.config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(param.grad, group=layout.tp_group)


def _average_gradients(chunks: list[torch.nn.Module], layout: ParallelLayout) -> None:
    from megatron.core import parallel_state as ps

    _reduce_replicated_tp_gradients(chunks, layout)
    for chunk in chunks:
        for param in chunk.parameters():
            if param.grad is None:
                continue
            is_expert = not getattr(param, "allreduce", True)
            if is_expert and layout.edp > 1:
                group, size = ps.get_expert_data_parallel_group(), layout.edp
            elif not is_expert and layout.dp * layout.cp > 1:
                group, size = ps.get_data_parallel_group(with_context_parallel=True), layout.dp * layout.cp
            else:
                continue
            dist.all_reduce(param.grad, group=group)
            param.grad /= size


def train_step(
    chunks: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    layout: ParallelLayout,
) -> float:
    """Run one optimizer update on `tokens` [batch, seq]; return this rank's loss."""
    optimizer.zero_grad(set_to_none=True)
    if layout.pp == 1 and len(chunks) == 1:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        loss = chunks[0](tokens, positions, attention_mask=None, labels=tokens).float().mean()
    else:
        # Stage-local loss: a fixed pseudo-random direction per parameter (see module docstring).
        gen = torch.Generator().manual_seed(int(tokens.sum()))
        loss = sum(
            (p.float() * torch.randn(p.shape, generator=gen)).sum() * 1e-3
            for chunk in chunks for p in chunk.parameters()
        )
    loss.backward()
    _average_gradients(chunks, layout)
    optimizer.step()
    return float(loss.detach())
