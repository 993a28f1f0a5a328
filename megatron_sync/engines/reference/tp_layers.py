"""Tensor-parallel building blocks of the reference engine: TP linears and the group sum.

The linear layers hold only their shard (sliced by `megatron_sync.layout`, the
one place slices are computed) and talk to the engine's group only where a
partial sum must be completed (row parallel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """Return how many key/value heads one rank holds (at least one, replicated if needed)."""
    return max(1, num_kv_heads // tp_size)


def all_reduce_(tensor: torch.Tensor, group: dist.ProcessGroup | None, tp_size: int) -> torch.Tensor:
    """Sum `tensor` in place over the engine group and return it (no-op at TP=1)."""
    if tp_size > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


class ColumnParallelLinear(nn.Module):
    """A linear layer holding output rows [rank*n/tp, (rank+1)*n/tp); its output stays split."""

    def __init__(self, in_features: int, out_local: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """A linear layer holding input columns of its rank; partial outputs are summed over the group.

    The bias (whole, replicated) is added once, after the sum.
    """

    def __init__(
        self,
        in_local: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        tp_size: int,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self.group = group
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_(F.linear(x, self.weight), self.group, self.tp_size)
        return out if self.bias is None else out + self.bias
