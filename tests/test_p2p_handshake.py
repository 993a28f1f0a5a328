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
    assert notices.take_reports(["trainer/0"], 0, 0, 5.0) == {"trainer/0": RoundReport({7: 99}, 4096)}
    assert notices.take_reports(["trainer/1"], 0, 1, 5.0) == {"trainer/1": RoundReport({8: -5}, 512)}
    late.join()
    assert store.num_keys() == empty + 4  # the two reports are kept until the attempt is agreed
    with pytest.raises(PeerFailureError, match="nothing was posted"):
        notices.take_reports(["trainer/2"], 0, 0, 0.05)
    # a round's reports from all its writers in one request, one of them posted while the receiver waits
    notices.report("trainer/0", 0, 2, RoundReport({9: 1}, 8))
    late = threading.Timer(0.2, notices.report, ("trainer/1", 0, 2, RoundReport(error="trainer rank 1 failed")))
    late.start()
    assert notices.take_reports(["trainer/0", "trainer/1"], 0, 2, 5.0) == {
        "trainer/0": RoundReport({9: 1}, 8), "trainer/1": RoundReport(error="trainer rank 1 failed")}
    late.join()
    assert notices.take_reports([], 0, 3, 5.0) == {}
    notices.report("trainer/0", 0, 3, RoundReport({10: 2}, 8))  # trainer/1 never reports round 3: it is named
    with pytest.raises(PeerFailureError, match=r"nothing was posted under 'p2p/v3.1/report/0/3/trainer/1' within 0.2s"
                       ) as missing:
        notices.take_reports(["trainer/0", "trainer/1"], 0, 3, 0.2)
    assert missing.value.source == "trainer/1"
    notices.forget(0, rounds=2)
    assert store.num_keys() == empty + 1 and notices.taken == []  # only round 3's report, never taken, is left
    board.close()


def test_notices_about_each_engine_go_to_that_engines_own_store_hosted_beside_the_sessions():
    """Group rank 0 hosts one notice store per engine (`session/shards.py`); a report to a receiver lands on
    its engine's store, and another rank finds that store from the ports rank 0 posted."""
    import datetime
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_sync.session.board import store_board
    from megatron_sync.session.shards import NoticeShards
    from megatron_sync.session.store import BoundedStore
    from megatron_sync.transports.p2p.notices import Notices, RoundReport, engine_boards
    from tests.support.dist import free_port

    port = free_port()
    main = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10),
                         wait_for_workers=False)

    def group(rank: int):
        client = BoundedStore(dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10)),
                              where=f"127.0.0.1:{port}", timeout_s=5.0)
        g = SimpleNamespace(rank=rank, timeout_s=5.0, store_host="127.0.0.1", store_client=client, group_name="g",
                            failure=lambda op, e: PeerFailureError(f"{op}: {e}"), shards=None)
        g.board = store_board(client, prefix="g/post/", rank=rank, timeout_s=5.0)
        g.notice_shards = lambda count: g.shards or setattr(g, "shards", NoticeShards(g, count)) or g.shards
        return g

    host, writer = group(0), group(1)
    receivers = [SimpleNamespace(engine=e) for e in (0, 0, 1, 1)]  # two engines of two ranks
    before = main.num_keys()
    on_writer = Notices(writer.board, 1, 1, shards=engine_boards(writer, receivers))
    on_host = Notices(host.board, 1, 1, shards=engine_boards(host, receivers))
    on_writer.report("trainer/1", 3, 0, RoundReport({5: 6}, 10))  # receiver 3: engine 1's store
    assert on_host.take_reports(["trainer/1"], 3, 0, 5.0) == {"trainer/1": RoundReport({5: 6}, 10)}
    engine1 = dist.TCPStore("127.0.0.1", host.shards._ports[1], None, False, timeout=datetime.timedelta(seconds=5))
    assert engine1.check(["g/notice/p2p/v1.1/report/3/0/trainer/1"])
    assert main.num_keys() == before + 1  # the session's store holds the ports, no notice
    for g in (writer, host):
        g.shards.close()


def test_a_fleet_engine_reports_what_it_forwards_on_the_next_engines_link_store_not_the_root_store():
    """In a fleet each engine has its own link (a transport group over the session's root store, whose rank 0,
    the trainer's leader, hosts the link's notice store). The engine forwarding into engine 1 reports on
    engine 1's link store, found from the link name engine 1 posted on the root board; engine 1 takes the
    report from its own link's store; the root store holds the ports and link names, no report."""
    import datetime

    import torch.distributed as dist

    from megatron_sync.session.board import store_board
    from megatron_sync.session.group import TransportGroup
    from megatron_sync.session.store import BoundedStore
    from megatron_sync.transports.p2p.notices import RoundReport
    from megatron_sync.transports.p2p.receiver import FleetPlace
    from tests.support.dist import free_port

    port = free_port()
    root = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10),
                         wait_for_workers=False)

    def link(engine: int, rank: int, generation: int = 1) -> TransportGroup:  # a link's store side: no collective
        client = BoundedStore(dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10)),
                              where=f"127.0.0.1:{port}", timeout_s=5.0)
        return TransportGroup(None, client, rank=rank, world_size=2, backend="gloo", timeout_s=5.0,
                              group_name=f"megatron_sync_p2p/s/link-e{engine}g{generation}")

    trainer = [link(engine, 0) for engine in (0, 1)]  # the trainer leader hosts both links' notice stores
    for group in trainer:
        group.notice_shards(1)
    engines = [link(engine, 1) for engine in (0, 1)]
    boards = [store_board(g.store_client, prefix="", rank=1, timeout_s=5.0, blocking=True) for g in engines]
    places = [FleetPlace(boards[e], e, 1, 0, engines[e]) for e in (0, 1)]
    before = root.num_keys()
    forwarder = places[0].route(7, {"sync": 3, "next": [1, 1]})
    chained = places[1].route(7, {"sync": 3, "feed": [0, 1]})
    forwarder.next_notices.report(forwarder.name, forwarder.next_index, 0, RoundReport({4: 9}, 64))
    assert chained.feed_notices.take_reports([forwarder.name], chained.me, 0, 5.0) == {
        forwarder.name: RoundReport({4: 9}, 64)}
    link1 = dist.TCPStore("127.0.0.1", trainer[1].notice_shards(1)._ports[0], None, False,
                          timeout=datetime.timedelta(seconds=5))
    assert link1.check([f"megatron_sync_p2p/s/link-e1g1/notice/p2p/v7.3.e1/report/0/0/{forwarder.name}"])
    assert root.num_keys() == before  # the links' ports and names were posted before; no report landed there
    # engine 1 restarted (generation 2, a new link): the forwarder reports on the new link's store, and lets go
    # of the old one
    trainer.append(link(1, 0, generation=2))
    trainer[-1].notice_shards(1)
    engines.append(link(1, 1, generation=2))
    FleetPlace(boards[1], 1, 2, 0, engines[-1])
    forwarder = places[0].route(8, {"sync": 4, "next": [1, 2]})
    forwarder.next_notices.report(forwarder.name, forwarder.next_index, 0, RoundReport({4: 9}, 64))
    link2 = dist.TCPStore("127.0.0.1", trainer[-1].notice_shards(1)._ports[0], None, False,
                          timeout=datetime.timedelta(seconds=5))
    assert link2.check([f"megatron_sync_p2p/s/link-e1g2/notice/p2p/v8.4.e1/report/0/0/{forwarder.name}"])
    assert "megatron_sync_p2p/s/link-e1g1" not in engines[0]._shards  # its boards there are closed
    for group in [*engines, *trainer]:
        group.close()
    for board in boards:
        board.close()
