"""Buckets: flat uint8 bytes laid out by the plan (checksums: `megatron_sync.core.checksum`).

Layout (SGLang's `flattened_bucket`, vLLM's packed format): the raw bytes of
each tensor, `t.contiguous().view(-1).view(torch.uint8)`, at its plan offset.
"""

from __future__ import annotations

import torch

from megatron_sync.core.meta import FlatEntry
from megatron_sync.plan.buckets import BucketPlan


def entry_view(data: torch.Tensor, entry: FlatEntry) -> torch.Tensor:
    """Return the typed, shaped view of `entry` inside the bucket bytes `data` (no copy)."""
    raw = data[entry.offset: entry.offset + entry.nbytes]
    return raw.view(entry.dtype).view(entry.shape)


def check_fits(entry: FlatEntry, tensor: torch.Tensor) -> None:
    """Raise ValueError naming the tensor unless it has the entry's shape and dtype."""
    if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
        raise ValueError(
            f"tensor {entry.name!r}: got shape {tuple(tensor.shape)} dtype {tensor.dtype}, "
            f"the plan expects shape {entry.shape} dtype {entry.dtype}; the stream and its "
            "metadata() disagree"
        )


def pack_tensor(data: torch.Tensor, entry: FlatEntry, tensor: torch.Tensor) -> None:
    """Copy `tensor` into its slot (nothing to copy when it is the slot itself)."""
    check_fits(entry, tensor)
    slot = entry_view(data, entry)
    if tensor.data_ptr() == slot.data_ptr() and tensor.device == slot.device and tensor.is_contiguous():
        return  # converted straight into the bucket
    slot.copy_(tensor, non_blocking=True)


def unpack(data: torch.Tensor, bucket: BucketPlan) -> dict[str, torch.Tensor]:
    """Return {name: typed view into `data`} for every entry of `bucket` (views, not copies)."""
    if data.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index}: {data.numel()} bytes received, plan says {bucket.nbytes}")
    return {e.name: entry_view(data, e) for e in bucket.entries}


def flatten(tensors: list[tuple[FlatEntry, torch.Tensor]], nbytes: int) -> torch.Tensor:
    """Return a new bucket holding `tensors` at their plan offsets (a convenience for tests/tools)."""
    data = torch.empty(nbytes, dtype=torch.uint8)
    for entry, tensor in tensors:
        pack_tensor(data, entry, tensor)
    return data
