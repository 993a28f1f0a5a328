"""The P2P schedule: every byte an inference rank needs, written once, by one trainer rank or one engine.

Pure data, computed once from metadata and identical on every rank (compare `digest()`):

- Feeds. Engines whose rank layouts are identical form a chain in engine order: the trainer writes the
  first engine of a chain (its head); rank r of every later engine receives, round by round, what rank r
  of the engine before it received, written from that rank's receive window into its own at the same
  offsets. The trainer's egress per version is one copy per distinct layout, whatever the number of
  engines. With `forward` off every engine is a head.
- Pieces. Every head placement is cut into runs of whole rows of at most `piece_bytes`; a piece is
  contiguous at both ends (its sender copies those rows of its full tensor into its arena; they land at
  `dst` of the receiver's staging set).
- Relays. Head receivers that hold the same rows of a tensor (the ranks of an engine: norms, routers, MLA's
  latent down-projections, KV heads repeated when TP exceeds them; and heads of other layouts holding the
  same placement) get them from the trainer once: one of them (its *owner*, chosen to spread the relayed
  bytes over the receivers) gets the trainer's piece and, once it verified the round, writes it from its
  window into each other holder's (a relay piece: `via` is the owner, `origin` the trainer's piece, same
  checksum). With forwarding on (the `relays` option); so the trainer's egress is one model per layout,
  not one shard per rank, whatever the window.
- Senders (`balance`): a small tensor's pieces all go with one of its holders (one gather, one
  conversion), a large tensor's one by one, so the busiest sender carries about the mean.
- Order. Pieces are ordered by how far through its stage's walk their unit lies (`Piece.key`), so each
  sender produces its pieces in schedule order and the stages' pieces interleave at every receiver.
- Rounds. A head receiver cuts its pieces, in that order, into rounds that fit a slot of its receive
  window (`window_bytes` of registered memory the bytes land in before they are copied into the staging
  set) or, when the staging set itself is the window (`window_bytes` 0), into rounds of `round_bytes` that
  only pace forwarding (0: one round). A bounded window is cut into `slots` equal slots (`window_slots`:
  rounds of about `round_bytes`, and at least two when two of the largest pieces fit), round r landing in
  slot r mod slots, so round r + 1 arrives while round r is checked and copied out. A round is reported,
  verified and forwarded as a whole; into a bounded window, round r is written (by a sender, a forwarding
  rank or a relaying one) only once the receiver released round r - slots, the last one in that slot.
  Since every sender writes in key order and every round ends at a key, the oldest waiting write never
  waits on a younger one. With relays into bounded windows every head receiver's rounds end at the same
  keys, and relayed rows land in their origin's round (`build._shared_windows` says why).
- Arena. A sender stages its pieces in order at `arena` offsets of its registered arena, wrapping when
  `arena_bytes` are used (its arena rounds: space is reused once the writes from it completed).
- Messages. A sender's pieces to one receiver of one round and one arena round travel in batches of at
  most `piece_bytes`, each posted as soon as its last piece is staged.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_sync.core.grid import TrainerRank
from megatron_sync.layout.rank import RankLayout
from megatron_sync.layout.regions import Region, TensorSpec
from megatron_sync.layout.staging import resolve_staging_sets
from megatron_sync.transports.p2p.balance import Balance
from megatron_sync.transports.p2p.holders import SourceUnit

TRAINER = -1
"""The feed of a head receiver: its bytes come from the trainer."""
ROUND_PIECES = 4
"""Pieces per round the runtime asks for (`round_bytes`): the pace of forwarding, and a bounded window's slot."""
ALIGN = 64
"""Bytes; every piece starts at a multiple in a window and in an arena (any dtype view, 8-byte words)."""


@dataclass(frozen=True)
class InferenceRank:
    """Rank `rank` of engine `engine`, and the layout it published."""

    engine: int
    rank: int
    layout: RankLayout


def inference_ranks(layouts: Sequence[RankLayout], ranks_per_engine: int) -> tuple[InferenceRank, ...]:
    """Return every inference rank in order; engines are runs of `ranks_per_engine` consecutive ranks."""
    return tuple(InferenceRank(i // ranks_per_engine, i % ranks_per_engine, layout) for i, layout in enumerate(layouts))


@dataclass(frozen=True)
class ScheduleOptions:
    """The sizes a schedule is cut by (bytes; 0 where a bound is off)."""

    piece_bytes: int
    window_bytes: int = 0
    round_bytes: int = 0
    arena_bytes: int = 0
    forward: bool = True
    staging_sets: int | str = 2  # "auto": resolved at the handshake, by whether every engine copies (`resolved`)

    def __post_init__(self) -> None:
        if self.piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be > 0 (weight_sync.bucket_size_mb), got {self.piece_bytes}")
        for name in ("window_bytes", "arena_bytes"):
            bound = getattr(self, name)
            if bound and bound < self.piece_bytes:
                raise ValueError(f"{name}={bound} is smaller than one piece ({self.piece_bytes} bytes, the bucket "
                                 "size); raise the arena size or lower weight_sync.bucket_size_mb")

    @property
    def relays(self) -> bool:
        """Whether head receivers relay the rows several of them hold (module doc: forwarding on)."""
        return relays_on(self.forward)

    @property
    def posts_base(self) -> bool:
        """Whether writers wait for each receiver to post where its target set starts before writing into it: with
        one staging set written directly (no bounded window) the set holds the live version until the receiver's
        host copy of it, the rollback source, is done."""
        return self.staging_sets == 1 and not self.window_bytes

    def resolved(self, *, copies: bool) -> "ScheduleOptions":
        """Return these options with `staging_sets` resolved for engines that all copy (`copies`) or not."""
        return dataclasses.replace(self, staging_sets=resolve_staging_sets(self.staging_sets, copies=copies))

    def to_wire(self) -> list:
        return [self.piece_bytes, self.window_bytes, self.round_bytes, self.arena_bytes, self.forward,
                self.staging_sets]


def relays_on(forward: bool) -> bool:
    """Return whether a schedule with these options relays (the one place the rule is written): whenever
    engines forward, since a relay is a forward between the heads of one layout."""
    return forward


def window_slots(window_bytes: int, round_bytes: int, largest: int) -> int:
    """Return how many rounds a bounded window holds at once (1 when unbounded): as many rounds of
    `round_bytes` as fit, at least two when two slots hold the largest piece (`largest` bytes), and never
    slots smaller than it."""
    if not window_bytes:
        return 1
    slots = max(1, window_bytes // round_bytes) if round_bytes else 1
    slots = max(slots, 2)
    while slots > 1 and slot_bytes(window_bytes, slots) < largest:
        slots -= 1
    return slots


def slot_bytes(window_bytes: int, slots: int) -> int:
    """Return the bytes of one of `slots` slots of a window (the whole window for one slot)."""
    return window_bytes if slots == 1 else window_bytes // slots // ALIGN * ALIGN


@dataclass(frozen=True)
class Piece:
    """Rows [row, row + rows) of one region of HF tensor `name`, from trainer rank `sender` to head
    receiver `receiver`: at `dst` of its staging set, `window` of its receive window in round `round`, and
    `arena` of the sender's arena in the sender's arena round `arena_round`.

    A relay piece (`via` >= 0) is written instead by head receiver `via` (which holds the same rows), from where the
    trainer's piece `origin` (the same rows, from `sender`) landed in its window; it has no arena place."""

    index: int
    sender: int
    receiver: int
    name: str
    region: Region
    row: int
    rows: int
    dst: int
    nbytes: int
    round: int
    window: int
    arena: int
    arena_round: int
    via: int = -1
    origin: int = -1

    @property
    def relayed(self) -> bool:
        """Whether an inference rank (`via`) writes this piece, not the trainer."""
        return self.via >= 0

    def copy_into(self, slot: torch.Tensor, full: torch.Tensor) -> None:
        """Copy this piece's bytes of the full tensor into `slot` (flat uint8, `nbytes`) in one pass, strided
        regions (a row-parallel shard's columns) included."""
        part = self.region.rows(self.row, self.rows).of(full)
        if part.is_contiguous() or slot.data_ptr() % part.element_size():
            slot.copy_(part.contiguous().view(-1).view(torch.uint8))
        else:
            slot.view(part.dtype).view(part.shape).copy_(part)

    def to_wire(self) -> list:
        return [self.index, self.sender, self.receiver, self.name, self.region.to_wire(), self.row, self.rows,
                self.dst, self.nbytes, self.round, self.window, self.arena, self.arena_round, self.via, self.origin]


@dataclass(frozen=True)
class Message:
    """Pieces of one sender to one receiver (one round, one arena round) written in one batch."""

    index: int
    sender: int
    receiver: int
    round: int
    pieces: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Schedule:
    """Every piece and message of a sync, the feeds, and what they were computed from (see the module doc)."""

    options: ScheduleOptions
    tensors: tuple[TensorSpec, ...]
    units: tuple[SourceUnit, ...]
    ranks: tuple[TrainerRank, ...]
    receivers: tuple[InferenceRank, ...]
    feeds: tuple[int, ...]
    pieces: tuple[Piece, ...]
    messages: tuple[Message, ...]
    rounds: tuple[int, ...]
    balance: Balance
    relays: tuple[Piece, ...] = ()
    slots: int = 1  # rounds a bounded window holds at once (`window_slots`)

    def reuses(self, round: int) -> int:
        """Return the round whose release a write of `round` into a bounded window waits for, the last one in
        the same slot (negative: none, the slot is still fresh)."""
        return round - self.slots

    def head_of(self, receiver: int) -> int:
        """Return the head receiver whose pieces `receiver` gets (itself for a head)."""
        while self.feeds[receiver] != TRAINER:
            receiver = self.feeds[receiver]
        return receiver

    def successor(self, receiver: int) -> int | None:
        """Return the receiver `receiver` forwards to, or None."""
        return next((i for i, feed in enumerate(self.feeds) if feed == receiver), None)

    def round_pieces(self, receiver: int, round: int) -> list[Piece]:
        """Return the pieces landing in `receiver`'s window in `round` (a forwarded one: its head's), relay
        pieces included."""
        head = self.head_of(receiver)
        return [p for p in self._incoming[head] if p.round == round]

    def incoming(self, receiver: int) -> list[Piece]:
        """Return every piece `receiver` gets, in order (a forwarded one: its head's), relay pieces last."""
        return list(self._incoming[self.head_of(receiver)])

    def relays_from(self, owner: int, round: int) -> list[Piece]:
        """Return the relay pieces head receiver `owner` writes into other head receivers in `round`."""
        return [p for p in self._relays_by_owner.get(owner, ()) if p.round == round]

    def piece(self, index: int) -> Piece:
        """Return the piece (trainer or relay) numbered `index`."""
        return self.pieces[index] if index < len(self.pieces) else self.relays[index - len(self.pieces)]

    def sender_queue(self, sender: int) -> list[Piece]:
        """Return `sender`'s pieces in the order it stages them."""
        return list(self._queues.get(sender, ()))

    def unit_senders(self) -> dict[str, frozenset[int]]:
        """Return, per Megatron unit with pieces, the trainer ranks that write them (its gather's receivers)."""
        unit_of = {hf: u.name for u in self.units for hf, _ in u.hf}
        senders: dict[str, set[int]] = {}
        for p in self.pieces:
            senders.setdefault(unit_of[p.name], set()).add(p.sender)
        return {name: frozenset(ranks) for name, ranks in senders.items()}

    def sender_messages(self, sender: int) -> list[Message]:
        """Return `sender`'s messages in posting order."""
        return [m for m in self.messages if m.sender == sender]

    def senders_of(self, receiver: int, round: int) -> list[int]:
        """Return the trainer ranks writing into head `receiver` in `round` (ascending)."""
        return sorted({p.sender for p in self._incoming[receiver] if p.round == round and not p.relayed})

    def notices(self) -> dict[int, tuple[int, int]]:
        """Return, per engine, the reports one version posts on its notice store (`notices.Notices.report`: one
        per writer, receiver and round among the trainer's pieces and the relays, and one per round of every
        receiver the engine before it feeds) and the takes that read them (`Notices.take_reports`: one per
        receiver and round for the trainer's writes, one for the relays into it, one for its feed's)."""
        out: dict[int, list[int]] = {}

        def count(receiver: int, reports: int, takes: int) -> None:
            cell = out.setdefault(self.receivers[receiver].engine, [0, 0])
            cell[0], cell[1] = cell[0] + reports, cell[1] + takes

        for group in ({(p.sender, p.receiver, p.round) for p in self.pieces},
                      {(p.via, p.receiver, p.round) for p in self.relays}):
            for _, receiver, _ in group:
                count(receiver, 1, 0)
            for receiver, _ in {(receiver, round_) for _, receiver, round_ in group}:
                count(receiver, 0, 1)
        for i, feed in enumerate(self.feeds):
            if feed != TRAINER:
                count(i, self.rounds[i], self.rounds[i])
        return {engine: (r, t) for engine, (r, t) in out.items()}

    def arena_bytes(self, sender: int) -> int:
        """Return the size of `sender`'s arena (0 when it sends nothing)."""
        return max((aligned(p.arena + p.nbytes) for p in self._queues.get(sender, ())), default=0)

    def window_bytes(self, receiver: int) -> int:
        """Return the size of `receiver`'s receive window (its staging set's when the set is the window)."""
        if not self.options.window_bytes:
            return self.receivers[receiver].layout.nbytes
        return max((aligned(p.window + p.nbytes) for p in self.incoming(receiver)), default=0)

    def bytes_from_sender(self) -> dict[int, int]:
        """Return the bytes every trainer rank writes per version (0 when it writes none)."""
        return dict(self.balance.load)

    def trainer_egress(self) -> int:
        """Return the bytes leaving the trainer per version."""
        return sum(self.balance.load.values())

    def bytes_to_receiver(self) -> dict[int, int]:
        """Return the bytes every receiver gets per version (from the trainer or forwarded)."""
        return {i: sum(p.nbytes for p in self.incoming(i)) for i in range(len(self.receivers))}

    def relayed_bytes(self) -> dict[int, int]:
        """Return the bytes each head receiver relays into other head receivers per version."""
        out = {i: 0 for i in range(len(self.receivers))}
        for p in self.relays:
            out[p.via] += p.nbytes
        return out

    def forwarded_bytes(self) -> dict[int, int]:
        """Return the bytes each receiver forwards per version (0 for the last of a chain)."""
        return {i: 0 if self.successor(i) is None else sum(p.nbytes for p in self.incoming(i))
                for i in range(len(self.receivers))}

    def digest(self) -> str:
        """Return the sha256 of a canonical encoding (compare across ranks before any byte moves)."""
        canonical = [self.options.to_wire(), [t.to_wire() for t in self.tensors], [u.to_wire() for u in self.units],
                     [r.to_wire() for r in self.ranks],
                     [[r.engine, r.rank, r.layout.digest()] for r in self.receivers], list(self.feeds),
                     [p.to_wire() for p in self.pieces], [p.to_wire() for p in self.relays],
                     [[m.index, m.sender, m.receiver, m.round, list(m.pieces), m.nbytes] for m in self.messages]]
        return hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()

    @functools.cached_property
    def _incoming(self) -> dict[int, tuple[Piece, ...]]:
        return _grouped(self.pieces + self.relays, "receiver")

    @functools.cached_property
    def _relays_by_owner(self) -> dict[int, tuple[Piece, ...]]:
        return _grouped(self.relays, "via")

    @functools.cached_property
    def _queues(self) -> dict[int, tuple[Piece, ...]]:
        return _grouped(self.pieces, "sender")


def _grouped(pieces: Sequence[Piece], by: str) -> dict[int, tuple[Piece, ...]]:
    """Return `pieces` grouped by `by` ("sender", "receiver" or "via"), each group in order."""
    grouped: dict[int, list[Piece]] = {}
    for p in pieces:
        grouped.setdefault(getattr(p, by), []).append(p)
    return {k: tuple(v) for k, v in grouped.items()}


def aligned(n: int) -> int:
    """Return `n` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN
