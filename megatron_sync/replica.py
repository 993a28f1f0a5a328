"""The host replica on a stage source: this stage's bucket buffers, allocated once.

Every sync reuses the same buffers (pinned when CUDA is available, so the
device copy of the NCCL path is asynchronous). A tensor's slot is a typed view
into its bucket's buffer. The replica is tagged with the version it holds; a
bucket being refilled for a new version is not complete until every one of its
entries has been packed again.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_sync.bucket import checksum, entry_view, pack_tensor
from megatron_sync.plan import BucketPlan, PlanEntry, SyncPlan


class HostReplica:
    """Bucket buffers of one stage: pack converted tensors into them, read whole buckets out."""

    def __init__(self, plan: SyncPlan, stage: int, *, pin_memory: Optional[bool] = None) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.stage = stage
        self.buckets: tuple[BucketPlan, ...] = plan.for_stage(stage)
        self._buffers = {
            b.index: torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=pin_memory) for b in self.buckets
        }
        self._slot: dict[str, tuple[BucketPlan, PlanEntry]] = {
            e.name: (b, e) for b in self.buckets for e in b.entries
        }
        self._missing: dict[int, set[str]] = {}
        # Set when a device tensor was copied in asynchronously: host reads must sync first.
        self._device_copies_pending = False
        self.version = 0  # version of the weights the buffers hold (0: none yet)
        self._filling: Optional[int] = None

    def begin(self, version: int) -> None:
        """Start refilling every bucket for `version`."""
        self._filling = version
        self._missing = {b.index: {e.name for e in b.entries} for b in self.buckets}

    def pack(self, name: str, tensor: torch.Tensor) -> BucketPlan:
        """Copy `tensor` into its slot and return the bucket it belongs to."""
        if name not in self._slot:
            raise ValueError(
                f"tensor {name!r} is not in stage {self.stage}'s plan; the stream yields a "
                "tensor its metadata() did not list"
            )
        bucket, entry = self._slot[name]
        if name not in self._missing[bucket.index]:
            raise ValueError(
                f"tensor {name!r} was yielded twice for version {self._filling}; each tensor "
                "must be yielded exactly once per sync"
            )
        pack_tensor(self._buffers[bucket.index], entry, tensor)
        self._device_copies_pending |= tensor.device.type == "cuda"
        self._missing[bucket.index].discard(name)
        return bucket

    def is_complete(self, index: int) -> bool:
        """Return True when every entry of bucket `index` holds the version being filled."""
        return not self._missing[index]

    def missing(self) -> list[str]:
        """Return the names not yet packed for the version being filled."""
        return sorted(n for names in self._missing.values() for n in names)

    def finish(self) -> None:
        """Mark the replica as holding the version being filled (every bucket complete)."""
        assert self._filling is not None and not self.missing(), self.missing()
        self.version, self._filling = self._filling, None

    def data(self, index: int) -> torch.Tensor:
        """Return the flat uint8 buffer of bucket `index`, with every pending device copy landed."""
        if self._device_copies_pending:
            torch.cuda.current_stream().synchronize()
            self._device_copies_pending = False
        return self._buffers[index]

    def view(self, name: str) -> torch.Tensor:
        """Return the typed view of tensor `name` inside its bucket buffer."""
        bucket, entry = self._slot[name]
        return entry_view(self._buffers[bucket.index], entry)

    def checksum(self, index: int) -> int:
        """Return the CRC-32 of bucket `index`."""
        return checksum(self.data(index))
