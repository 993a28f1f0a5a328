"""Buckets and the host replica: byte-exact round trips, checksum, slot checks."""

from __future__ import annotations

import pytest
import torch

from megatron_sync.plan.bucket import flatten, unpack
from megatron_sync.core.checksum import CHECKSUMS, WSUM_BLOCK, checksum, resolve_checksum, word_weight, wsum64_checksum
from megatron_sync.core.meta import TensorMeta
from megatron_sync.plan.buckets import build_plan
from megatron_sync.trainer.replica import HostReplica

METAS = [
    TensorMeta("w.bf16", (3, 5), torch.bfloat16),
    TensorMeta("w.f32", (7,), torch.float32),
    TensorMeta("w.i64", (2, 3), torch.int64),
    TensorMeta("w.scalar", (), torch.float32),
]


def _tensors(version=1):
    g = torch.Generator().manual_seed(version)
    return {
        "w.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "w.f32": torch.randn(7, generator=g),
        "w.i64": torch.randint(-(2**62), 2**62, (2, 3), generator=g),
        "w.scalar": torch.tensor(3.5),
    }


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def test_replica_pack_unpack_round_trip_bytes():
    plan = build_plan([METAS], 1 << 20)
    replica = HostReplica(plan, 0)
    (bucket,) = replica.buckets
    replica.begin(1)
    for name, t in _tensors().items():
        replica.pack(name, t)
    assert replica.is_complete(bucket.index)
    replica.finish()
    assert replica.version == 1
    received = replica.data(bucket.index).clone()
    out = unpack(received, bucket)
    for name, t in _tensors().items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(_bits(out[name]), _bits(t)), name
    # the layout is exactly the concatenation of raw bytes in plan order
    expected = torch.cat([_bits(_tensors()[e.name]) for e in bucket.entries])
    assert torch.equal(received, expected)


def test_replica_buffers_are_reused_and_views_alias_them():
    plan = build_plan([METAS], 1 << 20)
    replica = HostReplica(plan, 0)
    ptr = replica.data(0).data_ptr()
    for v in (1, 2):
        replica.begin(v)
        for name, t in _tensors(v).items():
            replica.pack(name, t)
        replica.finish()
        assert replica.data(0).data_ptr() == ptr
        assert torch.equal(replica.view("w.f32"), _tensors(v)["w.f32"])


def test_incomplete_bucket_is_not_complete():
    plan = build_plan([METAS], 1 << 20)
    replica = HostReplica(plan, 0)
    replica.begin(1)
    replica.pack("w.f32", _tensors()["w.f32"])
    assert not replica.is_complete(0)
    assert replica.missing() == ["w.bf16", "w.i64", "w.scalar"]


@pytest.mark.parametrize("name,tensor,match", [
    ("w.f32", torch.zeros(7, dtype=torch.float16), "w.f32.*dtype"),
    ("w.f32", torch.zeros(8), "w.f32.*shape"),
    ("nope", torch.zeros(1), "'nope' is not in stage 0"),
])
def test_pack_mismatch_names_the_tensor(name, tensor, match):
    replica = HostReplica(build_plan([METAS], 1 << 20), 0)
    replica.begin(1)
    with pytest.raises(ValueError, match=match):
        replica.pack(name, tensor)


def test_pack_twice_is_an_error():
    replica = HostReplica(build_plan([METAS], 1 << 20), 0)
    replica.begin(1)
    replica.pack("w.f32", _tensors()["w.f32"])
    with pytest.raises(ValueError, match="'w.f32' was yielded twice"):
        replica.pack("w.f32", _tensors()["w.f32"])


@pytest.mark.parametrize("algorithm", [a for a in CHECKSUMS if a != "none"])
def test_checksum_detects_a_flipped_byte(algorithm):
    plan = build_plan([METAS], 1 << 20)
    (bucket,) = plan.buckets
    data = flatten([(e, _tensors()[e.name]) for e in bucket.entries], bucket.nbytes)
    before = checksum(data, algorithm)
    assert before == checksum(data.clone(), algorithm)
    assert -(2**63) <= before < 2**63  # travels in an int64 header
    for position in (0, bucket.nbytes // 2, bucket.nbytes - 1):
        corrupted = data.clone()
        corrupted[position] ^= 0x01
        assert checksum(corrupted, algorithm) != before, position
    swapped = data.clone()
    swapped[0], swapped[1] = data[1].item(), data[0].item()
    if data[0] != data[1]:
        assert checksum(swapped, algorithm) != before


def test_none_checks_nothing():
    data = torch.arange(256, dtype=torch.uint8)
    assert checksum(data, "none") == checksum(data.flip(0), "none") == 0


def _wsum64_by_definition(data: torch.Tensor) -> int:
    """wsum64 in Python integers, word by word (the definition the torch version must equal)."""
    raw = bytes(data.numpy()) + bytes((-data.numel()) % 8)
    total = 0
    for i in range(len(raw) // 8):
        word = int.from_bytes(raw[8 * i:8 * i + 8], "little", signed=True)
        block, position = divmod(i, WSUM_BLOCK)
        total += word * word_weight(position) * (2 * block + 1) * 0x9E3779B97F4A7C15
    total &= (1 << 64) - 1
    return (total - (1 << 64) if total >= 1 << 63 else total) ^ data.numel()


@pytest.mark.parametrize("nbytes", [1, 7, 8, 8 * WSUM_BLOCK, 8 * WSUM_BLOCK + 13, 3 * 8 * WSUM_BLOCK + 5])
def test_wsum64_matches_its_definition(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert wsum64_checksum(data) == _wsum64_by_definition(data)


def test_wsum64_is_defined_on_the_bytes_not_on_their_alignment():
    data = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    shifted = torch.zeros(4099 + 3, dtype=torch.uint8)
    shifted[3:] = data
    assert wsum64_checksum(shifted[3:]) == wsum64_checksum(data) == _wsum64_by_definition(data)
    assert wsum64_checksum(data[:4098]) != wsum64_checksum(torch.cat([data[:4098], torch.zeros(1, dtype=torch.uint8)]))


def test_auto_resolves_by_where_buckets_live():
    assert resolve_checksum("auto", torch.device("cpu")) == "xxh3"
    assert resolve_checksum("auto", torch.device("cuda", 0)) == "wsum64"
    assert resolve_checksum("crc32", torch.device("cuda", 0)) == "crc32"
    with pytest.raises(ValueError, match="checksum='md5' is not valid"):
        resolve_checksum("md5", torch.device("cpu"))


def test_converting_into_the_slot_needs_no_pack_copy():
    plan = build_plan([METAS], 1 << 20)
    replica = HostReplica(plan, 0)
    replica.begin(1)
    for name, t in _tensors().items():
        slot = replica.slot(name)
        slot.copy_(t)
        replica.pack(name, slot)  # recognised as already in place
    replica.finish()
    expected = flatten([(e, _tensors()[e.name]) for e in plan.buckets[0].entries], plan.buckets[0].nbytes)
    assert torch.equal(replica.data(0), expected)
    assert replica.slot("not.planned") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_replica_packs_device_tensors_exactly():
    plan = build_plan([METAS], 1 << 20)
    replica = HostReplica(plan, 0)  # pinned because CUDA is available
    assert replica.data(0).is_pinned()
    replica.begin(1)
    for name, t in _tensors().items():
        replica.pack(name, t.cuda())
    cpu = flatten([(e, _tensors()[e.name]) for e in plan.buckets[0].entries], plan.buckets[0].nbytes)
    assert checksum(replica.data(0)) == checksum(cpu)
    assert torch.equal(replica.data(0), cpu)
    for algorithm in CHECKSUMS:
        assert checksum(replica.data(0).cuda(), algorithm) == checksum(cpu, algorithm), algorithm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_buckets_fill_the_host_replica_on_a_side_stream():
    """NCCL path: converted into device buckets, sent from there; the host copy lands off the critical path."""
    metas = METAS * 1
    plan = build_plan([metas], 64)  # several buckets, so the pool's buffers are reused
    replica = HostReplica(plan, 0, device=torch.device("cuda", 0))
    for version in (1, 2):
        replica.begin(version)
        tensors = _tensors(version)
        for name, t in tensors.items():
            slot = replica.slot(name)
            assert slot.is_cuda
            slot.copy_(t.cuda())
            bucket = replica.pack(name, slot)
            if replica.is_complete(bucket.index):
                payload = replica.payload(bucket.index)
                assert payload.is_cuda and payload.numel() == bucket.nbytes
                device_sum = checksum(payload, "wsum64")
                replica.fill_host(bucket.index)
                replica.release(bucket.index)
                assert checksum(replica.data(bucket.index), "wsum64") == device_sum
        replica.finish()
        for name, t in tensors.items():
            assert torch.equal(_bits(replica.view(name)), _bits(t)), (version, name)
