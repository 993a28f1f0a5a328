"""The reader's host-local copy: two memory-mapped safetensors files and an atomic pointer to one.

    <local>/slot-a.safetensors   one complete version (any safetensors loader can read it)
    <local>/slot-b.safetensors   the other one: where the next version is staged
    <local>/state.json           {version, state_digest, slot}: which slot is committed
    <local>/applier.lock         one applier per host

A new version is decoded into the slot that is not committed and verified
there; committing flushes that slot and then replaces `state.json`. The
committed slot is never written, so a failure at any point leaves the host on
its previous version. Slots are preallocated when created, so staging never
grows a file (no "disk full" halfway through an apply). Tensors are laid out
widest element first, so every tensor starts at an address aligned to its
element size (the header is padded to 8 bytes).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import warnings
from typing import Optional

import numpy as np
import torch

import megatron_sync.transports.disk_delta.fsio as fsio
from megatron_sync.transports.disk_delta.chain import Held
from megatron_sync.transports.disk_delta.errors import CorruptFileError
from megatron_sync.transports.disk_delta.manifest import TORCH_DTYPES, TensorEntry

SLOTS = ("a", "b")
STATE = "state.json"


def slot_path(local_dir: str, slot: str) -> str:
    """Return the safetensors file of `slot` ("a" or "b")."""
    return os.path.join(local_dir, f"slot-{slot}.safetensors")


def other_slot(slot: Optional[str]) -> str:
    """Return the slot that is not `slot` ("a" when there is none yet)."""
    return "b" if slot == "a" else "a"


def _header(entries: tuple[TensorEntry, ...]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Return the safetensors header bytes and each tensor's (start, end) relative to the data section."""
    ordered = sorted(range(len(entries)), key=lambda i: -entries[i].itemsize)  # stable: widest first
    header, spans, offset = {"__metadata__": {"format": "pt"}}, {}, 0
    for i in ordered:
        entry = entries[i]
        spans[entry.name] = (offset, offset + entry.nbytes)
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": list(spans[entry.name])}
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, spans


class SlotFile:
    """One safetensors file of the local copy, memory-mapped; tensors are views into the mapping."""

    def __init__(self, path: str, writable: bool):
        self.path = path
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        self._data_start = 8 + length
        self.layout = {name: (TORCH_DTYPES[h["dtype"]], tuple(h["shape"]), *h["data_offsets"])
                       for name, h in header.items()}
        self._file = open(path, "r+b" if writable else "rb")
        size = os.fstat(self._file.fileno()).st_size
        self._map = mmap.mmap(self._file.fileno(), size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, path: str, entries: tuple[TensorEntry, ...]) -> "SlotFile":
        """Create (or replace) a preallocated slot file holding `entries`, zero-filled."""
        head, spans = _header(entries)
        total = len(head) + max((end for _, end in spans.values()), default=0)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(head)
            try:
                os.posix_fallocate(f.fileno(), 0, max(total, 1))
            except (OSError, AttributeError) as exc:  # AttributeError: no posix_fallocate (macOS)
                if isinstance(exc, OSError) and exc.errno != errno.EOPNOTSUPP:
                    raise
                f.truncate(total)  # without fallocate the file is sparse, allocated on first write
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return cls(path, writable=True)

    def matches(self, entries: tuple[TensorEntry, ...]) -> bool:
        """Return True when this file holds exactly `entries` (names, dtypes, shapes)."""
        return self.layout.keys() == {e.name for e in entries} and all(
            self.layout[e.name][:2] == (TORCH_DTYPES[e.dtype], tuple(e.shape)) for e in entries)

    def bytes_of(self, name: str) -> np.ndarray:
        """Return the bytes of tensor `name` (a writable view when the file was opened writable)."""
        _, _, start, end = self.layout[name]
        return self._bytes[self._data_start + start: self._data_start + end]

    def tensor(self, name: str) -> torch.Tensor:
        """Return tensor `name` as a view into the mapping (valid while this slot is not restaged)."""
        dtype, shape, start, end = self.layout[name]
        if end == start:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            # A read-only mapping (another rank's view of the applier's file): torch warns that the
            # buffer is not writable. Readers only copy from these views (load_shards), never write.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._map, dtype=dtype, count=(end - start) // dtype.itemsize,
                                    offset=self._data_start + start)
        return flat.view(shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Return every tensor as a view, by name."""
        return {name: self.tensor(name) for name in self.layout}

    def flush(self) -> None:
        """Write the mapping's dirty pages to the file and fsync it."""
        self._map.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Unmap and close (the mapping stays alive while tensor views of it exist)."""
        self._bytes = None
        try:
            self._map.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes when they do
        self._file.close()


def read_state(local_dir: str) -> tuple[Optional[Held], Optional[str]]:
    """Return what the committed local copy holds and its slot, or (None, None) when there is none."""
    path = os.path.join(local_dir, STATE)
    try:
        with open(path) as f:
            obj = json.load(f)
        return Held(int(obj["version"]), obj["state_digest"]), obj["slot"]
    except FileNotFoundError:
        return None, None
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(f"{path} is corrupt ({exc}); delete the local directory {local_dir} and the "
                               "reader rebuilds it from the newest snapshot") from None


def write_state(local_dir: str, held: Held, slot: str) -> None:
    """Point the local copy at `slot`, holding `held` (atomic)."""
    fsio.write_json_atomic(os.path.join(local_dir, STATE),
                           {"version": held.version, "state_digest": held.state_digest, "slot": slot})


def read_slot(path: str) -> dict[str, torch.Tensor]:
    """Return read-only views of every tensor in a slot file (for example a staged version's `file`)."""
    return SlotFile(path, writable=False).tensors()


def open_committed(local_dir: str) -> tuple[Optional[int], dict[str, torch.Tensor]]:
    """Return the committed version of a host's local copy and read-only views of its tensors.

    For the inference ranks of a host that are not its applier.
    """
    held, slot = read_state(local_dir)
    if held is None:
        return None, {}
    return held.version, read_slot(slot_path(local_dir, slot))
