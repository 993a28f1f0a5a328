"""An inference rank's receive of one version, round by round: land, verify, forward, copy out, release.

The bytes land in this rank's registered window: the target staging set itself (the default: nothing is
copied), or a bounded window (a NIC that cannot register a whole shard) whose rounds are copied into the
target set one by one. For each round the rank waits for the reports of everyone writing into it (the
trainer ranks holding its pieces, or the engine rank it is chained behind), checks every piece's checksum
where the bytes lie (on the GPU with `wsum64`), relays the pieces it owns into the other head receivers
that hold the same rows (the other ranks of its engine, mostly: the schedule's relay pieces, with the
trainer's checksums), takes and checks the relay pieces written into it, forwards the round from its window
to the engine rank chained behind it (relaying the trainer's checksums, so the end of the chain checks
against the source), copies a bounded window's round out and releases it. Verifying round r overlaps round
r + 1 arriving (into a bounded window of several slots too: `Schedule.slots`).

Who feeds a rank and whom it forwards to is its `Route`: by default the schedule's own chains (engines of
one session); a fleet, whose engines each have their own link, passes the route of each version.

A sender's error report or a piece that does not match raises a SyncError (the version is then aborted on
every rank, nothing applied); before raising, this rank tells whoever waits on it: the rank behind it gets
the error as its report, writers into a bounded window get `abort` as its release. A writer that stays
silent past `timeout_s` raises PeerFailureError.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_sync.core.checksum import checksum
from megatron_sync.core.errors import (CorruptBucketError, PeerFailureError, SenderFailedError, StoreSilentError,
                                       SyncError)
from megatron_sync.transports.p2p.movers import ByteMover, Span
from megatron_sync.transports.p2p.notices import ABORT, Notices, RoundReport, receiver, trainer
from megatron_sync.transports.p2p.schedule import TRAINER, Piece, Schedule


@dataclass
class ReceiveStats:
    """What one rank received (and forwarded) in one version."""

    bytes_per_peer: dict[str, int] = field(default_factory=dict)
    forwarded: int = 0
    relayed: int = 0
    pieces: int = 0
    sums: dict[int, int] = field(default_factory=dict)  # the trainer's checksum of every piece, by index
    checksum_seconds: float = 0.0
    copy_seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        """Return the bytes received from every writer together."""
        return sum(self.bytes_per_peer.values())


@dataclass(frozen=True)
class Route:
    """Where one rank's bytes of a version come from and go to.

    `name` is this rank's endpoint as its feed and successor address it; `feed` the endpoint writing into it
    (None: the schedule's trainer ranks, reporting on the version's own notices), reporting on `feed_notices`
    to index `me`; `next` the endpoint this rank forwards into (None: nobody), addressed as `next_index` on
    `next_notices`.
    """

    name: str
    me: int
    feed: Optional[str] = None
    feed_notices: Optional[Notices] = None
    next: Optional[str] = None
    next_index: int = 0
    next_notices: Optional[Notices] = None


class RoundReceiver:
    """Inference rank `index`'s part of every version of `schedule` (see the module doc).

    `window` is the registered memory writes land in: both staging sets (an unbounded window; a version's
    pieces land in its target set, `base` bytes in) or a separate bounded window.
    """

    def __init__(self, schedule: Schedule, index: int, mover: ByteMover, window: torch.Tensor, *,
                 algorithm: str, timeout_s: float) -> None:
        self.schedule, self.index, self.mover, self.window = schedule, index, mover, window
        self.algorithm, self.timeout_s = algorithm, timeout_s
        self.bounded = bool(schedule.options.window_bytes)
        self.rounds = schedule.rounds[index]
        self._pieces = [schedule.round_pieces(index, r) for r in range(self.rounds)]
        self._relays = [schedule.relays_from(index, r) for r in range(self.rounds)]
        self._relayed_into = any(p.relayed for p in schedule.incoming(index))

    def own_route(self, notices: Notices) -> Route:
        """Return the route the schedule gives this rank (its chain inside one session)."""
        feed, after = self.schedule.feeds[self.index], self.schedule.successor(self.index)
        return Route(receiver(self.index), self.index,
                     feed=None if feed == TRAINER else receiver(feed), feed_notices=notices,
                     next=None if after is None else receiver(after), next_index=after or 0, next_notices=notices)

    def receive_version(self, notices: Notices, target: torch.Tensor, base: int,
                        route: Optional[Route] = None) -> ReceiveStats:
        """Receive every round into `target` (this version's staging set, `base` bytes into an unbounded
        window) along `route` (default: the schedule's)."""
        route = route or self.own_route(notices)
        stats = ReceiveStats()
        at = 0 if self.bounded else base
        if route.feed is not None:  # the rank forwarding to us writes at our window's offsets
            route.feed_notices.post_base(route.me, at)
        elif self._relayed_into or self.schedule.options.posts_base:  # so do the head receivers relaying into
            notices.post_base(self.index, at)  # us, and with one staging set the trainer ranks
        # A two-sided mover's receives are posted for the whole version at once; every one is matched, by the
        # bytes or a failed writer's filler. (In a bounded window rounds share slots: a writer sends round
        # r only after the round before it in its slot was released, so the bytes still land in order.)
        posted = {r: self._expect(r, at, route) for r in range(self.rounds)} if self.mover.two_sided else {}
        round_, self._relayed_upto = 0, -1
        try:
            for round_ in range(self.rounds):
                self._round(round_, notices, route, target, at, stats, posted.get(round_, {}))
        except StoreSilentError:
            raise  # the trainer's host is stopped: nobody can be told through its stores, nothing will come
        except SyncError as e:
            self._give_up(notices, route, round_, f"inference rank {self.index}: {type(e).__name__}: {e}",
                          [p for rest in posted.values() for p in rest.values()])
            raise
        return stats

    def _expect(self, round_: int, at: int, route: Route) -> dict:
        return {source: self.mover.expect(source, self.window, [Span(0, at + p.window, p.nbytes) for p in mine])
                for sources in self._sources(round_, route) for source, mine in sources.items()}

    def _sources(self, round_: int, route: Route) -> tuple[dict[str, list[Piece]], dict[str, list[Piece]]]:
        """Return who writes into this round, with their pieces in the order they write them: the trainer
        ranks (or the rank forwarding to us, which writes everything), then the ranks relaying to us."""
        if route.feed is not None:
            return {route.feed: self._pieces[round_]}, {}
        direct: dict[str, list[Piece]] = {}
        relayed: dict[str, list[Piece]] = {}
        for p in self._pieces[round_]:
            if p.relayed:
                relayed.setdefault(receiver(p.via), []).append(p)
            else:
                direct.setdefault(trainer(p.sender), []).append(p)
        return direct, relayed

    def _round(self, round_: int, notices: Notices, route: Route, target: torch.Tensor, at: int,
               stats: ReceiveStats, posted: dict) -> None:
        pieces = self._pieces[round_]
        reports_on, me = (route.feed_notices, route.me) if route.feed is not None else (notices, self.index)
        direct, relayed = self._sources(round_, route)
        sums = self._take(direct, round_, reports_on, me, notices.version, route, stats, posted)
        started = time.perf_counter()
        self._verify([p for mine in direct.values() for p in mine], sums, at)
        stats.checksum_seconds += time.perf_counter() - started
        if route.feed is None and self._relays[round_]:
            stats.relayed += self._relay(round_, notices, sums, at)
        self._relayed_upto = round_
        if relayed:
            sums.update(self._take(relayed, round_, reports_on, me, notices.version, route, stats, posted))
            started = time.perf_counter()
            self._verify([p for mine in relayed.values() for p in mine], sums, at)
            stats.checksum_seconds += time.perf_counter() - started
        stats.sums.update(sums)
        stats.pieces += len(pieces)
        if route.next is not None:
            stats.forwarded += self._forward(round_, route, pieces, sums, at)
        if self.bounded:
            started = time.perf_counter()
            for p in pieces:
                target[p.dst:p.dst + p.nbytes].copy_(self.window[p.window:p.window + p.nbytes])
            stats.copy_seconds += time.perf_counter() - started
            reports_on.release(me, round_)

    def _take(self, sources: dict[str, list[Piece]], round_: int, reports_on: Notices, me: int, version: int,
              route: Route, stats: ReceiveStats, posted: dict) -> dict[int, int]:
        """Take the reports of `sources` on this round and wait for their bytes; return their checksums."""
        sums: dict[int, int] = {}
        failed = []
        try:
            reports = reports_on.take_reports(list(sources), me, round_, self.timeout_s)
        except PeerFailureError as e:
            source = getattr(e, "source", None)  # whose report is missing; None: the store failed (silent, gone)
            posted.pop(source, None)  # nothing will come from it
            if route.feed is None or source is None:
                raise  # a trainer rank or the trainer's store is silent: this transport is broken
            # the engine forwarding to us is gone or stuck; our own link is fine: abort this version only
            raise SenderFailedError(f"{source}, which forwards version {version} to this rank, sent "
                                    f"nothing of round {round_} within {self.timeout_s:g}s: {e}") from e
        for source, report in reports.items():
            if report.error is not None:
                failed.append(f"{source} failed while sending version {version}: {report.error}")
            sums.update(report.checksums)
            stats.bytes_per_peer[source] = stats.bytes_per_peer.get(source, 0) + report.nbytes
        for source in sources:  # the bytes, or a failed writer's filler
            pending = posted.pop(source, None)
            if pending is not None:
                pending.wait(self.timeout_s)
        if failed:
            raise SenderFailedError("; ".join(failed))
        return sums

    def _relay(self, round_: int, notices: Notices, sums: dict[int, int], at: int) -> int:
        """Write this round's relay pieces from where their origins landed in the window into the other head
        receivers holding them; report each with the trainer's checksums. Return the bytes written."""
        written = 0
        for peer, pieces in self._by_peer(self._relays[round_]).items():
            self._await_release(notices, peer, round_, f"inference rank {peer}, which this rank relays to")
            there = notices.base(peer, self.timeout_s)
            spans = [Span(at + self.schedule.piece(p.origin).window, there + p.window, p.nbytes) for p in pieces]
            before = self.mover.bytes_written.get(receiver(peer), 0)
            self.mover.write(receiver(peer), self.window, spans).wait(self.timeout_s)
            moved = self.mover.bytes_written.get(receiver(peer), 0) - before
            notices.report(receiver(self.index), peer, round_,
                           RoundReport({p.index: sums[p.origin] for p in pieces if p.origin in sums}, moved))
            written += moved
        return written

    def _verify(self, pieces: list[Piece], sums: dict[int, int], at: int) -> None:
        if self.algorithm == "none":
            return
        for p in pieces:
            if p.index not in sums:
                raise CorruptBucketError(f"inference rank {self.index}: no checksum was reported for piece {p.index}"
                                         f" of {p.name}; nothing is applied")
            if checksum(self.window[at + p.window:at + p.window + p.nbytes], self.algorithm) != sums[p.index]:
                raise CorruptBucketError(
                    f"inference rank {self.index}: piece {p.index} of {p.name} (rows {p.row}..{p.row + p.rows - 1}, "
                    f"{p.nbytes} bytes from trainer rank {p.sender}"
                    f"{f', relayed by inference rank {p.via}' if p.relayed else ''}) does not match its checksum; "
                    "nothing is applied")

    @staticmethod
    def _by_peer(pieces: list[Piece]) -> dict[int, list[Piece]]:
        by_peer: dict[int, list[Piece]] = {}
        for p in pieces:
            by_peer.setdefault(p.receiver, []).append(p)
        return by_peer

    def _forward(self, round_: int, route: Route, pieces: list[Piece], sums: dict[int, int], at: int) -> int:
        """Write this round from the window into the next rank's window; report it with the trainer's sums."""
        notices = route.next_notices
        self._await_release(notices, route.next_index, round_, f"{route.next}, chained behind this rank")
        there = notices.base(route.next_index, self.timeout_s)
        spans = [Span(at + p.window, there + p.window, p.nbytes) for p in pieces]
        before = self.mover.bytes_written.get(route.next, 0)
        self.mover.write(route.next, self.window, spans).wait(self.timeout_s)
        moved = self.mover.bytes_written.get(route.next, 0) - before
        notices.report(route.name, route.next_index, round_, RoundReport(sums, moved))
        return moved

    def _await_release(self, notices: Notices, index: int, round_: int, who: str) -> None:
        """Into a bounded window, wait until rank `index` released the last round in the slot `round_` lands in
        (`who` names it when it gave up instead)."""
        before = self.schedule.reuses(round_)
        if self.bounded and before >= 0 and not notices.released(index, before, self.timeout_s):
            raise SenderFailedError(f"{who}, gave up on version {notices.version}")

    def _give_up(self, notices: Notices, route: Route, failed_round: int, error: str, posted: list) -> None:
        """Tell whoever waits on this rank that it stopped: the head receivers it relays to and the rank
        behind it (filler for their posted receives of a two-sided mover, and the error for every round left),
        a bounded window's writers (`abort`); then
        take what the writers still send into this version's receives."""
        try:
            if route.feed is None:  # the head receivers waiting on our relays
                for round_ in range(max(failed_round, self._relayed_upto + 1), self.rounds):
                    for peer, pieces in self._by_peer(self._relays[round_]).items():
                        if self.mover.two_sided:
                            spans = [Span(p.window, p.window, p.nbytes) for p in pieces]
                            self.mover.abandon(receiver(peer), self.window, spans).wait(self.timeout_s)
                        notices.report(receiver(self.index), peer, round_, RoundReport(error=error))
            if route.next is not None:
                for round_ in range(failed_round, self.rounds):
                    spans = [Span(p.window, p.window, p.nbytes) for p in self._pieces[round_]]
                    if self.mover.two_sided:
                        self.mover.abandon(route.next, self.window, spans).wait(self.timeout_s)
                    route.next_notices.report(route.name, route.next_index, round_, RoundReport(error=error))
            if self.bounded:
                releases, me = (route.feed_notices, route.me) if route.feed is not None else (notices, self.index)
                for round_ in range(failed_round, self.rounds):
                    releases.release(me, round_, ABORT)
            for pending in posted:
                pending.wait(self.timeout_s)
        except PeerFailureError:
            pass  # a peer or the store is gone: everyone waiting fails on it by itself
