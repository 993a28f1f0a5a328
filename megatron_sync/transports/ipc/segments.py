"""The persistent shared buffers of the `ipc` transport: one segment per trainer stage source, two slots.

A stage source creates its segment once per run, sized for two of its stage's
largest buckets, and writes bucket k into slot k % 2; the inference ranks on
the same host map it once and read each bucket where it lies. Two kinds:

- `HostSegment` (CPU): a POSIX shared-memory file under /dev/shm, its pages
  reserved when it is created (`posix_fallocate`, so a full /dev/shm is an
  error at start-up, never a SIGBUS mid-sync), mapped with mmap. The name is
  unlinked as soon as every rank mapped it (`IpcTransport`), so nothing is
  left in /dev/shm once the run's processes end, however they end.
- `CudaSegment` (GPU): one device buffer and one CUDA IPC handle for the
  whole run (opening a handle per bucket or per tensor costs seconds per sync,
  and rotating them races the allocator's reclamation); written behind the
  `gpu` test marker.

`SegmentInfo` is what the creator posts on the control channel: where the
segment is, how large each slot is, and a random token written into the
segment's header, which a rank checks after mapping it (a same-named segment
of another host's /dev/shm, or a stale one, is refused).
"""

from __future__ import annotations

import base64
import errno
import json
import mmap
import os
import shutil
import socket
from dataclasses import asdict, dataclass
from typing import Optional, Union

import torch

SEGMENT_DIR = "/dev/shm"
NAME_PREFIX = "megatron_sync-ipc-"
SLOTS = 2
HEADER_BYTES = 4096  # the token, then the slots at page-aligned offsets
_MAGIC = b"megatron-sync-ipc\0"


def _align(nbytes: int, to: int = 4096) -> int:
    return max(to, -(-nbytes // to) * to)


@dataclass(frozen=True)
class SegmentInfo:
    """Where stage `stage`'s segment is and how to check it (posted by its creator)."""

    kind: str  # "host" | "cuda"
    name: str
    stage: int
    slot_bytes: int
    token: str
    host: str
    handle: Optional[str] = None  # cuda: torch's IPC handle of the buffer, base64

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "SegmentInfo":
        return cls(**json.loads(raw.decode()))

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + SLOTS * self.slot_bytes


def segment_name(session_id: str, stage: int, token: str) -> str:
    """Return the /dev/shm name of stage `stage`'s segment in session `session_id`."""
    return f"{NAME_PREFIX}{session_id}-stage{stage}-{token[:8]}"


def slot_bytes_for(bucket_nbytes: int) -> int:
    """Return the bytes of one slot holding buckets of up to `bucket_nbytes` (page-aligned)."""
    return _align(bucket_nbytes)


class HostSegment:
    """A mapped /dev/shm file: a header with the token, then `SLOTS` slots of `info.slot_bytes`."""

    def __init__(self, info: SegmentInfo, mapping: mmap.mmap, *, owner: bool) -> None:
        self.info, self.owner = info, owner
        self._mapping = mapping
        self._memory: Optional[torch.Tensor] = torch.frombuffer(mapping, dtype=torch.uint8)
        self.nbytes = info.nbytes

    @classmethod
    def create(cls, name: str, stage: int, slot_bytes: int, token: str) -> "HostSegment":
        """Create, reserve and map a new segment; OSError names /dev/shm's free space when it does not fit."""
        info = SegmentInfo("host", name, stage, slot_bytes, token, socket.gethostname())
        path = os.path.join(SEGMENT_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, info.nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    free = shutil.disk_usage(SEGMENT_DIR).free
                    raise OSError(e.errno, f"cannot reserve {info.nbytes} bytes of shared memory for trainer stage "
                                  f"{stage} under {SEGMENT_DIR} ({free} bytes free): enlarge it (docker "
                                  "--shm-size) or lower weight_sync.bucket_size_mb") from None
                raise
            mapping = mmap.mmap(fd, info.nbytes)
        except BaseException:
            os.close(fd)
            _unlink(name)
            raise
        os.close(fd)
        mapping[: len(_MAGIC) + 32] = _MAGIC + token.encode()[:32].ljust(32, b"\0")
        return cls(info, mapping, owner=True)

    @classmethod
    def attach(cls, info: SegmentInfo) -> "HostSegment":
        """Map the segment `info` names; ValueError when it is not that segment (another host's, a stale one)."""
        path = os.path.join(SEGMENT_DIR, info.name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ValueError(
                f"trainer stage {info.stage}'s shared-memory segment {path} does not exist here (host "
                f"{socket.gethostname()}; the trainer created it on host {info.host}): transport 'ipc' needs every "
                "inference rank on the trainer's host, sharing its /dev/shm (containers: --ipc=host); use "
                "transport 'broadcast' or 'p2p' across hosts") from None
        try:
            size = os.fstat(fd).st_size
            if size != info.nbytes:
                raise ValueError(f"{path} holds {size} bytes, trainer stage {info.stage} posted {info.nbytes}")
            mapping = mmap.mmap(fd, info.nbytes)
        finally:
            os.close(fd)
        if bytes(mapping[: len(_MAGIC) + 32]) != _MAGIC + info.token.encode()[:32].ljust(32, b"\0"):
            mapping.close()
            raise ValueError(f"{path} is not trainer stage {info.stage}'s segment of this session (token differs): "
                             f"a stale or foreign segment of the same name")
        return cls(info, mapping, owner=False)

    def slot(self, index: int) -> torch.Tensor:
        """Return slot `index` as a flat uint8 tensor over the shared pages (no copy)."""
        start = HEADER_BYTES + index * self.info.slot_bytes
        return self._memory[start: start + self.info.slot_bytes]

    def unlink(self) -> None:
        """Remove the segment's name (mappings stay valid; the pages go when the last one closes)."""
        _unlink(self.info.name)

    def close(self) -> None:
        """Unmap (once no view of it is alive; else when the last view goes); safe to call twice."""
        self._memory = None
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass  # a view is still referenced: the mapping goes with it
            self._mapping = None


class CudaSegment:
    """One device buffer shared through one CUDA IPC handle for the run (GPU; `gpu` marker).

    The handle is the buffer's storage as torch shares it (`_share_cuda_`: device, handle, size, offset,
    torch's cross-process reference counter and event), carried as JSON; the opener gets the very
    allocation, so the producer keeps the buffer for the whole run and each rank opens it once.
    """

    def __init__(self, info: SegmentInfo, memory: torch.Tensor, *, owner: bool) -> None:
        self.info, self.owner, self._memory = info, owner, memory
        self.nbytes = info.nbytes

    @classmethod
    def create(cls, name: str, stage: int, slot_bytes: int, token: str, device: torch.device) -> "CudaSegment":
        """Allocate the buffer on `device` and export its handle (once)."""
        info = SegmentInfo("cuda", name, stage, slot_bytes, token, socket.gethostname())
        memory = torch.zeros(info.nbytes, dtype=torch.uint8, device=device)
        shared = memory.untyped_storage()._share_cuda_()
        handle = json.dumps([base64.b64encode(x).decode() if isinstance(x, bytes) else x for x in shared])
        return cls(SegmentInfo(**{**asdict(info), "handle": handle}), memory, owner=True)

    @classmethod
    def attach(cls, info: SegmentInfo) -> "CudaSegment":
        """Open the handle once; ValueError when it cannot be opened here (another host, another GPU)."""
        fields = json.loads(info.handle or "null")
        if not isinstance(fields, list) or len(fields) != 8:
            raise ValueError(f"trainer stage {info.stage} posted no CUDA IPC handle")
        binary = (1, 4, 6)  # the handle, the reference counter's file name, the event handle
        shared = [base64.b64decode(x) if i in binary and x is not None else x for i, x in enumerate(fields)]
        try:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(*shared)
        except RuntimeError as e:
            raise ValueError(f"cannot open trainer stage {info.stage}'s CUDA IPC handle here (host "
                             f"{socket.gethostname()}, trainer on {info.host}): {e}") from e
        memory = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (info.nbytes,), (1,))
        return cls(info, memory, owner=False)

    def slot(self, index: int) -> torch.Tensor:
        """Return slot `index` as a flat uint8 view of the device buffer."""
        start = HEADER_BYTES + index * self.info.slot_bytes
        return self._memory[start: start + self.info.slot_bytes]

    def unlink(self) -> None:
        """Nothing to unlink: the handle goes with the buffer."""

    def close(self) -> None:
        """Drop the buffer (an opener also lets torch release the producer's reference counter)."""
        if self._memory is not None:
            self._memory = None
            if not self.owner:
                torch.cuda.ipc_collect()


Segment = Union[HostSegment, CudaSegment]


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SEGMENT_DIR, name))
    except FileNotFoundError:
        pass


def leftover_segments(session_id: Optional[str] = None) -> list[str]:
    """Return the names of this project's segments in /dev/shm (of one session when given)."""
    prefix = NAME_PREFIX + (f"{session_id}-" if session_id else "")
    try:
        return sorted(n for n in os.listdir(SEGMENT_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def unlink_session_segments(session_id: str) -> list[str]:
    """Remove every segment name of session `session_id` left in /dev/shm; return the names removed."""
    names = leftover_segments(session_id)
    for name in names:
        _unlink(name)
    return names
