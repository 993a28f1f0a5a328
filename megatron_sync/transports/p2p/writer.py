"""A trainer rank's writes of one version: stage each piece in the arena, checksum it there, write it out.

As the walk hands over each converted tensor, its pieces are copied into this rank's registered arena
(the one copy on the sending side; on a GPU a device copy), checksummed where they lie, and every message
whose last piece is staged is posted at once, so conversion, staging and checksums overlap the wire. Once
all writes of one (receiver, round) landed, its report goes out (checksums and bytes), so the receiver can
verify and forward that round while later ones travel. Before reusing arena space, and before writing a
bounded window's slot again, the writer waits for its earlier writes (posting the reports they complete) and
then for the receiver's release of the round before in that slot: every wait is on something earlier in
schedule order, so none is circular.

A failure is reported to every receiver still expecting this rank's pieces, so they abort at once (one
that is gone is skipped), and the walk is run to its end without writing: its gathers are collectives of
this rank's TP or ETP group, whose other ranks must not be left waiting. A peer that is gone raises
PeerFailureError once that is done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from megatron_sync.core.checksum import checksum
from megatron_sync.core.errors import PeerFailureError
from megatron_sync.transports.p2p.movers import ByteMover, Pending, Span
from megatron_sync.transports.p2p.notices import Notices, RoundReport, receiver, trainer
from megatron_sync.transports.p2p.schedule import Message, Piece, Schedule

Group = tuple[int, int]  # (receiver, round)


@dataclass
class WriteStats:
    """What one rank wrote in one version: bytes per receiver, pieces, seconds spent checksumming."""

    bytes_per_peer: dict[int, int] = field(default_factory=dict)
    pieces: int = 0
    checksum_seconds: float = 0.0
    stage_seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        """Return the bytes written to every receiver together."""
        return sum(self.bytes_per_peer.values())


class ShareWriter:
    """Trainer rank `rank`'s part of every version of `schedule`, through `mover` from `arena`."""

    def __init__(self, schedule: Schedule, rank: int, mover: ByteMover, arena: torch.Tensor, *,
                 algorithm: str, timeout_s: float) -> None:
        self.schedule, self.rank, self.mover, self.arena = schedule, rank, mover, arena
        self.algorithm, self.timeout_s = algorithm, timeout_s
        self.bounded = bool(schedule.options.window_bytes)
        self.queue = schedule.sender_queue(rank)
        self.by_name: dict[str, list[Piece]] = {}
        for p in self.queue:
            self.by_name.setdefault(p.name, []).append(p)
        self.ending: dict[int, Message] = {m.pieces[-1]: m for m in schedule.sender_messages(rank)}
        self.group_size: dict[Group, int] = {}
        for m in schedule.sender_messages(rank):
            self.group_size[(m.receiver, m.round)] = self.group_size.get((m.receiver, m.round), 0) + 1

    @property
    def names(self) -> set[str]:
        """Return the HF tensors this rank sends pieces of."""
        return set(self.by_name)

    def write_version(self, tensors: Iterable[tuple[str, torch.Tensor]], notices: Notices,
                      set_offsets: Mapping[int, int]) -> WriteStats:
        """Stage, checksum and write every piece of this rank as `tensors` yields them; report each round."""
        run = _Run(self, notices, set_offsets)
        walk = iter(tensors)
        try:
            for name, full in walk:
                for piece in self.by_name.get(name, ()):
                    run.stage(piece, full)
            run.finish()
        except Exception as e:  # noqa: BLE001 — every receiver still waiting on this rank is told, then it is raised
            run.give_up(f"trainer rank {self.rank}: {type(e).__name__}: {e}")
            for _ in walk:  # the walk's gathers are collectives: this rank's group peers are in them too
                pass
            raise
        return run.stats

    def replay(self, set_offsets: Mapping[int, int]) -> int:
        """Write every message of this rank again from the arena as it stands, wait until all landed, and return
        the bytes: the wire alone (no walk, staging, checksums or reports), the baseline a benchmark divides a
        sync by. Receivers are not told; the bytes land in the staging set the next version overwrites. Only for
        one-sided movers and an arena that holds the whole share (one arena round)."""
        if self.mover.two_sided or self.bounded or any(p.arena_round for p in self.queue):
            raise ValueError("replay needs a one-sided mover (nixl, mooncake) and unbounded arena and window")
        run = _Run(self, None, set_offsets)  # type: ignore[arg-type] — replay posts no notices
        pending = [self.mover.write(receiver(m.receiver), self.arena, run._spans(m))
                   for m in self.schedule.sender_messages(self.rank)]
        for p in pending:
            p.wait(self.timeout_s)
        return sum(m.nbytes for m in self.schedule.sender_messages(self.rank))

    def fail_version(self, notices: Notices, error: str) -> None:
        """Tell every receiver of this rank that it sends nothing of this version (`error` says why)."""
        _Run(self, notices, {}).give_up(error)


class _Run:
    """The state of one version's writes on one rank."""

    def __init__(self, writer: ShareWriter, notices: Notices, set_offsets: Mapping[int, int]) -> None:
        self.w, self.notices, self.set_offsets = writer, notices, set_offsets
        self.stats = WriteStats()
        self.sums: dict[Group, dict[int, int]] = {}
        self.moved: dict[Group, int] = {}
        self.pending: list[tuple[Message, Pending]] = []
        self.completed: dict[Group, int] = {}
        self.reported: set[Group] = set()
        self.arena_round = 0
        self.window_round: dict[int, int] = {}  # receiver -> the round last released for our writes
        self.aborted: set[int] = set()  # receivers that gave up on this version
        self.posted: set[int] = set()  # messages written

    def stage(self, piece: Piece, full: torch.Tensor) -> None:
        """Copy `piece` into the arena, checksum it, and post its message if it is the last piece of one."""
        if piece.arena_round != self.arena_round:
            self.settle(wait=True)  # the arena space is reused: every write from it must have landed
            self.arena_round = piece.arena_round
        slot = self.w.arena[piece.arena:piece.arena + piece.nbytes]
        started = time.perf_counter()
        piece.copy_into(slot, full)
        staged = time.perf_counter()
        group = (piece.receiver, piece.round)
        self.sums.setdefault(group, {})[piece.index] = checksum(slot, self.w.algorithm)
        self.stats.stage_seconds += staged - started
        self.stats.checksum_seconds += time.perf_counter() - staged
        self.stats.pieces += 1
        message = self.w.ending.get(piece.index)
        if message is not None:
            self.post(message)
        self.settle(wait=False)

    def post(self, message: Message) -> None:
        """Write `message` (into a bounded window, after the receiver released the last round in its slot)."""
        to = message.receiver
        if to in self.aborted or not self._window_free(to, message.round):
            return
        self.pending.append((message, self.w.mover.write(receiver(to), self.w.arena, self._spans(message))))
        self.posted.add(message.index)

    def _spans(self, message: Message) -> list[Span]:
        base = 0 if self.w.bounded else self.set_offsets.get(message.receiver, 0)
        return [Span(p.arena, base + p.window, p.nbytes) for p in (self.w.schedule.pieces[i] for i in message.pieces)]

    def _window_free(self, to: int, round_: int) -> bool:
        before = self.w.schedule.reuses(round_)  # the last round in the slot `round_` lands in
        if not self.w.bounded or before < 0 or self.window_round.get(to, -1) >= before:
            return True
        self.settle(wait=True)  # our reports of the earlier rounds must be out before we wait on them
        if not self.notices.released(to, before, self.w.timeout_s):
            self.aborted.add(to)
            return False
        self.window_round[to] = before
        return True

    def settle(self, *, wait: bool) -> None:
        """Take the writes that landed (in posting order; all of them with `wait`), and post every report
        whose round's writes all landed."""
        while self.pending:
            message, pending = self.pending[0]
            if wait:
                pending.wait(self.w.timeout_s)
            elif not pending.done():
                break
            self.pending.pop(0)
            group = (message.receiver, message.round)
            self.completed[group] = self.completed.get(group, 0) + 1
            self.moved[group] = self.moved.get(group, 0) + message.nbytes
            if self.completed[group] == self.w.group_size[group]:
                self._report(group)

    def _report(self, group: Group) -> None:
        to, round_ = group
        self.notices.report(trainer(self.w.rank), to, round_, RoundReport(self.sums.get(group, {}), self.moved[group]))
        self.reported.add(group)
        self.stats.bytes_per_peer[to] = self.stats.bytes_per_peer.get(to, 0) + self.moved[group]

    def finish(self) -> None:
        """Wait for every write. A receiver that gave up (`aborted`) fails the version itself, in the agreement."""
        self.settle(wait=True)
        missing = set(self.w.group_size) - self.reported - {g for g in self.w.group_size if g[0] in self.aborted}
        if missing:
            raise AssertionError(f"trainer rank {self.w.rank} never reported {sorted(missing)}")

    def give_up(self, error: str) -> None:
        """Send filler for every message not written (a two-sided receiver posted its receives), then report
        `error` for every round of every receiver not reported yet."""
        gone: set[int] = set()
        for message in self.w.schedule.sender_messages(self.w.rank):
            if message.index not in self.posted and message.receiver not in gone | self.aborted:
                try:
                    self.pending.append((message, self.w.mover.abandon(receiver(message.receiver), self.w.arena,
                                                                       self._spans(message))))
                except PeerFailureError:
                    gone.add(message.receiver)  # that receiver is gone; the others still get filler
        for message, pending in self.pending:
            try:
                pending.wait(self.w.timeout_s)
            except PeerFailureError:
                pass  # that receiver is gone; the others still get the error below
        self.pending = []
        for group in sorted(set(self.w.group_size) - self.reported):
            to, round_ = group
            self.notices.report(trainer(self.w.rank), to, round_, RoundReport(error=error))
            self.reported.add(group)
