"""What P2P endpoints tell each other beside the bytes: reports of a round's pieces, and window releases.

On the control board (the transport group's store), under keys that carry the version and the attempt
(a version that failed is sent again under the same number and must not read the old notices):

- a report, from a writer to a receiver once its writes of one round landed: the checksum of every piece
  and the bytes its mover wrote, or the error that stopped it (the receiver then aborts at once instead of
  waiting out `timeout_s`); a forwarder relays the trainer's checksums in its own report;
- a release, from a receiver with a bounded window once a round was verified, copied out and forwarded:
  writers may then write the next round into that window; `abort` tells them the receiver gave up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megatron_sync.core.errors import PeerFailureError
from megatron_sync.session.board import Board

ABORT = b"abort"
PAUSE_S = 0.01
"""On a polled board, the longest pause between two looks for a notice: a sync waits on them, so each pause is
latency. The transport's and a fleet's notices go on blocking boards (`TransportGroup.control_board`), whose
waits take a notice the moment it is posted and ignore this."""


def trainer(rank: int) -> str:
    """Return the endpoint name of trainer rank `rank`."""
    return f"trainer/{rank}"


def receiver(index: int) -> str:
    """Return the endpoint name of inference rank `index` (where writes to it land)."""
    return f"receiver/{index}"


@dataclass
class RoundReport:
    """What a writer tells a receiver about one round: checksums by piece index, bytes moved, or an error."""

    checksums: dict[int, int] = field(default_factory=dict)
    nbytes: int = 0
    error: Optional[str] = None

    def to_bytes(self) -> bytes:
        return json.dumps({"checksums": sorted(self.checksums.items()), "bytes": self.nbytes,
                           "error": self.error}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "RoundReport":
        d = json.loads(raw)
        return cls({int(i): int(s) for i, s in d["checksums"]}, int(d["bytes"]), d["error"])


@dataclass(frozen=True)
class Notices:
    """The keys of one sync attempt of `version` on `board`, or, with `shards`, on the board of the notice
    store that serves the receiver a notice is about (`session/shards.py`: one store per engine)."""

    board: Board
    version: int
    attempt: int | str
    shards: Optional[Callable[[int], Board]] = field(default=None, compare=False)  # receiver -> its board
    taken: list[tuple[Board, str]] = field(default_factory=list, compare=False)  # deleted by `forget`

    def _key(self, *parts: object) -> str:
        return "/".join(["p2p", f"v{self.version}.{self.attempt}", *map(str, parts)])

    def _on(self, receiver: int) -> Board:
        return self.board if self.shards is None else self.shards(receiver)

    def report(self, source: str, to: int, round_: int, report: RoundReport) -> None:
        """Post `source`'s report of `round_` to receiver `to`."""
        self._on(to).post(self._key("report", to, round_, source), report.to_bytes())

    def take_reports(self, sources: list[str], to: int, round_: int, timeout_s: float) -> dict[str, RoundReport]:
        """Return the report of `round_` to receiver `to` of every one of `sources`, taken in one request to the
        store once all are posted (a round has a report from each of its writers; at full scale a store serves
        tens of thousands of reports a version, `bench/bench_store.py`). When they are not all posted within
        `timeout_s`, the PeerFailureError raised names the first writer whose report is missing (its `source`);
        one the store itself raises (it is silent or gone) names no writer."""
        if not sources:
            return {}
        board = self._on(to)
        keys = [self._key("report", to, round_, source) for source in sources]
        values = board.fetch_all(keys, timeout_s, max_pause_s=PAUSE_S)
        if values is None:
            for source, key in zip(sources, keys):
                if board.fetch_all([key], 0.0) is None:
                    missing = PeerFailureError(f"[rank {board.rank}] nothing was posted under {key!r} within "
                                               f"{timeout_s:g}s")
                    missing.source = source  # whose report is missing
                    raise missing
            return self.take_reports(sources, to, round_, timeout_s)  # all came just after the deadline
        self.taken.extend((board, key) for key in keys)
        return {source: RoundReport.from_bytes(value) for source, value in zip(sources, values)}

    def release(self, index: int, round_: int, value: bytes = b"ok") -> None:
        """Post that receiver `index` is done with `round_` of its window (`ABORT`: it gave up)."""
        self._on(index).post(self._key("release", index, round_), value)

    def released(self, index: int, round_: int, timeout_s: float) -> bool:
        """Wait until receiver `index` released `round_`; return False when it gave up instead."""
        return self._on(index).fetch(self._key("release", index, round_), timeout_s, max_pause_s=PAUSE_S) != ABORT

    def post_base(self, index: int, base: int) -> None:
        """Post where receiver `index`'s target set starts in its window this version (what a rank forwarding
        into it writes at: engines of a fleet flip their staging sets on their own commits)."""
        self._on(index).post(self._key("base", index), str(base).encode())

    def base(self, index: int, timeout_s: float) -> int:
        """Return receiver `index`'s posted `post_base`, waiting up to `timeout_s`."""
        return int(self._on(index).fetch(self._key("base", index), timeout_s, max_pause_s=PAUSE_S))

    def forget(self, index: int, rounds: int) -> None:
        """Delete the reports taken through these notices and receiver `index`'s releases and base of this
        attempt (every writer is past them once the ranks agreed on the version), so they do not pile up in
        the store."""
        for board, key in self.taken:
            board.remove(key)
        self.taken.clear()
        for round_ in range(rounds):
            self._on(index).remove(self._key("release", index, round_))
        self._on(index).remove(self._key("base", index))


def engine_boards(group: Any, receivers: Sequence[Any]) -> Callable[[int], Board]:
    """Return, for `Notices.shards`, the board of the notice store of each receiver's engine (`receivers`: the
    schedule's, each with its `engine`): the group's notice stores, one per engine (`session/shards.py`)."""
    engines = sorted({r.engine for r in receivers})
    shards = group.notice_shards(len(engines))
    shard_of = [engines.index(r.engine) for r in receivers]
    return lambda receiver: shards.board(shard_of[receiver])


class PostedBases(Mapping):
    """Where each receiver's target set starts this version, as it posts it (`Notices.post_base`) once the set
    may be written: by receiver index, fetched at first use, waiting up to `timeout_s` (one staging set: the
    set holds the live version until the receiver's host copy of it is done)."""

    def __init__(self, notices: Notices, timeout_s: float) -> None:
        self.notices, self.timeout_s = notices, timeout_s
        self._known: dict[int, int] = {}

    def __getitem__(self, index: int) -> int:
        if index not in self._known:
            self._known[index] = self.notices.base(index, self.timeout_s)
        return self._known[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._known)

    def __len__(self) -> int:
        return len(self._known)
