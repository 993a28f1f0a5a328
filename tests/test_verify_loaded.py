"""The engines prove what they hold: after loading a version, every engine rank's params are checked against
digests of what was sent, region by region (`megatron_sync.layout.loaded`).

Pure: the digests a receiver records name the param and region that differ, for whole tensors (bucket
transports) and for the trainer's own piece digests (P2P). Through the drivers, a Megatron trainer and a
reference engine of two ranks over broadcast, P2P (NIXL) and ipc: right after engine rank 1 loads version 2,
one byte of its live copy of one tensor changes (a fault the wire cannot see). Version 2 fails on every rank,
naming rank, param and region; the engine is back on version 1 exactly; the next sync commits.
"""

from __future__ import annotations

import pytest
import torch

from megatron_sync.layout.loaded import ExpectedRegions, LoadCheck
from megatron_sync.layout.rank import one_param_per_tensor
from megatron_sync.layout.regions import Region, TensorSpec


def _layout():
    specs = [TensorSpec("a.weight", (4, 6), torch.float32), TensorSpec("b.weight", (8,), torch.bfloat16)]
    return specs, one_param_per_tensor(specs, lambda s: Region.box(s.shape, 0, 1, 2) if s.name == "a.weight"
                                       else Region.whole(s.shape))


def test_a_changed_byte_is_named_by_param_and_region_and_equal_params_pass():
    specs, layout = _layout()
    full = {"a.weight": torch.arange(24, dtype=torch.float32).view(4, 6), "b.weight": torch.ones(8, dtype=torch.bfloat16)}
    expected = ExpectedRegions(layout, "xxh3")
    for name, t in full.items():
        expected.record_tensor(name, t)
    loaded = {"a.weight": full["a.weight"][1:3].clone(), "b.weight": full["b.weight"].clone()}
    assert expected.check(loaded, "inference rank 3") is None
    loaded["b.weight"].view(torch.uint8)[5] ^= 0x10
    problem = expected.check(loaded, "inference rank 3")
    assert problem.startswith("inference rank 3: the loaded weights differ from what was sent: b.weight bytes [0, 16)")
    assert "of b.weight" in problem and "a.weight" not in problem


@pytest.mark.parametrize("algorithm", ["xxh3", "crc32"])
def test_checking_live_weights_leaves_them_releasable(algorithm):
    """A colocated engine frees its live weights with `resize_(0)`; reading them for a digest must not pin
    their storage (numpy's view would), and a digest of a strided view equals its contiguous copy's."""
    from megatron_sync.core.checksum import checksum

    def flat(t):
        return t.contiguous().view(-1).view(torch.uint8)

    live = torch.randn(64, 32)
    assert checksum(flat(live)[4:100], algorithm) == checksum(flat(live.clone())[4:100], algorithm)
    assert checksum(flat(live), algorithm) == checksum(flat(live.clone()), algorithm) != checksum(flat(live + 1), algorithm)
    assert checksum(flat(live.t()), algorithm) == checksum(flat(live.t().contiguous()), algorithm)
    live.untyped_storage().resize_(0)
    assert live.untyped_storage().nbytes() == 0


def test_pieces_land_in_the_param_their_staging_offset_is_in():
    _, layout = _layout()
    staged = torch.arange(layout.nbytes, dtype=torch.int32).to(torch.uint8)
    params = layout.param_views(staged)
    expected = ExpectedRegions(layout, "wsum64")
    from megatron_sync.core.checksum import checksum
    at = layout.param_offsets["b.weight"] + 4
    expected.record_piece(at, 8, "b.weight", "rows 2..5", checksum(staged[at:at + 8], "wsum64"))
    assert expected.check(params, "inference rank 0") is None
    params["b.weight"].view(torch.uint8)[4] ^= 1  # inside the piece
    assert "b.weight bytes [4, 12) (rows 2..5 of b.weight)" in expected.check(params, "inference rank 0")


def test_the_check_runs_every_nth_version_and_not_without_a_checksum():
    _, layout = _layout()

    class Engine:
        def loaded_params(self):
            return {}

    check = LoadCheck(layout, Engine(), "xxh3", every=3, who="r")
    assert [v for v in range(1, 8) if (check.begin(v), check.due)[1]] == [1, 4, 7]
    assert not LoadCheck(layout, Engine(), "none", every=1, who="r").on
    assert not LoadCheck(layout, object(), "xxh3", every=1, who="r").on  # an engine that cannot show its params
    assert not LoadCheck(layout, Engine(), "xxh3", every=0, who="r").on


UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
TRANSPORTS = [
    pytest.param({"transport": "broadcast"}, id="broadcast"),
    pytest.param({"transport": "p2p", "p2p_backend": "nixl"}, id="p2p-nixl"),
    pytest.param({"transport": "ipc"}, id="ipc"),
]
PLANTED = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_region_changed_after_loading_fails_the_version_everywhere_and_the_engine_keeps_the_previous(transport):
    from tests.support.jobs import run_pair

    case = {"spec": {"family": "qwen3"}, "layout": {"tp": 2}, "engine_tp": 2, "versions": 3, "env": UCX_TCP,
            "record_failures": True, "corrupt_after_load": (2, 1, PLANTED),
            "weight_sync": {"bucket_size_mb": 0.05, **transport}}
    trainers, engines = run_pair(case, timeout=360)
    failures = trainers[0]["failures"]
    assert len(failures) == 1 and failures[0]["step"] == 2 and failures[0]["aborted"], failures
    text = failures[0]["text"]
    assert "the loaded weights differ from what was sent" in text and f"of {PLANTED}" in text, text[-2000:]
    assert "inference rank 1" in text
    for engine in engines:
        versions = [h["version"] for h in engine["held"]]
        assert versions == [1, 1, 2], versions  # step 2 aborted (still version 1), step 3 synced version 2
        first, after_abort = engine["held"][0]["shards"], engine["held"][1]["shards"]
        assert all(torch.equal(first[n], after_abort[n]) for n in first), "the engine is not exactly on version 1"
