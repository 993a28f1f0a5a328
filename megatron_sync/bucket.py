"""Buckets: flat uint8 bytes laid out by the plan, plus a checksum.

Layout (SGLang's `flattened_bucket`, vLLM's packed format): the raw bytes of
each tensor, `t.contiguous().view(-1).view(torch.uint8)`, at its plan offset.
Checksum: CRC-32 (zlib.crc32) over the bucket's bytes, computed on a zero-copy
numpy view of host memory; an unsigned 32-bit value carried in an int64 header.
"""

from __future__ import annotations

import zlib

import torch

from megatron_sync.plan import BucketPlan, PlanEntry


def checksum(data: torch.Tensor) -> int:
    """Return the CRC-32 of a flat uint8 tensor's bytes (copied to host first if on a device)."""
    assert data.dtype == torch.uint8 and data.dim() == 1, (data.dtype, data.shape)
    host = data if data.device.type == "cpu" else data.cpu()
    return zlib.crc32(memoryview(host.contiguous().numpy())) & 0xFFFFFFFF


def entry_view(data: torch.Tensor, entry: PlanEntry) -> torch.Tensor:
    """Return the typed, shaped view of `entry` inside the bucket bytes `data` (no copy)."""
    raw = data[entry.offset: entry.offset + entry.nbytes]
    return raw.view(entry.dtype).view(entry.shape)


def pack_tensor(data: torch.Tensor, entry: PlanEntry, tensor: torch.Tensor) -> None:
    """Copy `tensor` into its slot; raise ValueError naming the tensor on shape/dtype mismatch."""
    if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
        raise ValueError(
            f"tensor {entry.name!r}: got shape {tuple(tensor.shape)} dtype {tensor.dtype}, "
            f"the plan expects shape {entry.shape} dtype {entry.dtype}; the stream and its "
            "metadata() disagree"
        )
    entry_view(data, entry).copy_(tensor, non_blocking=True)


def unpack(data: torch.Tensor, bucket: BucketPlan) -> dict[str, torch.Tensor]:
    """Return {name: typed view into `data`} for every entry of `bucket` (views, not copies)."""
    if data.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index}: {data.numel()} bytes received, plan says {bucket.nbytes}")
    return {e.name: entry_view(data, e) for e in bucket.entries}


def flatten(tensors: list[tuple[PlanEntry, torch.Tensor]], nbytes: int) -> torch.Tensor:
    """Return a new bucket holding `tensors` at their plan offsets (a convenience for tests/tools)."""
    data = torch.empty(nbytes, dtype=torch.uint8)
    for entry, tensor in tensors:
        pack_tensor(data, entry, tensor)
    return data
