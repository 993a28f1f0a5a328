"""Which holder writes each item: a balanced, deterministic choice among the ranks that hold it.

An item is bytes that must leave the trainer from one rank: all of a small tensor's pieces (one holder
gathers and converts it), or one piece of a large one (a large replicated tensor such as an embedding or
`lm_head` is spread by rows over its holders). Items go largest first, those with the fewest holders first
(experts before dense tensors), each to its least-loaded holder; among holders within `slack_bytes` of that
load, one whose group already gathers the unit is preferred, so balancing does not make every replica
gather every tensor. With items small against a rank's share the busiest sender carries about the mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_sync.transports.p2p.holders import GroupKey, Holders, SourceUnit, group_of


@dataclass(frozen=True)
class Item:
    """Bytes of one unit's outputs that one trainer rank writes."""

    nbytes: int
    unit: SourceUnit


@dataclass(frozen=True)
class Balance:
    """The sender of every item, the bytes each trainer rank sends, and the groups gathering each unit."""

    senders: tuple[int, ...]  # parallel to the items
    load: dict[int, int]  # every trainer rank, 0 when it sends nothing
    gathering: dict[str, frozenset[GroupKey]]  # unit name -> the groups whose ranks send its outputs

    def busiest_over_mean(self) -> float:
        """Return the busiest sender's bytes over the mean of every trainer rank's (1.0 when nothing moves)."""
        mean = sum(self.load.values()) / max(1, len(self.load))
        return max(self.load.values(), default=0) / mean if mean else 1.0


def balance(items: Sequence[Item], holders: Holders, *, slack_bytes: int) -> Balance:
    """Return the sender of every item (see the module doc); deterministic for equal inputs."""
    load = {r.rank: 0 for r in holders.ranks}
    gathering: dict[str, set[GroupKey]] = {}
    senders: list[int] = [-1] * len(items)
    options = [holders.of(item.unit) for item in items]
    order = sorted(range(len(items)), key=lambda i: (len(options[i]), -items[i].nbytes, i))
    for i in order:
        unit, candidates = items[i].unit, options[i]
        least = min(load[r.rank] for r in candidates)
        groups = gathering.setdefault(unit.name, set())
        near = [r for r in candidates if load[r.rank] <= least + slack_bytes and group_of(unit, r) in groups]
        chosen = min(near or candidates, key=lambda r: (load[r.rank], r.rank))
        senders[i] = chosen.rank
        load[chosen.rank] += items[i].nbytes
        groups.add(group_of(unit, chosen))
    return Balance(tuple(senders), load, {name: frozenset(g) for name, g in gathering.items()})
