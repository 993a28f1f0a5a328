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


def test_taken_reports_stay_until_the_version_is_agreed_and_then_nothing_is_left_in_the_store():
    """A receiver takes each report with one request to the store (a blocking get: a wait and a read), and the
    reports, releases and base of an attempt are deleted together once every rank agreed on it (`forget`), not
    one by one inside the sync, where at full scale every request queues at the one store."""
    import datetime
    import threading

    import torch.distributed as dist

    from megatron_sync.session.board import store_board
    from megatron_sync.transports.p2p.notices import Notices, RoundReport
    from tests.support.dist import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), None, True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    empty = store.num_keys()
    board = store_board(store, prefix="p2p_test/", rank=0, timeout_s=5, blocking=True)
    notices = Notices(board, version=3, attempt=1)
    notices.post_base(0, 128)
    notices.release(0, 0)
    notices.report("trainer/0", 0, 0, RoundReport({7: 99}, 4096))
    late = threading.Timer(0.2, notices.report, ("trainer/1", 0, 1, RoundReport({8: -5}, 512)))
    late.start()  # posted while the receiver already waits for it
    assert notices.take_report("trainer/0", 0, 0, 5.0) == RoundReport({7: 99}, 4096)
    assert notices.take_report("trainer/1", 0, 1, 5.0) == RoundReport({8: -5}, 512)
    late.join()
    assert store.num_keys() == empty + 4  # the two reports are kept until the attempt is agreed
    with pytest.raises(PeerFailureError, match="nothing was posted"):
        notices.take_report("trainer/2", 0, 0, 0.05)
    notices.forget(0, rounds=2)
    assert store.num_keys() == empty and notices.taken == []
    board.close()
