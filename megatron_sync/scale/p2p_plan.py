"""The device-direct P2P schedule at full size: who writes what, from the transport's own planners.

`transports.p2p.build.build_schedule` cuts every head placement into pieces and balances them with
`transports.p2p.balance.balance` over `transports.p2p.holders.Holders`. At full size that is millions
of pieces, so this module builds the same `Item`s without pieces, from the role-based region tables
(`scale.plans.RegionTable`): per HF tensor, its bytes to the head engines; a tensor whose bytes to the
heads exceed the piece size becomes one item per (head rank, run of rows) (`build.row_cuts`), in the
order `build_schedule` gives them (the unit order of `build.placements_by_name`); and calls `balance` itself.
Rows several ranks of the head engine hold (norms, routers, MLA's latent down-projections) come from the
trainer once, to the rank `build.RelayOwners` picks (in the same order), which relays them to the others.
`tests/test_scale_p2p.py` proves the loads and the relayed bytes equal `build_schedule`'s on mid-size models.

From the balance it derives what the time model needs: bytes and items per sender, the gathers each
sender's TP / ETP group runs (a dense unit is gathered by every replica group one of whose ranks sends
a piece of it, onto those ranks only), the bytes each sender converts, what crosses nodes, and the chain of engines that
forward (engines of one layout: the trainer writes the first, every later one receives from the one
before it, round by round).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from megatron_sync.core.grid import ParallelLayout
from megatron_sync.layout.rank import Placement
from megatron_sync.transports.p2p.balance import Balance, Item, balance
from megatron_sync.transports.p2p.build import RelayOwners, placements_by_name, row_cuts
from megatron_sync.transports.p2p.holders import Holders, SourceUnit, group_of, source_units
from megatron_sync.transports.p2p.schedule import ROUND_PIECES, relays_on, slot_bytes, window_slots
from megatron_sync.scale.summary import Endpoint, Traffic


@dataclass(frozen=True)
class P2POptions:
    """The schedule's sizes (weight_sync.bucket_size_mb, p2p_window_mb, p2p_arena_mb, p2p_forward), bytes."""

    piece_bytes: int
    window_bytes: int = 0
    arena_bytes: int = 0
    forward: bool = True

    @property
    def relays(self) -> bool:
        """Whether engine ranks relay the rows several of them hold (`build_schedule`'s rule)."""
        return relays_on(self.forward)

    @property
    def slots(self) -> int:
        """Rounds a bounded window holds at once (`schedule.window_slots`, pieces of at most `piece_bytes`)."""
        return window_slots(self.window_bytes, ROUND_PIECES * self.piece_bytes, self.piece_bytes)

    @property
    def round_bytes(self) -> int:
        """Bytes of one forwarding round: a slot of the bounded window, else four pieces (buckets) of the
        staging set, as the runtime cuts them (`transports/p2p/sender.py` `schedule_options`)."""
        if self.window_bytes:
            return slot_bytes(self.window_bytes, self.slots)
        return ROUND_PIECES * self.piece_bytes


@dataclass
class P2PTotals:
    """What the schedule moves, per trainer rank and per head inference rank."""

    balance: Balance
    items: int
    heads: int  # engines the trainer writes
    chain: int  # engines per forwarding chain (1: no forwarding)
    sent_items: dict[int, int] = field(default_factory=dict)
    largest: dict[int, int] = field(default_factory=dict)
    gather: dict[int, Traffic] = field(default_factory=dict)
    local_sent: dict[int, int] = field(default_factory=dict)  # bytes a sender writes to GPUs of its own node
    local_received: dict[int, int] = field(default_factory=dict)  # per head inference rank
    relay: dict[int, Traffic] = field(default_factory=dict)  # per head inference rank: bytes relayed in and out
    notices: dict[int, tuple[int, int]] = field(default_factory=dict)  # per engine's store (`count_notices`)


def trainer_units(planner: Any) -> list[SourceUnit]:
    """Return every stage's units as the P2P planners see them (`holders.source_units`), in walk order."""
    t = planner.trainer
    out: list[SourceUnit] = []
    for stage, units in enumerate(planner.units):
        layout = ParallelLayout.at(t, pp_rank=stage)
        out += source_units(units, planner.known_outputs, layout)
    return out


class _Dest:
    """Where an item's bytes land: `targets` (rank, bytes) of one head engine, in `head` or in every head, and
    per target the other ranks of that engine its rank relays the bytes to (`peers`)."""

    __slots__ = ("head", "targets", "peers")

    def __init__(self, head: int | None, targets: Sequence[tuple[int, int]], peers: Sequence[tuple[int, ...]]):
        self.head, self.targets, self.peers = head, targets, peers


class _Groups:
    """Per kind of tensor, the ranks of an engine holding the same region (one group per rank without relays),
    each group's region and its row-cut sizes, in `build_schedule`'s order (first member, then rows)."""

    def __init__(self, planner: Any, options: P2POptions):
        self.planner, self.options = planner, options
        self._cache: dict[tuple, list[tuple[list[int], list[int]]]] = {}

    def of(self, i: int) -> list[tuple[list[int], list[int]]]:
        kind = self.planner.regions.kind[i]
        if kind not in self._cache:
            spec = self.planner.specs[i]
            by_region: dict[Any, list[int]] = {}
            for rank, region in enumerate(self.planner.regions.of(i)):
                if region is not None and region.numel:
                    by_region.setdefault(region if self.options.relays else rank, []).append(rank)
            groups = []
            for members in by_region.values():
                region = self.planner.regions.of(i)[members[0]]
                placement = Placement(spec.name, region, spec.name, 0, region.numel * spec.dtype.itemsize)
                groups.append((members, [n for *_, n in row_cuts(spec, placement, self.options.piece_bytes)]))
            self._cache[kind] = groups
        return self._cache[kind]


def build_items(planner: Any, units: Sequence[SourceUnit], options: P2POptions,
                heads: int) -> tuple[list[Item], list[_Dest], dict[int, Traffic]]:
    """Return the items `build_schedule` balances for `heads` head engines, where each one lands, and the
    bytes each head rank relays in and out (module doc)."""
    where = placements_by_name(units)
    index = {s.name: i for i, s in enumerate(planner.specs)}
    groups, owners = _Groups(planner, options), RelayOwners()
    relay: dict[int, Traffic] = defaultdict(Traffic)
    items: list[Item] = []
    dests: list[_Dest] = []
    for name in sorted(where, key=lambda name: where[name][0]):
        i, unit = index[name], where[name][1]
        cuts, peers = [], []  # (owner, bytes) of one head engine, each run of rows once; whom the owner relays to
        for members, sizes in groups.of(i):
            for n in sizes:
                owner = owners.choose(members, n) if len(members) > 1 else members[0]
                cuts.append((owner, n))
                peers.append(tuple(m for m in members if m != owner))
                _count_relay(planner, relay, owner, members, n)
        # `build_schedule` orders a tensor's cuts by receiver, then rows (its `_Cut.key`)
        order = sorted(range(len(cuts)), key=lambda k: cuts[k][0])
        cuts, peers = [cuts[k] for k in order], [peers[k] for k in order]
        total = sum(n for _, n in cuts) * heads
        if total <= options.piece_bytes:
            if total:
                items.append(Item(total, unit))
                dests.append(_Dest(None, cuts, peers))
            continue
        for head in range(heads):
            for cut, relayed in zip(cuts, peers):
                items.append(Item(cut[1], unit))
                dests.append(_Dest(head, (cut,), (relayed,)))
    return items, dests, dict(relay)


def count_notices(dests: Sequence[_Dest], senders: Sequence[int], round_bytes: int, heads: int,
                  chain: int) -> dict[int, tuple[int, int]]:
    """Return per engine the reports one version posts on its notice store and the takes that read them, as
    `Schedule.notices` counts them: each head rank's cuts, in the schedule's order, fill rounds of
    `round_bytes` (an unbounded window's rule, `build._windows`; a bounded window's rounds are cut alike, slot
    by slot, without its alignment); one report per writer, receiver and round, the relays' in the round of
    the cut they copy, and one per round of every rank of the `chain - 1` engines forwarded to; one take per
    receiver and round for the trainer's reports, one for the relays', one per round of a forwarded-to rank.
    Head engines are 0..heads - 1; with forwarding (one head) engines 1..chain - 1 are forwarded to."""
    fill: dict[tuple[int, int], list[int]] = {}  # (head, rank) -> [round, bytes in it]
    last: dict[tuple[int, int], int] = defaultdict(int)  # (head, rank) -> its last round
    reports: set[tuple[int, int, int, int]] = set()  # (writer, head, rank, round); relays: writer -1 - owner
    for dest, sender in zip(dests, senders):
        for head in range(heads) if dest.head is None else (dest.head,):
            for (owner, n), peers in zip(dest.targets, dest.peers):
                at = fill.setdefault((head, owner), [0, 0])
                if round_bytes and at[1] and at[1] + n > round_bytes:
                    at[0], at[1] = at[0] + 1, 0
                at[1] += n
                reports.add((sender, head, owner, at[0]))
                last[(head, owner)] = max(last[(head, owner)], at[0])
                for peer in peers:
                    reports.add((-1 - owner, head, peer, at[0]))
                    last[(head, peer)] = max(last[(head, peer)], at[0])
    out = {head: [0, 0] for head in range(heads)}
    for _, head, _, _ in reports:
        out[head][0] += 1
    for _, head, _, _ in {(w >= 0, head, rank, round_) for w, head, rank, round_ in reports}:
        out[head][1] += 1
    fed = sum(r + 1 for r in last.values())  # every rank of an engine forwarded to: a report and a take a round
    out.update({engine: [fed, fed] for engine in range(1, chain)})
    return {engine: (r, t) for engine, (r, t) in out.items() if r or t}


def _count_relay(planner: Any, relay: dict[int, Traffic], owner: int, members: Sequence[int], nbytes: int) -> None:
    """Count `nbytes` relayed from `owner` to every other member, by whether the hop crosses nodes."""
    if len(members) < 2:
        return
    fleet, trainer = planner.fleet, planner.trainer
    home = fleet.node_of(owner, trainer)
    for m in members:
        if m == owner:
            continue
        if fleet.node_of(m, trainer) == home:
            relay[owner].out_intra += nbytes
            relay[m].in_intra += nbytes
        else:
            relay[owner].out_inter += nbytes
            relay[m].in_inter += nbytes


def plan_p2p(planner: Any, options: P2POptions) -> P2PTotals:
    """Return the balanced schedule's totals for `planner`'s layouts (see the module doc)."""
    fleet, trainer = planner.fleet, planner.trainer
    heads = 1 if options.forward else fleet.engines
    units = trainer_units(planner)
    items, dests, relay = build_items(planner, units, options, heads)
    shares = balance(items, Holders(trainer.ranks()), slack_bytes=options.piece_bytes)
    totals = P2PTotals(shares, len(items), heads, fleet.engines // heads, relay=relay)
    for item, sender in zip(items, shares.senders):
        totals.sent_items[sender] = totals.sent_items.get(sender, 0) + 1
        totals.largest[sender] = max(totals.largest.get(sender, 0), item.nbytes)
    totals.notices = count_notices(dests, shares.senders, options.round_bytes, heads, totals.chain)
    totals.gather = gather_traffic(planner, units, shares, items)
    if fleet.shares_nodes(trainer):
        totals.local_sent, totals.local_received = _local_bytes(planner, items, dests, shares.senders, heads)
    return totals


def gather_traffic(planner: Any, units: Sequence[SourceUnit], shares: Balance,
                   items: Sequence[Item]) -> dict[int, Traffic]:
    """Return per trainer rank its gather traffic and the bytes it converts (each unit it sends a piece of,
    once). A split unit's shards go, in each TP / ETP group with ranks that send pieces of it, from every
    member to those ranks only (`transports.p2p.walk`): a sender takes in the other members' shards, each
    member sends its shard to every other sender of its group."""
    t = planner.trainer
    gathered = {u.name: u for stage in planner.units for u in stage}
    ranks = {r.rank: r for r in t.ranks()}
    senders: dict[tuple[str, tuple], set[int]] = defaultdict(set)  # (unit, group key) -> its senders there
    for item, sender in zip(items, shares.senders):
        if item.unit.gather is not None:
            senders[(item.unit.name, group_of(item.unit, ranks[sender]))].add(sender)
    members: dict[tuple, list[int]] = defaultdict(list)  # (dense?, group key) -> the group's ranks
    for r in ranks.values():
        members[(True, (r.pp, r.cp, r.dp))].append(r.rank)
        members[(False, (r.pp, r.ep, r.edp))].append(r.rank)
    dense_of = {u.name: u.owner_ep is None for u in units}
    moved: dict[tuple[int, bool], list[int]] = defaultdict(lambda: [0, 0])  # (rank, dense?) -> [in, out]
    for (name, key), writing in senders.items():
        dense = dense_of[name]
        size = t.tp if dense else t.etp
        shard = gathered[name].nbytes // size
        for rank in members[(dense, key)]:
            moved[(rank, dense)][0] += shard * (size - 1) if rank in writing else 0
            moved[(rank, dense)][1] += shard * (len(writing) - (rank in writing))
    inter = {True: t.tp > t.gpus_per_node or t.gpus_per_node % t.tp,
             False: t.etp > t.gpus_per_node or t.gpus_per_node % t.etp}
    traffic: dict[int, Traffic] = {}
    for rank in ranks:
        cell = Traffic()
        for dense in (True, False):
            into, out = moved.get((rank, dense), (0, 0))
            if inter[dense]:
                cell.in_inter, cell.out_inter = cell.in_inter + into, cell.out_inter + out
            else:
                cell.in_intra, cell.out_intra = cell.in_intra + into, cell.out_intra + out
        traffic[rank] = cell
    converted: set[tuple[int, str]] = set()
    for item, sender in zip(items, shares.senders):
        if (sender, item.unit.name) not in converted:
            converted.add((sender, item.unit.name))
            unit = gathered[item.unit.name]
            traffic[sender].converted += unit.nbytes + item.unit.nbytes
            traffic[sender].units += 1
    return traffic


def _local_bytes(planner: Any, items: Sequence[Item], dests: Sequence[_Dest], senders: Sequence[int],
                 heads: int) -> tuple[dict[int, int], dict[int, int]]:
    """Return the bytes each sender writes to, and each head rank receives from, a GPU of its own node."""
    trainer, fleet = planner.trainer, planner.fleet
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    for item, dest, sender in zip(items, dests, senders):
        node = trainer.node_of(sender)
        in_heads = range(heads) if dest.head is None else (dest.head,)
        targets = [(h * fleet.engine_ranks + rank, nbytes) for h in in_heads for rank, nbytes in dest.targets]
        for receiver, nbytes in targets:
            if fleet.node_of(receiver, trainer) == node:
                sent[sender] += nbytes
                received[receiver] += nbytes
    return dict(sent), dict(received)


def endpoints(planner: Any, totals: P2PTotals, options: P2POptions) -> tuple[list[Endpoint], list[Endpoint]]:
    """Return the summary's senders (every trainer rank that writes) and receivers (every inference rank:
    the bytes it receives from the trainer or from the engine before it in its chain)."""
    trainer, fleet = planner.trainer, planner.fleet
    senders = [Endpoint(rank, trainer.node_of(rank), nbytes, totals.sent_items.get(rank, 0),
                        totals.sent_items.get(rank, 0), totals.largest.get(rank, 0), 0)
               for rank, nbytes in sorted(totals.balance.load.items()) if nbytes]
    shard, tensors = planner.shard_bytes()
    receivers = []
    for r in range(fleet.ranks):
        rounds = max(1, math.ceil(shard[r] / options.round_bytes))
        receivers.append(Endpoint(r, fleet.node_of(r, trainer), shard[r], tensors[r], rounds, 0, 0))
    return senders, receivers
