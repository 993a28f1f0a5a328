"""Tier 1: the per-tensor encodings of the disk-delta store decode to exactly the bytes encoded.

Tables over encodings x dtypes x kinds of update (nothing changed, every element
changed, ~2% changed by one ulp, only the first / last element, empty and odd
sizes). Each case compares real bytes with the new tensor's own bytes, decoding
both into a fresh buffer and in place over the base. Negative controls: the
wrong base decodes to other bytes, a truncated or damaged payload raises.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_sync.transports.disk_delta import codec

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.uint8, torch.float64]
BASE_FREE = ("raw", "zstd", "plane_zstd")
WITH_BASE = ("xor_zstd", "plane_xor_zstd", "sparse_xor")


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy().copy()


def _base(numel: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.uint8:
        return (torch.arange(numel) % 251).to(torch.uint8)
    return (torch.arange(numel, dtype=torch.float64) * 1e-3 - 0.5).to(dtype)


def _bump(base: torch.Tensor, index) -> torch.Tensor:
    """Return `base` with the elements at `index` moved by one unit of their bit pattern (one ulp for floats)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[base.element_size()]
    new = base.clone()
    new.view(ints)[index] += 1
    return new


def _update(kind: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    base = _base(numel, dtype)
    gen = torch.Generator().manual_seed(numel)
    index = {
        "none": torch.zeros(numel, dtype=torch.bool),
        "all": torch.ones(numel, dtype=torch.bool),
        "two_percent": torch.rand(numel, generator=gen) < 0.02,
        "first": torch.arange(numel) == 0,
        "last": torch.arange(numel) == numel - 1,
    }[kind]
    return base, _bump(base, index)


UPDATES = ["none", "all", "two_percent", "first", "last"]
SIZES = [0, 1, 7, 1001, 40_000]


@pytest.mark.parametrize("name", BASE_FREE + WITH_BASE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", UPDATES)
@pytest.mark.parametrize("numel", SIZES)
def test_every_encoding_decodes_exactly(name, dtype, kind, numel):
    base, new = _update(kind, numel, dtype)
    base_b, new_b, itemsize = _bytes(base), _bytes(new), dtype.itemsize
    tensor = codec._Tensor(new_b, base_b, itemsize)
    payload = codec.CODECS[name].encode(tensor, codec.DEFAULT_LEVEL)

    fresh = np.full_like(new_b, 0xAB)
    codec.decode_into(name, payload, fresh, itemsize, base=base_b)
    assert np.array_equal(fresh, new_b)

    patched = base_b.copy()  # in place: out is the base
    codec.decode_into(name, payload, patched, itemsize, base=patched)
    assert np.array_equal(patched, new_b)


@pytest.mark.parametrize("choice", ["auto", "best", *codec.DELTA_CANDIDATES])
@pytest.mark.parametrize("kind", UPDATES)
def test_chooser_returns_the_smallest_decodable_encoding(choice, kind):
    base, new = _update(kind, 40_000, torch.bfloat16)
    encoded = codec.encode_delta(_bytes(new), _bytes(base), 2, choice=choice)
    out = np.empty(new.numel() * 2, np.uint8)
    assert np.array_equal(codec.decode_into(encoded.name, encoded.payload, out, 2, base=_bytes(base)), _bytes(new))
    assert encoded.size <= new.numel() * 2
    if choice == "best":  # "best" keeps the smallest of all candidates
        tensor = codec._Tensor(_bytes(new), _bytes(base), 2)
        sizes = [len(codec.CODECS[n].encode(tensor, codec.DEFAULT_LEVEL)) for n in codec.DELTA_CANDIDATES]
        assert encoded.size == min([*sizes, new.numel() * 2])


def test_sparse_update_beats_the_xor_zstd_baseline():
    base, new = _update("two_percent", 200_000, torch.bfloat16)
    baseline = codec.encode_delta(_bytes(new), _bytes(base), 2, choice="xor_zstd")
    chosen = codec.encode_delta(_bytes(new), _bytes(base), 2, choice="auto")
    assert chosen.name == "sparse_xor"
    assert chosen.size < 0.7 * baseline.size


def test_incompressible_bytes_fall_back_to_raw():
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    new = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    for choice in ("auto", "best", "xor_zstd", "sparse_xor"):
        assert codec.encode_delta(_bytes(new), _bytes(base), 1, choice=choice).name == "raw"
    assert codec.encode_snapshot(_bytes(new), 1, choice="best").name == "raw"
    assert codec.encode_delta(np.empty(0, np.uint8), np.empty(0, np.uint8), 2).name == "raw"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("choice", ["auto", "best", "zstd", "plane_zstd", "raw"])
def test_snapshot_encoding_decodes_exactly(dtype, choice):
    weights = (torch.randn(10_001, generator=torch.Generator().manual_seed(1)) * 0.02).to(dtype)
    encoded = codec.encode_snapshot(_bytes(weights), dtype.itemsize, choice=choice)
    assert not codec.CODECS[encoded.name].uses_base
    out = codec.decode_into(encoded.name, encoded.payload, np.empty(weights.numel() * dtype.itemsize, np.uint8),
                            dtype.itemsize)
    assert np.array_equal(out, _bytes(weights))
    if choice in ("auto", "best", "plane_zstd"):  # byte planes isolate the low-entropy exponent byte
        bound = {torch.bfloat16: 0.85, torch.float32: 0.95}[dtype]  # fp32: 3 of 4 bytes are random mantissa
        assert encoded.size < bound * weights.numel() * dtype.itemsize


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_byte_planes_round_trip_and_group_bytes_by_position(itemsize):
    data = (np.arange(6 * itemsize) % 256).astype(np.uint8)
    planes = codec.to_planes(data, itemsize)
    assert np.array_equal(planes[:6], data[::itemsize])  # plane 0: byte 0 of every element
    assert np.array_equal(codec.from_planes(planes, itemsize, np.empty_like(data)), data)


def test_wrong_base_decodes_to_other_bytes():  # negative control: the digest check downstream needs this
    base, new = _update("two_percent", 5000, torch.bfloat16)
    other = _bump(base, torch.arange(5000) == 3)
    for name in WITH_BASE:
        payload = codec.CODECS[name].encode(codec._Tensor(_bytes(new), _bytes(base), 2), 1)
        out = codec.decode_into(name, payload, np.empty(10_000, np.uint8), 2, base=_bytes(other))
        assert not np.array_equal(out, _bytes(new)), name


@pytest.mark.parametrize("name", ["zstd", "plane_zstd", "xor_zstd", "plane_xor_zstd", "sparse_xor", "raw"])
def test_truncated_or_damaged_payload_raises(name):
    base, new = _update("two_percent", 5000, torch.bfloat16)
    payload = bytes(codec.CODECS[name].encode(codec._Tensor(_bytes(new), _bytes(base), 2), 1))
    out = np.empty(10_000, np.uint8)
    with pytest.raises(ValueError):
        codec.decode_into(name, payload[: len(payload) // 2], out, 2, base=_bytes(base))


def test_sparse_header_past_the_tensor_raises():
    base, new = _update("last", 100, torch.bfloat16)
    payload = bytearray(codec.CODECS["sparse_xor"].encode(codec._Tensor(_bytes(new), _bytes(base), 2), 1))
    payload[0] = 200  # claims 200 changes in a 100-element tensor
    with pytest.raises(ValueError, match="header is invalid"):
        codec.decode_into("sparse_xor", bytes(payload), np.empty(200, np.uint8), 2, base=_bytes(base))


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="not a multiple"):
        codec.encode_delta(np.zeros(3, np.uint8), np.zeros(3, np.uint8), 2)
    with pytest.raises(ValueError, match="equal sizes"):
        codec.encode_delta(np.zeros(4, np.uint8), np.zeros(6, np.uint8), 2)
    with pytest.raises(ValueError, match="encoding must be one of"):
        codec.encode_delta(np.zeros(4, np.uint8), np.zeros(4, np.uint8), 2, choice="lz4")
    with pytest.raises(ValueError, match="needs the base"):
        codec.decode_into("xor_zstd", b"", np.zeros(4, np.uint8), 2)
    data = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        codec.decode_into("xor_zstd", b"", data[:8], 2, base=data[2:10])
