"""The transfer plan as tables of invariants, plus an in-process walk of it (pure, no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_sync.transports.p2p.plan import build_transfer_plan
from tests.p2p_support import fusing, ref, synthetic_plan as _setup


CASES = [
    pytest.param("qwen3", [ref(1)], 2, 4096, 2, id="ref-tp1"),
    pytest.param("llama", [ref(2)], 2, 4096, 1, id="ref-tp2-replicated-kv"),
    pytest.param("qwen3_moe", [ref(1), ref(2)], 4, 1 << 20, 2, id="two-engines"),
    pytest.param("qwen3_moe", [fusing(4)], 4, 4096, 2, id="fusing-tp4"),
    pytest.param("qwen3_moe", [fusing(2, expert_parallel=True), ref(2)], 3, 8192, 2, id="fusing-ep2-and-ref"),
    pytest.param("deepseek_v3", [fusing(2), ref(4)], 4, 4096, 4, id="mla-two-engines"),
]


@pytest.mark.parametrize("family,engines,senders,bucket,kv", CASES)
def test_every_receiver_gets_each_of_its_shards_exactly_once(family, engines, senders, bucket, kv):
    specs, receivers, _, plan = _setup(family, engines, senders, bucket, kv=kv)
    for index, receiver in enumerate(receivers):
        offsets = receiver.layout.param_offsets
        mine = sorted((r.dst, r.dst + r.nbytes, r.name) for r in plan.ranges if r.receiver == index)
        for (_, end, _), (start, _, _) in zip(mine, mine[1:]):
            assert end <= start, "two ranges overlap in one receiver's staging"
        want = sorted((offsets[p.param] + p.offset, offsets[p.param] + p.offset + p.nbytes, p.name)
                      for p in receiver.layout.placements if p.nbytes)
        merged = []
        for start, end, name in mine:  # ranges of one placement tile it with no gap
            if merged and merged[-1][1] == start and merged[-1][2] == name:
                merged[-1] = (merged[-1][0], end, name)
            else:
                merged.append((start, end, name))
        assert merged == want


@pytest.mark.parametrize("family,engines,senders,bucket,kv", CASES)
def test_bytes_per_receiver_equal_its_shard_bytes(family, engines, senders, bucket, kv):
    _, receivers, _, plan = _setup(family, engines, senders, bucket, kv=kv)
    got = plan.bytes_to_receiver()
    assert [got[i] for i in range(len(receivers))] == [r.layout.shard_bytes for r in receivers]


@pytest.mark.parametrize("family,engines,senders,bucket,kv", CASES)
def test_no_sender_idle_and_messages_within_the_bucket(family, engines, senders, bucket, kv):
    _, _, holders, plan = _setup(family, engines, senders, bucket, kv=kv)
    assert plan.senders() == sorted(set(holders.values())) == list(range(senders))
    for m in plan.messages:
        ranges = [plan.ranges[i] for i in m.ranges]
        assert m.nbytes == sum(r.nbytes for r in ranges)
        assert {(r.sender, r.receiver) for r in ranges} == {(m.sender, m.receiver)}
        assert m.nbytes <= bucket or (len(ranges) == 1 and ranges[0].rows == 1)
    assert sorted(i for m in plan.messages for i in m.ranges) == list(range(len(plan.ranges)))


@pytest.mark.parametrize("family,engines,senders,bucket,kv", CASES)
def test_sender_queues_keep_pair_order_and_start_on_different_receivers(family, engines, senders, bucket, kv):
    _, receivers, _, plan = _setup(family, engines, senders, bucket, kv=kv)
    firsts = []
    for sender in plan.senders():
        queue = plan.sender_queue(sender)
        assert sorted(m.index for m in queue) == [m.index for m in plan.messages if m.sender == sender]
        for receiver in range(len(receivers)):  # a two-sided transport matches messages per pair in order
            pair = [m.index for m in queue if m.receiver == receiver]
            assert pair == sorted(pair)
        firsts.append(queue[0].receiver)
    if len(plan.senders()) <= len(receivers):
        assert len(set(firsts)) == len(firsts), firsts


def test_plan_is_deterministic_and_its_digest_sees_every_input():
    args = ("qwen3_moe", [ref(1), fusing(2)], 3, 4096)
    a, b = _setup(*args)[3], _setup(*args)[3]
    assert a.digest() == b.digest()
    assert _setup("qwen3_moe", [ref(1), fusing(2)], 3, 8192)[3].digest() != a.digest()
    assert _setup("qwen3_moe", [ref(1), fusing(2)], 2, 4096)[3].digest() != a.digest()
    assert _setup("qwen3_moe", [fusing(2), ref(1)], 3, 4096)[3].digest() != a.digest()


@pytest.mark.parametrize("family,engines,senders,bucket,kv", CASES)
def test_walking_the_plan_in_process_fills_every_receiver_exactly(family, engines, senders, bucket, kv):
    specs, receivers, holders, plan = _setup(family, engines, senders, bucket, kv=kv)
    full = {s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(i)).to(s.dtype)
            for i, s in enumerate(specs)}
    held = {sender: {n: full[n] for n, h in holders.items() if h == sender} for sender in plan.senders()}
    staging = [torch.zeros(r.layout.nbytes, dtype=torch.uint8) for r in receivers]
    for sender in plan.senders():
        for m in plan.sender_queue(sender):
            for i in m.ranges:
                r = plan.ranges[i]
                staging[r.receiver][r.dst:r.dst + r.nbytes] = r.source(held[sender][r.name])
    for receiver, buf in zip(receivers, staging):
        want = torch.zeros_like(buf)
        for name in receiver.layout.by_name:
            receiver.layout.write(want, name, full[name])
        assert torch.equal(buf, want)


def test_balancing_by_sent_bytes_evens_out_senders():
    # The reference engine replicates embeddings and lm_head: by held bytes, their holders send far more.
    _, _, _, by_memory = _setup("qwen3", [ref(2), ref(2)], 4, 1 << 20, balance_sends=False)
    _, _, _, by_sends = _setup("qwen3", [ref(2), ref(2)], 4, 1 << 20, balance_sends=True)

    def spread(plan):
        sent = plan.bytes_from_sender().values()
        return max(sent) / (sum(sent) / len(sent))

    assert spread(by_sends) < spread(by_memory)
    assert spread(by_sends) < 1.1


def test_a_tensor_without_holder_names_it():
    specs, receivers, holders, _ = _setup("qwen3", [ref(1)], 1, 4096)
    holders = dict(holders)
    del holders["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight.*no trainer rank holds it"):
        build_transfer_plan(specs, holders, receivers, 4096)


def test_large_shards_split_into_whole_rows():
    specs, receivers, _, plan = _setup("qwen3", [ref(1)], 1, 1000)
    embed = [r for r in plan.ranges if r.name == "model.embed_tokens.weight"]
    row_bytes = 64 * 2
    assert all(r.nbytes == r.rows * row_bytes and r.nbytes <= 1000 for r in embed)
    assert sum(r.rows for r in embed) == 250 and math.ceil(250 / (1000 // row_bytes)) == len(embed)
