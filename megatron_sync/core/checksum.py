"""Integrity checksums of byte ranges, one mechanism for every transport (`weight_sync.checksum`).

Every value is a signed 64-bit integer, so it travels in an int64 header.

- `xxh3`: xxHash's XXH3-64 over host bytes (~10-15 GB/s on one core, releases
  the GIL); device bytes are copied to the host first.
- `crc32`: zlib's CRC-32 over host bytes (~2 GB/s).
- `fletcher`: a Fletcher-style pair of sums modulo 2^31 - 1 computed with torch
  ops where the bytes are, so GPU bytes are checked on the GPU and only the
  8-byte result crosses to the host. Any single changed byte, and any swap of
  two different bytes, changes it.
- `none`: no checksum; the transport's own integrity (NCCL over NVLink /
  InfiniBand link-level CRC, TCP checksums) is trusted.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import xxhash

_FLETCHER_MOD = 2**31 - 1
_FLETCHER_BLOCK = 1 << 16  # bytes per block: per-block sums fit int64 with room to spare
_FLETCHER_CHUNK = 1 << 24  # bytes widened to int32 at once (bounds the temporary memory)


def _host_bytes(data: torch.Tensor):
    host = data if data.device.type == "cpu" else data.cpu()
    return memoryview(host.contiguous().numpy())


def _signed64(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


def xxh3_checksum(data: torch.Tensor) -> int:
    """Return XXH3-64 of the bytes as a signed int64."""
    return _signed64(xxhash.xxh3_64_intdigest(_host_bytes(data)))


def crc32_checksum(data: torch.Tensor) -> int:
    """Return the CRC-32 of the bytes (unsigned 32-bit)."""
    return zlib.crc32(_host_bytes(data)) & 0xFFFFFFFF


def fletcher_checksum(data: torch.Tensor) -> int:
    """Return (A << 32) | B with A = sum(x_i), B = sum((i + 1) * x_i), both mod 2^31 - 1.

    Computed with torch ops on the device holding `data`, in chunks of 16 MiB
    (the int32 widening of one chunk is the only temporary); one `.item()` at the end.
    """
    p, block = _FLETCHER_MOD, _FLETCHER_BLOCK
    a = torch.zeros((), dtype=torch.int64, device=data.device)
    b = torch.zeros((), dtype=torch.int64, device=data.device)
    weights = torch.arange(1, block + 1, dtype=torch.int32, device=data.device)
    for start in range(0, data.numel(), _FLETCHER_CHUNK):
        chunk = data[start:start + _FLETCHER_CHUNK]
        pad = (-chunk.numel()) % block  # zeros at the end add nothing to either sum
        wide = chunk.to(torch.int32)
        if pad:
            wide = torch.nn.functional.pad(wide, (0, pad))
        blocks = wide.view(-1, block)
        block_a = blocks.sum(dim=1, dtype=torch.int64)  # < 2^24 each
        block_b = (blocks * weights).sum(dim=1, dtype=torch.int64)  # < 2^40 each
        # Block j starts at global byte offset start + j * block: B gains offset * A_j there.
        offsets = torch.arange(blocks.shape[0], dtype=torch.int64, device=data.device) * block + start
        a = (a + block_a.sum()) % p
        b = (b + (block_b % p).sum() + ((offsets % p) * (block_a % p) % p).sum()) % p
    return int((a << 32 | b).item())


def no_checksum(data: torch.Tensor) -> int:
    """Return 0: integrity is left to the transport."""
    return 0


@dataclass(frozen=True)
class Checksum:
    """One integrity choice: its name, the function, and whether it runs where device bytes are."""

    name: str
    compute: Callable[[torch.Tensor], int]
    on_device: bool
    description: str


CHECKSUMS: dict[str, Checksum] = {c.name: c for c in (
    Checksum("xxh3", xxh3_checksum, False, "XXH3-64 over host bytes (memory speed on one core)"),
    Checksum("crc32", crc32_checksum, False, "zlib CRC-32 over host bytes (~2 GB/s)"),
    Checksum("fletcher", fletcher_checksum, True, "Fletcher-style sums mod 2^31-1, computed by torch on the bytes' device"),
    Checksum("none", no_checksum, True, "no checksum: the transport's own integrity is trusted"),
)}


def resolve_checksum(name: str, device: torch.device) -> str:
    """Return the checksum to use for buckets living on `device`: "auto" is xxh3 on the host,
    fletcher on a GPU (so GPU bytes are never copied to the host to be checked)."""
    if name == "auto":
        return "xxh3" if device.type == "cpu" else "fletcher"
    if name not in CHECKSUMS:
        raise ValueError(f"checksum={name!r} is not valid; use 'auto' or one of {list(CHECKSUMS)}")
    return name


def checksum(data: torch.Tensor, algorithm: str = "xxh3") -> int:
    """Return the `algorithm` checksum of a flat uint8 tensor's bytes (see CHECKSUMS)."""
    assert data.dtype == torch.uint8 and data.dim() == 1, (data.dtype, data.shape)
    return CHECKSUMS[algorithm].compute(data)


