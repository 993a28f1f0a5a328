"""Integrity checksums of byte ranges, one mechanism for every transport (`weight_sync.checksum`).

Every value is a signed 64-bit integer, so it travels in an int64 header.

- `xxh3`: xxHash's XXH3-64 over host bytes (~10-15 GB/s on one core, releases
  the GIL); device bytes are copied to the host first.
- `crc32`: zlib's CRC-32 over host bytes (~2 GB/s).
- `wsum64`: a position-weighted sum of the bytes' 64-bit words modulo 2^64,
  computed with torch ops where the bytes are (one multiply and two sums, no
  widening), so GPU bytes are checked on the GPU at memory speed and only the
  8-byte result crosses to the host; the same value on every device (integer
  sums modulo 2^64 do not depend on the order a kernel reduces in). Any change
  confined to one word is always caught (every weight is odd, so invertible).
- `none`: no checksum; the transport's own integrity (NCCL over NVLink /
  InfiniBand link-level CRC, TCP checksums) is trusted.
"""

from __future__ import annotations

import ctypes
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import xxhash

WSUM_BLOCK = 1 << 12  # words per block: each word of a block has its own odd weight
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _digest_bytes(data: torch.Tensor, digest: Callable[[object], int]) -> int:
    """Return `digest` of the tensor's bytes, without copying a contiguous CPU tensor. The bytes are read
    through their address, not `.numpy()`: torch marks a storage numpy has seen as not resizable, and an
    engine's live weights must stay resizable (a colocated engine frees them with `resize_(0)` while the
    trainer trains). `host` keeps a copied tensor alive while `digest` reads it."""
    host = (data if data.device.type == "cpu" else data.cpu()).contiguous()
    nbytes = host.numel() * host.element_size()
    if nbytes == 0:
        return digest(b"")
    return digest(memoryview((ctypes.c_char * nbytes).from_address(host.data_ptr())).cast("B"))


def _signed64(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


def xxh3_checksum(data: torch.Tensor) -> int:
    """Return XXH3-64 of the bytes as a signed int64."""
    return _signed64(_digest_bytes(data, xxhash.xxh3_64_intdigest))


def crc32_checksum(data: torch.Tensor) -> int:
    """Return the CRC-32 of the bytes (unsigned 32-bit)."""
    return _digest_bytes(data, zlib.crc32) & 0xFFFFFFFF


def _signed(value: int) -> int:
    value &= _MASK64
    return value - 2**64 if value >= 2**63 else value


def word_weight(position: int) -> int:
    """Return the odd 64-bit weight of word `position` of a block (splitmix64 of the position, made odd)."""
    z = (position * _GOLDEN + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) | 1


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    if device not in _WEIGHTS:
        _WEIGHTS[device] = torch.tensor([_signed(word_weight(i)) for i in range(WSUM_BLOCK)], dtype=torch.int64,
                                        device=device)
    return _WEIGHTS[device]


def wsum64_checksum(data: torch.Tensor) -> int:
    """Return sum(word_i * weight(i mod B) * (2 * (i // B) + 1) * GOLDEN) mod 2^64, xor the byte count.

    word_i is bytes [8i, 8i + 8) read little-endian as a signed int64 (the last one zero-padded), B is
    `WSUM_BLOCK`; computed with torch ops on the device holding `data`. Bytes that do not start at an
    8-byte boundary are copied once to an aligned buffer (the value is defined on the bytes, not on where
    they lie).
    """
    n = data.numel()
    pad = (-n) % 8
    if pad or data.storage_offset() % 8:
        aligned = torch.zeros(n + pad, dtype=torch.uint8, device=data.device)
        aligned[:n].copy_(data)
        data = aligned
    words = data.view(torch.int64)
    count, full = words.numel(), words.numel() // WSUM_BLOCK * WSUM_BLOCK
    weights = _weights(data.device)
    golden = _signed(_GOLDEN)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if full:
        per_block = (words[:full].view(-1, WSUM_BLOCK) * weights).sum(dim=1)
        odd = torch.arange(per_block.numel(), dtype=torch.int64, device=data.device) * 2 + 1
        total = total + (per_block * odd * golden).sum()
    if count > full:
        total = total + (words[full:] * weights[:count - full]).sum() * (2 * (full // WSUM_BLOCK) + 1) * golden
    return int(total.item()) ^ n


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
    Checksum("wsum64", wsum64_checksum, True, "weighted sum of 64-bit words mod 2^64, computed by torch on the "
             "bytes' device"),
    Checksum("none", no_checksum, True, "no checksum: the transport's own integrity is trusted"),
)}


def resolve_checksum(name: str, device: torch.device) -> str:
    """Return the checksum to use for buckets living on `device`: "auto" is xxh3 on the host,
    wsum64 on a GPU (so GPU bytes are never copied to the host to be checked)."""
    if name == "auto":
        return "xxh3" if device.type == "cpu" else "wsum64"
    if name not in CHECKSUMS:
        raise ValueError(f"checksum={name!r} is not valid; use 'auto' or one of {list(CHECKSUMS)}")
    return name


def checksum(data: torch.Tensor, algorithm: str = "xxh3") -> int:
    """Return the `algorithm` checksum of a flat uint8 tensor's bytes (see CHECKSUMS)."""
    assert data.dtype == torch.uint8 and data.dim() == 1, (data.dtype, data.shape)
    return CHECKSUMS[algorithm].compute(data)


