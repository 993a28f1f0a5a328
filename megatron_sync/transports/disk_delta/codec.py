"""Per-tensor encodings of one version's raw bytes, alone or against the previous version's bytes.

A tensor is its raw bytes (uint8, C order, native little-endian) and its
element size. An RL update cast to bf16 changes few elements per step, each
by an ulp or two, so the XOR of new and old bytes is mostly zero, and where it
is not, the high byte (sign and exponent) is nearly always zero. The
encodings exploit this in different ways:

    name            base  payload
    raw             no    the new bytes
    zstd            no    zstd(new bytes)
    plane_zstd      no    zstd(byte planes of the new elements)
    xor_zstd        yes   zstd(new XOR base)                    (the field's baseline)
    plane_xor_zstd  yes   zstd(byte planes of new XOR base)
    sparse_xor      yes   header + zstd(byte planes of the gaps between changed
                          elements, then byte planes of their XOR values)

Byte planes put byte k of every element into plane k, so the near-constant
high bytes form long runs that zstd codes in almost nothing. Decoding is
exact for every encoding. `encode_delta` / `encode_snapshot` choose per
tensor and keep an encoding only when it is strictly smaller than raw.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import threading
from typing import Callable, Optional

import numpy as np
import zstandard

DEFAULT_LEVEL = 1
# Up to this fraction of changed elements "auto" picks sparse_xor, above it plane_xor_zstd.
# Measured on bf16 one-ulp updates (bench/RESULTS.md, chooser evidence): sparse_xor is the
# smallest up to 30% changed (0.5x the XOR+zstd baseline at 2%), plane_xor_zstd from 60%;
# sparse_xor's encode slows down as its index grows, so the switch sits at the low end.
SPARSE_AUTO_MAX_FRACTION = 0.3

_ELEMENT_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SPARSE_HEADER = struct.Struct("<QB")  # changed-element count, bytes per index gap
_local = threading.local()  # zstd contexts are not thread-safe; one set per thread


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One tensor's encoding name and payload (any bytes-like object)."""

    name: str
    payload: bytes | memoryview

    @property
    def size(self) -> int:
        """Return the payload's length in bytes."""
        return memoryview(self.payload).nbytes


class _Tensor:
    """The new bytes of one tensor and its base, with the derived arrays encoders share (computed once)."""

    def __init__(self, new: np.ndarray, base: Optional[np.ndarray], itemsize: int):
        _check_bytes(new, itemsize, "new")
        if base is not None:
            _check_bytes(base, itemsize, "base")
            if base.nbytes != new.nbytes:
                raise ValueError(f"base has {base.nbytes} bytes, new has {new.nbytes}; a delta needs equal sizes")
        self.new, self.base, self.itemsize = new, base, itemsize

    @functools.cached_property
    def xor(self) -> np.ndarray:
        return xor_bytes(self.new, self.base, out=_scratch(2, self.new.nbytes))

    @functools.cached_property
    def xor_elements(self) -> np.ndarray:
        return self.xor.view(_ELEMENT_UINT[self.itemsize])

    @functools.cached_property
    def changed(self) -> np.ndarray:
        # Through a boolean mask: numpy's nonzero has a fast path for booleans (3x on uint16 here).
        mask = _scratch(4, self.numel).view(np.bool_)
        return np.flatnonzero(np.not_equal(self.xor_elements, 0, out=mask))

    @property
    def numel(self) -> int:
        return self.new.nbytes // self.itemsize


def _check_bytes(data: np.ndarray, itemsize: int, what: str) -> None:
    if itemsize not in _ELEMENT_UINT:
        raise ValueError(f"element size {itemsize} is not one of {sorted(_ELEMENT_UINT)}")
    if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
        raise ValueError(f"{what} must be a contiguous 1-D uint8 array, got {data.dtype} {data.shape}")
    if data.nbytes % itemsize:
        raise ValueError(f"{what} has {data.nbytes} bytes, not a multiple of the element size {itemsize}")


def xor_bytes(a: np.ndarray, b: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Return `a XOR b` over equal-length uint8 arrays (into `out` when given; `out` may alias `a`)."""
    width = next(w for w in (8, 4, 2, 1) if a.nbytes % w == 0)
    wide = _ELEMENT_UINT[width]
    out = np.empty_like(a) if out is None else out
    np.bitwise_xor(a.view(wide), b.view(wide), out=out.view(wide))
    return out


def to_planes(data: np.ndarray, itemsize: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Return the byte planes of `data`: byte 0 of every element, then byte 1 of every element, ...

    Written into `out` (uint8, same size) when given; with element size 1, `data` itself.
    """
    if itemsize == 1:
        return data
    planes = (np.empty_like(data) if out is None else out).reshape(itemsize, -1)
    for k, column in enumerate(data.reshape(-1, itemsize).T):  # one strided column at a time: ~5x a 2-D transpose
        planes[k] = column
    return planes.reshape(-1)


def from_planes(planes: np.ndarray, itemsize: int, out: np.ndarray) -> np.ndarray:
    """Write the elements whose byte planes are `planes` into `out` (uint8) and return it."""
    columns = out.reshape(-1, itemsize)
    for k, plane in enumerate(planes.reshape(itemsize, -1)):
        columns[:, k] = plane
    return out


def _scratch(slot: int, nbytes: int) -> np.ndarray:
    """Return a reusable uint8 buffer of `nbytes` for this thread (fresh allocations page-fault on every use)."""
    buffers = _local.__dict__.setdefault("scratch", {})
    if slot not in buffers or buffers[slot].nbytes < nbytes:
        buffers[slot] = np.empty(max(nbytes, 1 << 20), np.uint8)
    return buffers[slot][:nbytes]


def release_scratch() -> None:
    """Free this thread's scratch buffers (they grow to the largest tensor decoded)."""
    _local.__dict__.pop("scratch", None)


def _zstd(data, level: int) -> bytes:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level].compress(data)


def _unzstd_into(payload, out: np.ndarray) -> np.ndarray:
    """Decompress a zstd frame into `out` (uint8), which it must fill exactly; return `out`."""
    if "decompressor" not in _local.__dict__:
        _local.decompressor = zstandard.ZstdDecompressor()
    view, filled = memoryview(out), 0
    with _local.decompressor.stream_reader(payload) as reader:
        while filled < out.nbytes:
            got = reader.readinto(view[filled:])
            if got == 0:
                raise ValueError(f"payload decompresses to {filled} bytes, expected {out.nbytes}")
            filled += got
        if reader.read(1):
            raise ValueError(f"payload decompresses to more than the expected {out.nbytes} bytes")
    return out


# ----------------------------------------------------------------------------- encoders


def _encode_raw(t: _Tensor, level: int):
    return memoryview(t.new)


def _encode_zstd(t: _Tensor, level: int) -> bytes:
    return _zstd(t.new, level)


def _encode_plane_zstd(t: _Tensor, level: int) -> bytes:
    return _zstd(to_planes(t.new, t.itemsize, _scratch(3, t.new.nbytes)), level)


def _encode_xor_zstd(t: _Tensor, level: int) -> bytes:
    return _zstd(t.xor, level)


def _encode_plane_xor_zstd(t: _Tensor, level: int) -> bytes:
    return _zstd(to_planes(t.xor, t.itemsize, _scratch(3, t.new.nbytes)), level)


def _encode_sparse_xor(t: _Tensor, level: int) -> bytes:
    gap_size = 4 if t.numel <= 2**32 else 8
    gaps = (np.diff(t.changed, prepend=-1) - 1).astype(_ELEMENT_UINT[gap_size])
    values = t.xor_elements[t.changed]
    body = np.concatenate([to_planes(gaps.view(np.uint8), gap_size),
                           to_planes(values.view(np.uint8), t.itemsize)])
    return _SPARSE_HEADER.pack(len(t.changed), gap_size) + _zstd(body, level)


# ----------------------------------------------------------------------------- decoders
# Each writes the decoded tensor into `out`; `base` is the previous version's bytes and may
# be the same memory as `out` (patching in place).


def _in_place(base: np.ndarray, out: np.ndarray) -> bool:
    if not np.may_share_memory(base, out):
        return False
    if base.__array_interface__["data"][0] != out.__array_interface__["data"][0]:
        raise ValueError("base and out overlap without being the same bytes; pass the same buffer or disjoint ones")
    return True


def _decode_raw(payload, base, out: np.ndarray, itemsize: int) -> None:
    data = np.frombuffer(payload, dtype=np.uint8)
    if data.nbytes != out.nbytes:
        raise ValueError(f"raw payload has {data.nbytes} bytes, expected {out.nbytes}")
    out[...] = data


def _decode_zstd(payload, base, out: np.ndarray, itemsize: int) -> None:
    _unzstd_into(payload, out)


def _decode_plane_zstd(payload, base, out: np.ndarray, itemsize: int) -> None:
    from_planes(_unzstd_into(payload, _scratch(0, out.nbytes)), itemsize, out)


def _decode_xor_zstd(payload, base, out: np.ndarray, itemsize: int) -> None:
    if _in_place(base, out):
        xor_bytes(out, _unzstd_into(payload, _scratch(0, out.nbytes)), out=out)
    else:
        xor_bytes(_unzstd_into(payload, out), base, out=out)


def _decode_plane_xor_zstd(payload, base, out: np.ndarray, itemsize: int) -> None:
    planes = _unzstd_into(payload, _scratch(0, out.nbytes))
    xor = from_planes(planes, itemsize, _scratch(1, out.nbytes))
    xor_bytes(base, xor, out=out)


def _decode_sparse_xor(payload, base, out: np.ndarray, itemsize: int) -> None:
    payload = memoryview(payload)
    count, gap_size = _SPARSE_HEADER.unpack_from(payload)
    if gap_size not in (4, 8) or count > out.nbytes // itemsize:
        raise ValueError(f"sparse_xor header is invalid: {count} changes, {gap_size}-byte gaps")
    body = _unzstd_into(payload[_SPARSE_HEADER.size:], _scratch(0, count * (gap_size + itemsize)))
    gaps = from_planes(body[: count * gap_size], gap_size, _scratch(1, count * gap_size))
    index = np.cumsum(gaps.view(_ELEMENT_UINT[gap_size]).astype(np.int64) + 1) - 1
    values = from_planes(body[count * gap_size:], itemsize, np.empty(count * itemsize, np.uint8))
    if count and index[-1] >= out.nbytes // itemsize:
        raise ValueError(f"sparse_xor index {index[-1]} is past the tensor's {out.nbytes // itemsize} elements")
    if not _in_place(base, out):
        out[...] = base
    out.view(_ELEMENT_UINT[itemsize])[index] ^= values.view(_ELEMENT_UINT[itemsize])


@dataclasses.dataclass(frozen=True)
class Codec:
    """One encoding: whether it needs the base version's bytes, and its encode / decode pair."""

    name: str
    uses_base: bool
    encode: Callable[[_Tensor, int], object]
    decode_into: Callable[[object, Optional[np.ndarray], np.ndarray, int], None]


CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("raw", False, _encode_raw, _decode_raw),
    Codec("zstd", False, _encode_zstd, _decode_zstd),
    Codec("plane_zstd", False, _encode_plane_zstd, _decode_plane_zstd),
    Codec("xor_zstd", True, _encode_xor_zstd, _decode_xor_zstd),
    Codec("plane_xor_zstd", True, _encode_plane_xor_zstd, _decode_plane_xor_zstd),
    Codec("sparse_xor", True, _encode_sparse_xor, _decode_sparse_xor),
)}
DELTA_CANDIDATES = ("xor_zstd", "plane_xor_zstd", "sparse_xor")
SNAPSHOT_CANDIDATES = ("zstd", "plane_zstd")
CHOICES = ("auto", "best", *CODECS)
"""What `encode_delta` / `encode_snapshot` may be asked for: "auto" (a cheap heuristic picks
one or two candidates), "best" (try every candidate, keep the smallest), or one encoding."""


def check_choice(choice: str) -> str:
    """Return `choice` if it names an encoding policy; raise ValueError naming the valid ones."""
    if choice not in CHOICES:
        raise ValueError(f"encoding must be one of {list(CHOICES)}, got {choice!r}")
    return choice


def encode_delta(new: np.ndarray, base: np.ndarray, itemsize: int, *,
                 choice: str = "auto", level: int = DEFAULT_LEVEL) -> Encoded:
    """Return the smallest encoding of `new` against `base` among those `choice` allows (raw unless smaller)."""
    tensor = _Tensor(new, base, itemsize)
    return _smallest(tensor, _delta_candidates(tensor, check_choice(choice)), level)


def encode_snapshot(new: np.ndarray, itemsize: int, *,
                    choice: str = "auto", level: int = DEFAULT_LEVEL) -> Encoded:
    """Return the smallest base-free encoding of `new` that `choice` allows (raw unless smaller)."""
    tensor = _Tensor(new, None, itemsize)
    if check_choice(choice) == "best":
        names = SNAPSHOT_CANDIDATES
    elif choice == "auto":
        names = ("plane_zstd",) if itemsize > 1 else ("zstd",)
    else:
        names = (choice,) if not CODECS[choice].uses_base else ("plane_zstd",)
    return _smallest(tensor, names, level)


def _delta_candidates(tensor: _Tensor, choice: str) -> tuple[str, ...]:
    if choice == "best":
        return DELTA_CANDIDATES
    if choice != "auto":
        return (choice,)
    fraction = len(tensor.changed) / max(tensor.numel, 1)
    return ("sparse_xor",) if fraction <= SPARSE_AUTO_MAX_FRACTION else ("plane_xor_zstd",)


def _smallest(tensor: _Tensor, names: tuple[str, ...], level: int) -> Encoded:
    best = Encoded("raw", _encode_raw(tensor, level))
    for name in names:
        candidate = Encoded(name, CODECS[name].encode(tensor, level))
        if candidate.size < best.size:
            best = candidate
    return best


def decode_into(name: str, payload, out: np.ndarray, itemsize: int,
                base: Optional[np.ndarray] = None) -> np.ndarray:
    """Decode `payload` (encoding `name`) into `out` (uint8) and return it; `base` may be `out` itself.

    Raises ValueError when the payload does not decode to exactly `out.nbytes` bytes.
    """
    try:
        codec = CODECS[name]
    except KeyError:
        raise ValueError(f"unknown encoding {name!r}; known: {sorted(CODECS)}") from None
    _check_bytes(out, itemsize, "out")
    if codec.uses_base:
        if base is None:
            raise ValueError(f"encoding {name!r} needs the base version's bytes")
        _check_bytes(base, itemsize, "base")
        if base.nbytes != out.nbytes:
            raise ValueError(f"base has {base.nbytes} bytes, out has {out.nbytes}")
    codec.decode_into(payload, base, out, itemsize)
    return out
