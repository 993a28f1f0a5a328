"""The P2P start-up pieces without a model: engine layouts from what ranks publish, errors shared by every
rank, and reports that do not pile up in the store."""

from __future__ import annotations

import pytest

from megatron_sync.core.errors import AgreedFailure, PeerFailureError
from megatron_sync.transports.p2p.handshake import exchange


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

    from megatron_sync.session.board import store_board
    from tests.support.dist import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), None, True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    board = store_board(store, prefix="p2p_test/", rank=0, timeout_s=5)
    board.post("p2p/v1.1/report/0/1", b"{}")
    assert board.fetch("p2p/v1.1/report/0/1") == b"{}"
    board.remove("p2p/v1.1/report/0/1")
    with pytest.raises(PeerFailureError, match="nothing was posted"):
        board.fetch("p2p/v1.1/report/0/1", 0.05)
