"""Tensor-parallel building blocks of the reference engine: pure shard slicing and TP linears.

Slicing functions take the full tensor and the rank's position and no process
group, so they are testable without processes. The linear layers hold only
their shard and talk to the engine's group only where a partial sum must be
completed (row parallel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def even_range(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Return [start, stop) of chunk `tp_rank` of `tp_size` equal contiguous chunks of `size` indices."""
    assert size % tp_size == 0, f"size {size} does not divide by tp {tp_size}"
    step = size // tp_size
    return tp_rank * step, (tp_rank + 1) * step


def kv_head_range(rows: int, num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Return [start, stop) of this rank's key/value head rows among `rows` = heads * head_dim.

    With more ranks than heads, each head is replicated on tp_size / num_kv_heads
    consecutive ranks, the way vLLM and SGLang shard GQA.
    """
    if num_kv_heads % tp_size == 0:
        return even_range(rows, tp_rank, tp_size)
    assert tp_size % num_kv_heads == 0, (num_kv_heads, tp_size)
    return even_range(rows, tp_rank // (tp_size // num_kv_heads), num_kv_heads)


def split_even(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Return chunk `tp_rank` of `tp_size` equal contiguous chunks of `full` along `dim` (a view)."""
    start, stop = even_range(full.shape[dim], tp_rank, tp_size)
    return full.narrow(dim, start, stop - start)


def split_kv_heads(
    full: torch.Tensor, num_kv_heads: int, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """Return this rank's key/value heads of `full` (dim 0 = heads * head_dim); see `kv_head_range`."""
    start, stop = kv_head_range(full.shape[0], num_kv_heads, tp_rank, tp_size)
    return full.narrow(0, start, stop - start)


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
