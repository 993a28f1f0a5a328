"""Building the P2P schedule from metadata (see `schedule` for what it holds and why)."""

from __future__ import annotations

import math
from typing import Sequence

from megatron_sync.core.bulk import without_gc
from megatron_sync.core.grid import TrainerRank
from megatron_sync.layout.rank import Placement
from megatron_sync.layout.regions import TensorSpec
from megatron_sync.transports.p2p.balance import Item, balance
from megatron_sync.transports.p2p.holders import Holders, SourceUnit
from megatron_sync.transports.p2p.schedule import (TRAINER, InferenceRank, Message, Piece, Schedule,
                                                   ScheduleOptions, aligned, slot_bytes, window_slots)


@without_gc
def build_schedule(units: Sequence[SourceUnit], ranks: Sequence[TrainerRank], tensors: Sequence[TensorSpec],
                   receivers: Sequence[InferenceRank], options: ScheduleOptions) -> Schedule:
    """Return the schedule writing every receiver's placements (see `schedule`); ValueError names a tensor
    a receiver needs that no trainer rank produces, or options whose `staging_sets` is still "auto"."""
    if options.staging_sets not in (1, 2):
        raise ValueError(f"staging_sets={options.staging_sets!r} in the schedule's options: resolve it with "
                         "ScheduleOptions.resolved(copies=...) first (the handshake does, from the engines' layouts)")
    feeds = feeds_of(receivers, options.forward)
    every = _cuts(units, tensors, receivers, [i for i, f in enumerate(feeds) if f == TRAINER], options.piece_bytes)
    cuts, relayed = _relayed(every, options.relays)
    items, item_of = _items(cuts, options.piece_bytes)
    shares = balance(items, Holders(ranks), slack_bytes=options.piece_bytes)
    senders = [shares.senders[item_of[i]] for i in range(len(cuts))]
    largest = max((c.nbytes for c in cuts), default=0)
    slots = window_slots(options.window_bytes, options.round_bytes, largest)
    windows, relay_windows = _windows(cuts, relayed, options, slots)
    arenas = _arenas(cuts, senders, options.arena_bytes)
    pieces = tuple(Piece(i, senders[i], c.receiver, c.name, c.region, c.row, c.rows, c.dst, c.nbytes,
                         windows[i][0], windows[i][1], arenas[i][0], arenas[i][1]) for i, c in enumerate(cuts))
    relays = tuple(Piece(len(pieces) + k, pieces[o].sender, c.receiver, c.name, c.region, c.row, c.rows, c.dst,
                         c.nbytes, *relay_windows[k], 0, 0, via=pieces[o].receiver, origin=o)
                   for k, (c, o) in enumerate(relayed))
    rounds = [0] * len(receivers)
    for p in pieces + relays:
        rounds[p.receiver] = max(rounds[p.receiver], p.round + 1)
    for i, feed in enumerate(feeds):
        if feed != TRAINER:
            rounds[i] = rounds[_head(feeds, i)]
    return Schedule(options, tuple(tensors), tuple(units), tuple(sorted(ranks, key=lambda r: r.rank)),
                    tuple(receivers), feeds, pieces, _messages(pieces, options.piece_bytes), tuple(rounds), shares,
                    relays, slots)


class _Cut:
    """A piece before it has a sender, a round and an arena slot."""

    __slots__ = ("key", "receiver", "name", "region", "row", "rows", "dst", "nbytes", "unit")

    def __init__(self, key, receiver, name, region, row, rows, dst, nbytes, unit):
        self.key, self.receiver, self.name, self.region = key, receiver, name, region
        self.row, self.rows, self.dst, self.nbytes, self.unit = row, rows, dst, nbytes, unit


def _head(feeds: Sequence[int], receiver: int) -> int:
    while feeds[receiver] != TRAINER:
        receiver = feeds[receiver]
    return receiver


def _cuts(units: Sequence[SourceUnit], tensors: Sequence[TensorSpec], receivers: Sequence[InferenceRank],
          heads: Sequence[int], piece_bytes: int) -> list[_Cut]:
    """Return every head placement cut into pieces, in schedule order."""
    specs = {t.name: t for t in tensors}
    where = placements_by_name(units)
    cuts = []
    for index in heads:
        receiver = receivers[index]
        offsets = receiver.layout.param_offsets
        for part, p in enumerate(receiver.layout.placements):
            if p.name not in specs or p.name not in where:
                raise ValueError(
                    f"inference rank {receiver.rank} of engine {receiver.engine} needs {p.name}, but "
                    f"{'no trainer rank converts it' if p.name in specs else 'the trainer does not produce it'}; "
                    "the trainer's HF tensors and the engine's layout must cover the same names")
            key, unit = where[p.name]
            for row, rows, start, nbytes in row_cuts(specs[p.name], p, piece_bytes):
                cuts.append(_Cut((*key, index, part, row), index, p.name, p.source, row, rows,
                                 offsets[p.param] + p.offset + start, nbytes, unit))
    cuts.sort(key=lambda c: c.key)
    return cuts


class RelayOwners:
    """Which head receiver gets a run of rows several of them hold from the trainer, and relays it to the others:
    the one that has relayed the fewest bytes so far (then the lowest index), so relays spread evenly."""

    def __init__(self) -> None:
        self.load: dict[int, int] = {}

    def choose(self, members: Sequence[int], nbytes: int) -> int:
        """Return the owner among `members` (receiver indices) of `nbytes` bytes they all hold."""
        chosen = min(members, key=lambda m: (self.load.get(m, 0), m))
        self.load[chosen] = self.load.get(chosen, 0) + nbytes * (len(members) - 1)
        return chosen


def _relayed(cuts: list[_Cut], enabled: bool) -> tuple[list[_Cut], list[tuple[_Cut, int]]]:
    """Return the cuts the trainer writes, and every cut a head receiver relays with the index (among the
    first) of the cut it copies: of the head cuts with the same rows of a tensor, one (its owner's,
    `RelayOwners`) comes from the trainer."""
    if not enabled:
        return cuts, []
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(cuts):
        members = groups.setdefault((c.name, c.region, c.row, c.rows), [])
        if all(cuts[j].receiver != c.receiver for j in members):
            members.append(i)
    owners, owner_of = RelayOwners(), {}
    for members in groups.values():
        if len(members) > 1:
            chosen = owners.choose([cuts[i].receiver for i in members], cuts[members[0]].nbytes)
            own = next(i for i in members if cuts[i].receiver == chosen)
            owner_of.update({i: own for i in members if i != own})
    direct = [i for i in range(len(cuts)) if i not in owner_of]
    position = {i: k for k, i in enumerate(direct)}
    return [cuts[i] for i in direct], [(cuts[i], position[owner_of[i]]) for i in sorted(owner_of)]


def _items(cuts: Sequence[_Cut], piece_bytes: int) -> tuple[list[Item], list[int]]:
    """Return the items to balance (a small tensor's pieces together, a large one's one by one) and each
    cut's item."""
    total: dict[str, int] = {}
    for c in cuts:
        total[c.name] = total.get(c.name, 0) + c.nbytes
    items: list[Item] = []
    whole: dict[str, int] = {}
    item_of = []
    for c in cuts:
        if total[c.name] <= piece_bytes:
            if c.name not in whole:
                whole[c.name] = len(items)
                items.append(Item(total[c.name], c.unit))
            item_of.append(whole[c.name])
        else:
            item_of.append(len(items))
            items.append(Item(c.nbytes, c.unit))
    return items, item_of


def _windows(cuts: Sequence[_Cut], relayed: Sequence[tuple[_Cut, int]], options: ScheduleOptions,
             slots: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Return each cut's and each relayed cut's (round, offset in its receiver's window): bounded windows are
    packed per round into slot round mod `slots`, an unbounded one is the staging set (offset = dst) cut into
    rounds of `round_bytes`; a relayed cut lands in its origin's round."""
    slot = slot_bytes(options.window_bytes, slots)
    if options.window_bytes and relayed:
        return _shared_windows(cuts, relayed, slot, slots)
    state: dict[int, list[int]] = {}  # receiver -> [round, bytes used in it]
    out = []
    for c in cuts:
        round_, used = state.setdefault(c.receiver, [0, 0])
        if options.window_bytes:
            start = aligned(used)
            if used and start + c.nbytes > slot:
                round_, start = round_ + 1, 0
            state[c.receiver] = [round_, start + c.nbytes]
            out.append((round_, round_ % slots * slot + start))
            continue
        if options.round_bytes and used and used + c.nbytes > options.round_bytes:
            round_, used = round_ + 1, 0
        state[c.receiver] = [round_, used + c.nbytes]
        out.append((round_, c.dst))
    return out, [(out[o][0], c.dst) for c, o in relayed]


def _shared_windows(cuts: Sequence[_Cut], relayed: Sequence[tuple[_Cut, int]], slot: int,
                    slots: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Bounded windows with relays: every head receiver's rounds end at the same cuts, and a trainer cut lands
    together with the cuts relayed from it (a new round for all when one of them does not fit its window).

    Why: a relay into round r of a peer waits for the peer's release of an earlier round, which waits for
    every relay into that round, hence for whole rounds of other receivers. With rounds cut per receiver,
    those could end after a younger trainer write the peer's round r waits for (a cycle). With shared ends,
    an earlier round everywhere holds only cuts older than any of round r, and each sender writes in round
    order.
    """
    riders: dict[int, list[int]] = {}
    for k, (_, origin) in enumerate(relayed):
        riders.setdefault(origin, []).append(k)
    used: dict[int, int] = {}  # head receiver -> bytes used in the current round
    round_ = 0
    out: list[tuple[int, int]] = []
    relay_out: list[tuple[int, int]] = [(0, 0)] * len(relayed)
    for i, c in enumerate(cuts):
        members = [(c, None)] + [(relayed[k][0], k) for k in riders.get(i, ())]
        if any(used.get(m.receiver, 0) and aligned(used[m.receiver]) + m.nbytes > slot for m, _ in members):
            round_, used = round_ + 1, {}
        for m, k in members:
            start = aligned(used.get(m.receiver, 0))
            used[m.receiver] = start + m.nbytes
            if k is None:
                out.append((round_, round_ % slots * slot + start))
            else:
                relay_out[k] = (round_, round_ % slots * slot + start)
    return out, relay_out


def _arenas(cuts: Sequence[_Cut], senders: Sequence[int], arena_bytes: int) -> list[tuple[int, int]]:
    """Return each cut's (offset, arena round) in its sender's arena, in schedule order."""
    state: dict[int, list[int]] = {}  # sender -> [arena round, bytes used]
    out = []
    for c, sender in zip(cuts, senders):
        round_, used = state.setdefault(sender, [0, 0])
        start = aligned(used)
        if arena_bytes and used and start + c.nbytes > arena_bytes:
            round_, start = round_ + 1, 0
        state[sender] = [round_, start + c.nbytes]
        out.append((start, round_))
    return out


def _messages(pieces: Sequence[Piece], piece_bytes: int) -> tuple[Message, ...]:
    """Return the batches each sender posts, ordered by sender and by when their last piece is staged."""
    batches: list[list] = []  # [sender, position of its last piece in the sender's queue, bytes, pieces]
    open_: dict[tuple[int, int, int, int], list] = {}
    position: dict[int, int] = {}
    for p in pieces:  # schedule order: each sender's queue order
        at = position[p.sender] = position.get(p.sender, -1) + 1
        key = (p.sender, p.receiver, p.round, p.arena_round)
        batch = open_.get(key)
        if batch is not None and batch[2] + p.nbytes > piece_bytes:
            batches.append(batch)
            batch = None
        if batch is None:
            batch = open_[key] = [p.sender, at, 0, []]
        batch[1], batch[2] = at, batch[2] + p.nbytes
        batch[3].append(p)
    batches.extend(open_.values())
    batches.sort(key=lambda b: (b[0], b[1]))
    return tuple(Message(i, b[3][0].sender, b[3][0].receiver, b[3][0].round, tuple(p.index for p in b[3]), b[2])
                 for i, b in enumerate(batches))


def feeds_of(receivers: Sequence[InferenceRank], forward: bool) -> tuple[int, ...]:
    """Return each receiver's feed: TRAINER for the ranks of the first engine of each layout, else the same
    rank of the engine before it with that layout."""
    by_engine: dict[int, list[int]] = {}
    for i, r in enumerate(receivers):
        by_engine.setdefault(r.engine, []).append(i)
    last_of_layout: dict[tuple[str, ...], list[int]] = {}
    feeds = [TRAINER] * len(receivers)
    for engine in sorted(by_engine):
        members = by_engine[engine]
        key = tuple(receivers[i].layout.digest() for i in members)
        if forward and key in last_of_layout:
            feeds[members[0]:members[-1] + 1] = last_of_layout[key]
        last_of_layout[key] = members
    return tuple(feeds)


def row_cuts(spec: TensorSpec, placement: Placement, piece_bytes: int) -> list[tuple[int, int, int, int]]:
    """Return (first row, rows, byte offset in the placement, bytes) pieces of `placement`, each at most
    `piece_bytes` unless one row is larger."""
    shape = placement.source.sizes
    if not shape or shape[0] == 0:
        return [(0, 1 if not shape else 0, 0, placement.nbytes)] if placement.nbytes else []
    row_bytes = math.prod(shape[1:]) * spec.dtype.itemsize
    step = max(1, piece_bytes // row_bytes) if row_bytes else shape[0]
    return [(row, min(step, shape[0] - row), row * row_bytes, min(step, shape[0] - row) * row_bytes)
            for row in range(0, shape[0], step)]


def placements_by_name(units: Sequence[SourceUnit]) -> dict[str, tuple[tuple, SourceUnit]]:
    """Return HF name -> (order key of its unit in its stage's walk, the unit)."""
    stage_total: dict[int, int] = {}
    for u in units:
        stage_total[u.stage] = stage_total.get(u.stage, 0) + u.nbytes
    where, done = {}, {}
    for position, u in enumerate(units):
        before = done.get(u.stage, 0)
        done[u.stage] = before + u.nbytes
        fraction = before / stage_total[u.stage] if stage_total[u.stage] else 0.0
        for k, (name, _) in enumerate(u.hf):
            where[name] = ((fraction, u.stage, position, k), u)
    return where
