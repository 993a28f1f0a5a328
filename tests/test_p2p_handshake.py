"""The P2P start-up pieces without a model: engine layouts from what ranks publish, errors shared by every
rank, and reports that do not pile up in the store."""

from __future__ import annotations

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


def test_a_consumed_report_is_deleted_from_the_store():
    import datetime

    import torch.distributed as dist

    from megatron_sync.transport.group import StoreBoard
    from tests.support.dist import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), None, True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    board = StoreBoard(store, prefix="p2p_test/", rank=0, timeout_s=5)
    board.post("p2p/v1.1/report/0/1", b"{}")
    assert board.fetch("p2p/v1.1/report/0/1") == b"{}"
    board.delete("p2p/v1.1/report/0/1")
    with pytest.raises(PeerFailureError, match="nothing was posted"):
        board.fetch("p2p/v1.1/report/0/1", 0.05)
