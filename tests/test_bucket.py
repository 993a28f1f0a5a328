"""Buckets and the host replica: byte-exact round trips, checksum, slot checks."""

from __future__ import annotations

import pytest
import torch

from megatron_sync.bucket import checksum, flatten, unpack
from megatron_sync.meta import TensorMeta
from megatron_sync.plan import build_plan
from megatron_sync.replica import HostReplica

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


def test_checksum_detects_a_flipped_byte():
    plan = build_plan([METAS], 1 << 20)
    (bucket,) = plan.buckets
    data = flatten([(e, _tensors()[e.name]) for e in bucket.entries], bucket.nbytes)
    before = checksum(data)
    assert before == checksum(data.clone())
    for position in (0, bucket.nbytes // 2, bucket.nbytes - 1):
        corrupted = data.clone()
        corrupted[position] ^= 0x01
        assert checksum(corrupted) != before


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
    assert replica.checksum(0) == checksum(cpu)
    assert torch.equal(replica.data(0), cpu)
    assert checksum(replica.data(0).cuda()) == checksum(cpu)
