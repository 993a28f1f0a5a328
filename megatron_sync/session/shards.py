"""Notice stores beside a transport group's store: one per engine, so no one store serves every notice.

At full scale every P2P notice of a sync (a writer's report that a round landed, with its checksums; a
receiver's take of a round's reports; releases and bases) is a request to a store, and a TCPStore server
serves its requests one at a time (`bench/bench_store.py`: 6 us of its CPU per report posted, 21 us per take
here). Through the session's one store, Kimi-K2 into 8 engines of TP=32 is 64,000 reports a version, and the
chained engines' grow with the fleet. So group rank 0 (the trainer's leader, which hosts the session's store)
hosts `count` more stores, each serving the notices addressed to the ranks of one engine; it posts their ports
on the group's board, and every rank connects to a shard the first time it posts or waits there. They live
on the same host as the session's store, so a stopped or dead host is found the same way, and once one of
its stores is silent all are (`BoundedStore.beside`). A rank may also reach another group's notice stores over
the same store (`of`): in a fleet, the engine forwarding into engine B reports on B's link's store.
"""

from __future__ import annotations

import datetime
import json
import threading
from typing import Any, Optional

import torch.distributed as dist

from megatron_sync.session.board import Board, store_board

PORTS = "notice-stores"
"""The key group rank 0 posts the shards' ports under (the group's board)."""


class NoticeShards:
    """`count` notice stores hosted by group rank 0 of `group` (or of the group named `of` over the same store,
    which hosts them itself), and this rank's boards on them."""

    def __init__(self, group: Any, count: int, *, of: Optional[str] = None) -> None:
        self.group, self.count = group, count
        self.name = of or group.group_name  # the group whose notice stores these are
        self._servers: list[Any] = []
        self._boards: dict[int, Board] = {}
        self._clients: list[Any] = []
        self._ports: Optional[list[int]] = None
        self._lock = threading.Lock()
        if of is None and group.rank == 0:
            timeout = datetime.timedelta(seconds=group.timeout_s)
            self._servers = [dist.TCPStore(group.store_host, 0, None, True, timeout=timeout, wait_for_workers=False)
                             for _ in range(count)]
            self._ports = [server.port for server in self._servers]
            group.board.post(f"{PORTS}/{count}", json.dumps(self._ports).encode())

    def board(self, shard: int) -> Board:
        """Return this rank's blocking board on notice store `shard` (connected at first use; a host that is
        gone raises PeerFailureError)."""
        with self._lock:
            if shard not in self._boards:
                if self._ports is None:
                    self._ports = self._fetch_ports()
                try:
                    self._boards[shard] = self._connect(self._ports[shard])
                except (RuntimeError, dist.DistError) as e:
                    raise self.group.failure(f"connecting to notice store {shard}", e) from e
            return self._boards[shard]

    def _fetch_ports(self) -> list[int]:
        """Return the stores' ports as group rank 0 posted them on its group's board (this group's, or the
        other group's board over the same store, read once)."""
        g = self.group
        if self.name == g.group_name:
            return json.loads(g.board.fetch(f"{PORTS}/{self.count}"))
        posts = store_board(g.store_client, prefix=f"{self.name}/post/", rank=g.rank, timeout_s=g.timeout_s,
                            failure=g.failure)
        try:
            return json.loads(posts.fetch(f"{PORTS}/{self.count}"))
        finally:
            posts.close()

    def _connect(self, port: int) -> Board:
        g = self.group
        client = g.store_client.beside(g.store_host, port)
        self._clients.append(client)
        return store_board(client, prefix=f"{self.name}/notice/", rank=g.rank, timeout_s=g.timeout_s,
                           failure=g.failure, blocking=True)

    def close(self) -> None:
        """Close this rank's boards. Group rank 0 goes on serving until this object is dropped (with its
        group): a peer may still be reading the error reports of a failed version, as the session's own
        store lingers for it."""
        for board in self._boards.values():
            board.close()
        for client in self._clients:
            client.close()
        self._boards, self._clients = {}, []
