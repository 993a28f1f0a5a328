"""The host replica on a stage source: this stage's bucket buffers, allocated once.

Every sync reuses the same buffers (pinned when CUDA is available). A tensor's
slot is a typed view into its bucket; the stream converts each tensor
straight into its slot (`slot(name)`), so producing a bucket costs one write
per byte. The replica is tagged with the version it holds; a bucket being
refilled for a new version is not complete until every one of its entries
has been packed again.

Where buckets are produced (`device`):

- the host (gloo): slots are views of the host buffers, which are also what
  goes on the wire;
- a GPU (NCCL): slots are views of a device bucket buffer taken from a small
  pool when the bucket's first tensor is written. The bucket is broadcast from
  that device buffer, and its host copy is filled from it on a side stream
  (`fill_host`) while the wire and the next buckets proceed; the device buffer
  returns to the pool once its broadcast and its host copy are done
  (`release`). Device memory: one buffer per bucket being filled or in
  flight (two or three unless keep-together groups span buckets), each at most
  the largest bucket.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_sync.plan.bucket import check_fits, entry_view, pack_tensor
from megatron_sync.core.meta import FlatEntry
from megatron_sync.plan.buckets import BucketPlan, SyncPlan


class HostReplica:
    """Bucket buffers of one stage: convert into slots, read whole buckets out."""

    def __init__(self, plan: SyncPlan, stage: int, *, pin_memory: Optional[bool] = None,
                 device: Optional[torch.device] = None) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.stage = stage
        self.buckets: tuple[BucketPlan, ...] = plan.for_stage(stage)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._buffers = {
            b.index: torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=pin_memory) for b in self.buckets
        }
        self._slot: dict[str, tuple[BucketPlan, FlatEntry]] = {
            e.name: (b, e) for b in self.buckets for e in b.entries
        }
        self._missing: dict[int, set[str]] = {}
        # Set when a device tensor was copied in asynchronously: host reads must sync first.
        self._device_copies_pending = False
        self._device = _DeviceBuckets(self.device, self._buffers) if self.device.type == "cuda" else None
        self.version = 0  # version of the weights the buffers hold (0: none yet)
        self._filling: Optional[int] = None

    @property
    def nbytes(self) -> int:
        """Host bytes the replica holds (the stage's inference-format weights)."""
        return sum(b.nbytes for b in self.buckets)

    def begin(self, version: int) -> None:
        """Start refilling every bucket for `version`."""
        self._filling = version
        self._missing = {b.index: {e.name for e in b.entries} for b in self.buckets}
        if self._device is not None:
            self._device.reset()  # buffers a failed sync left behind

    def _entry(self, name: str) -> tuple[BucketPlan, FlatEntry]:
        if name not in self._slot:
            raise ValueError(
                f"tensor {name!r} is not in stage {self.stage}'s plan; the stream yields a "
                "tensor its metadata() did not list"
            )
        return self._slot[name]

    def slot(self, name: str) -> Optional[torch.Tensor]:
        """Return the typed view to convert `name` into for the version being filled (None: not planned)."""
        if name not in self._slot:
            return None
        bucket, entry = self._slot[name]
        if self._device is not None:
            return entry_view(self._device.buffer(bucket), entry)
        return entry_view(self._buffers[bucket.index], entry)

    def pack(self, name: str, tensor: torch.Tensor) -> BucketPlan:
        """Put `tensor` into its slot (no copy when it was converted there) and return its bucket."""
        bucket, entry = self._entry(name)
        if name not in self._missing[bucket.index]:
            raise ValueError(
                f"tensor {name!r} was yielded twice for version {self._filling}; each tensor "
                "must be yielded exactly once per sync"
            )
        if self._device is not None:
            check_fits(entry, tensor)
            pack_tensor(self._device.buffer(bucket), entry, tensor.to(self.device, non_blocking=True))
        else:
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

    def payload(self, index: int) -> torch.Tensor:
        """Return the bytes of bucket `index` to put on the wire: the device bucket when buckets are
        produced on a GPU, else the host buffer."""
        if self._device is not None and self._device.holds(index):
            return self._device.payload(index)
        return self.data(index)

    def fill_host(self, index: int) -> None:
        """Start copying a complete device bucket into its host buffer on the side stream (no-op on the host)."""
        if self._device is not None and self._device.holds(index):
            self._device.fill_host(index)

    def release(self, index: int) -> None:
        """Give bucket `index`'s device buffer back to the pool once its broadcast has been waited for."""
        if self._device is not None and self._device.holds(index):
            self._device.release(index)

    def data(self, index: int) -> torch.Tensor:
        """Return the flat uint8 host buffer of bucket `index`, with every pending device copy landed."""
        if self._device is not None:
            self._device.host_ready(index)
        if self._device_copies_pending:
            torch.cuda.current_stream().synchronize()
            self._device_copies_pending = False
        return self._buffers[index]

    def view(self, name: str) -> torch.Tensor:
        """Return the typed view of tensor `name` inside its host bucket buffer."""
        bucket, entry = self._slot[name]
        return entry_view(self.data(bucket.index), entry)


class _DeviceBuckets:
    """Device bucket buffers of a replica produced on a GPU: a pool, a side stream, fill events."""

    def __init__(self, device: torch.device, host: dict[int, torch.Tensor]) -> None:
        self.device, self._host = device, host
        self._capacity = max((t.numel() for t in host.values()), default=0)
        self._free: list[tuple[torch.Tensor, Optional[torch.cuda.Event]]] = []
        self._in_use: dict[int, torch.Tensor] = {}
        self._filled: dict[int, torch.cuda.Event] = {}
        self._side = torch.cuda.Stream(device=device)

    def holds(self, index: int) -> bool:
        return index in self._in_use

    def buffer(self, bucket: BucketPlan) -> torch.Tensor:
        """Return bucket's device buffer, taking one from the pool on first use."""
        if bucket.index not in self._in_use:
            if self._free:
                buf, last_fill = self._free.pop()
                if last_fill is not None:  # its previous bucket's host copy must have read it
                    torch.cuda.current_stream(self.device).wait_event(last_fill)
            else:
                buf = torch.empty(self._capacity, dtype=torch.uint8, device=self.device)
            self._in_use[bucket.index] = buf
        return self._in_use[bucket.index][: bucket.nbytes]

    def payload(self, index: int) -> torch.Tensor:
        return self._in_use[index][: self._host[index].numel()]

    def fill_host(self, index: int) -> None:
        """Copy the device bucket to its pinned host buffer on the side stream, after the producing work."""
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            self._host[index].copy_(self.payload(index), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._side)
        self._filled[index] = event

    def release(self, index: int) -> None:
        """Return the buffer to the pool (reused only after its host copy, see `buffer`)."""
        self._free.append((self._in_use.pop(index), self._filled.get(index)))

    def reset(self) -> None:
        """Return every buffer to the pool once all work on them is done."""
        if self._in_use:
            torch.cuda.current_stream(self.device).synchronize()
            self._side.synchronize()
            self._free.extend((buf, None) for buf in self._in_use.values())
            self._in_use.clear()
            self._filled.clear()

    def host_ready(self, index: int) -> None:
        """Block until bucket `index`'s host copy has landed."""
        event = self._filled.pop(index, None)
        if event is not None:
            event.synchronize()
