"""The P2P start-up pieces without a model: engine layouts from what ranks publish, errors shared by every
rank, and a rendezvous where the inference side does not know how many trainer ranks there are."""

from __future__ import annotations

import threading

import pytest

from megatron_sync.errors import AgreedFailure, PeerFailureError
from megatron_sync.p2p.handshake import exchange, fleet_layouts
from megatron_sync.p2p.layout import ReferenceLayout, VllmLayout


def test_fleet_layouts_form_engines_of_consecutive_ranks():
    ref, vllm = ReferenceLayout(2, num_kv_heads=1).to_wire(), VllmLayout(2, num_kv_heads=2).to_wire()
    engines = fleet_layouts([ref, ref, vllm, vllm], engine_tp_size=2)
    assert [e.to_wire() for e in engines] == [ref, vllm]


@pytest.mark.parametrize("published,words", [
    ([ReferenceLayout(2, num_kv_heads=1).to_wire(), ReferenceLayout(2, num_kv_heads=2).to_wire()],
     "publish different layouts"),
    ([ReferenceLayout(1, num_kv_heads=1).to_wire()] * 2, "tp_size=1, but weight_sync.engine_tp_size=2"),
    ([{"kind": "sglang", "tp_size": 2}] * 2, "kind 'sglang' is unknown"),
    ([ReferenceLayout(2, num_kv_heads=1).to_wire()] * 3, "do not form engines"),
])
def test_fleet_layouts_refuse_what_does_not_fit_by_name(published, words):
    with pytest.raises(ValueError, match=words):
        fleet_layouts(published, engine_tp_size=2)


class _Gathers:
    """A transport of `world` ranks seen from rank 0: the others answer with `others`."""

    rank = 0

    def __init__(self, others):
        self.others = others

    def all_gather_json(self, obj):
        return [obj, *self.others]


def test_exchange_returns_every_rank_value_or_fails_all_with_the_rank_that_raised():
    assert exchange(_Gathers([[None, 2]]), "counting", lambda: 1) == [1, 2]
    with pytest.raises(AgreedFailure, match=r"P2P start-up: counting failed on 2 rank\(s\) \[0, 1\]") as info:
        exchange(_Gathers([["remote trouble", None]]), "counting", lambda: 1 / 0)
    assert "ZeroDivisionError" in info.value.failures[0][1] and info.value.failures[1] == (1, "remote trouble")


def test_members_that_do_not_know_the_group_size_learn_it_and_count_from_the_end():
    from megatron_sync.transport.group import init_transport_group
    from tests.support.dist import free_port

    port, world, results = free_port(), 3, {}

    def join(size, rank):
        group = init_transport_group("127.0.0.1", port, size, rank, timeout=30, group_name="size_test")
        seen = group.all_gather_json(group.rank)
        key = f"consumed/{group.rank}"
        group.board.post(key, b"1")
        group.board.delete(key)
        try:
            group.board.fetch(key, 0.05)
            deleted = False
        except PeerFailureError:
            deleted = True
        group.all_gather_json(None)  # every rank is done with the store before its host closes it
        results[rank] = (group.rank, group.world_size, seen, deleted)
        group.close()

    threads = [threading.Thread(target=join, args=args) for args in [(world, 0), (None, -2), (None, -1)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: (0, 3, [0, 1, 2], True), -2: (1, 3, [0, 1, 2], True), -1: (2, 3, [0, 1, 2], True)}
    with pytest.raises(ValueError, match="rank counts from the end"):
        init_transport_group("127.0.0.1", port, None, 0)
