"""SGLang's weight-update group, from the trainer's side: rank 0 of it, and the engines' joins over HTTP.

SGLang's ranks join through `init_custom_process_group`: torch's tcp://
rendezvous at master_address:master_port, the store wrapped in
`PrefixStore(group_name)`, and torch's own process-group helper. The trainer
hosts that store (a `TCPStore` it owns, so the trainer's later pipeline stages
can meet on it too, `stages.py`) and builds rank 0 over the same prefix.

A group whose broadcast was left pending (an engine refused the bucket, or
died) cannot be used again: the next broadcast would be matched with the
stale one. `UpdateGroup.rebuild` shuts the trainer's end down, has every
engine still answering leave the old group and join a new one under the
next generation's name (fresh store keys), and builds rank 0 again.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from megatron_sync.engines.http import BackgroundCall, EngineHTTPError
from megatron_sync.engines.sglang import requests
from megatron_sync.engines.sglang.client import call_sglang
from megatron_sync.session.group import TransportGroup

log = logging.getLogger("megatron_sync")
JOIN_GRACE_S = 30.0
"""How much longer than the group's timeout an engine's join request may take to answer."""


def host_store(master_address: str, master_port: int, timeout_s: float) -> Any:
    """Return the TCPStore the trainer hosts for SGLang's update group (and its stage group)."""
    from torch.distributed import TCPStore

    return TCPStore(master_address, master_port, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s), multi_tenant=True)


def join_store(master_address: str, master_port: int, timeout_s: float) -> Any:
    """Return a client of the store the trainer's rank 0 hosts."""
    from torch.distributed import TCPStore

    return TCPStore(master_address, master_port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def group_over(store: Any, group_name: str, world_size: int, rank: int, *, backend: str,
               timeout_s: float) -> TransportGroup:
    """Return rank `rank` of a `world_size`-rank group over `PrefixStore(group_name, store)` (collective)."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                           c10d.PrefixStore(group_name, store), group_name=group_name,
                                           timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {r: r for r in range(world_size)}  # group ranks are global ranks here
    return TransportGroup(pg, store, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s,
                          group_name=group_name)


def release(group: TransportGroup) -> None:
    """Destroy a group that has no operation pending (it leaves torch's registry of group names) and close it."""
    import torch.distributed as dist

    if group._pg is not None:
        try:
            dist.destroy_process_group(group._pg)
        except (RuntimeError, ValueError, KeyError) as e:  # already gone: closing below is all that is left
            log.info("group %r was already destroyed: %s", group.group_name, e)
    group.close()


def init_update_group(master_address: str, master_port: int, world_size: int, *, group_name: str,
                      backend: str, timeout_s: float) -> tuple[TransportGroup, Any]:
    """Return (group, process group) of rank 0 of an SGLang update group, hosting its store.

    Collective with every engine's POST /init_weights_update_group, which must run concurrently.
    """
    group = group_over(host_store(master_address, master_port, timeout_s), group_name, world_size, 0,
                       backend=backend, timeout_s=timeout_s)
    return group, group._pg


@dataclass(frozen=True)
class Member:
    """One SGLang server in the update group: its URL and its first rank there (its TP rank 0)."""

    url: str
    rank_offset: int
    tp_size: int


def members_of(urls: Sequence[str], tp_sizes: Sequence[int]) -> list[Member]:
    """Return the servers' places in the group: rank 0 is the trainer, server i's ranks follow server i-1's."""
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(urls))]
    return [Member(url, offset, tp) for url, offset, tp in zip(urls, offsets, tp_sizes)]


class UpdateGroup:
    """Rank 0 of SGLang's update group and the servers in it; rebuilt under a new name after a break."""

    def __init__(self, store: Any, members: Sequence[Member], *, master_address: str, master_port: int,
                 backend: str, timeout_s: float, http_timeout_s: float) -> None:
        """The group is named after `master_port`, so a trainer process that connects again on another port
        never meets torch's registry entry of a group it could not destroy (one left with a stuck broadcast)."""
        self.store, self.members = store, list(members)
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.timeout_s, self.http_timeout_s = backend, timeout_s, http_timeout_s
        self.generation = 0
        self.group: Optional[TransportGroup] = None
        self.broken = False

    @property
    def name(self) -> str:
        """The group's name on both sides (the prefix of its store keys), one per port and generation."""
        return f"{requests.GROUP_NAME}.{self.master_port}.{self.generation}"

    def form(self) -> None:
        """Have every member join (POST /init_weights_update_group on threads) while rank 0 joins here."""
        world = 1 + sum(m.tp_size for m in self.members)
        joins = [BackgroundCall(self._joiner(m, world), f"SGLang at {m.url} joining update group {self.name!r}")
                 for m in self.members]
        try:
            self.group = group_over(self.store, self.name, world, 0, backend=self.backend, timeout_s=self.timeout_s)
        finally:
            for join in joins:
                join.wait(self.timeout_s + JOIN_GRACE_S)
        self.broken = False

    def _joiner(self, member: Member, world: int) -> Callable[[], Any]:
        body = requests.init_weights_update_group(
            master_address=self.master_address, master_port=self.master_port, rank_offset=member.rank_offset,
            world_size=world, group_name=self.name, backend=self.backend)
        return lambda: call_sglang(member.url, "/init_weights_update_group", body=body,
                                   timeout_s=self.timeout_s + JOIN_GRACE_S)

    def break_off(self) -> None:
        """End the trainer's end now (a pending broadcast fails at once); the group must be rebuilt."""
        self.broken = True
        if self.group is not None:
            self.group.close_backend()

    def rebuild(self, alive: Sequence[str]) -> None:
        """Form the next generation of the group with the members whose URL is in `alive` (in order)."""
        self.break_off()
        for member in self.members:
            if member.url in alive:
                self._leave(member.url)
        kept = [m for m in self.members if m.url in alive]
        self.members = members_of([m.url for m in kept], [m.tp_size for m in kept])
        self.generation += 1
        self.group = None
        if self.members:
            self.form()

    def _leave(self, url: str) -> None:
        try:
            call_sglang(url, "/destroy_weights_update_group",
                        body=requests.destroy_weights_update_group(group_name=self.name),
                        timeout_s=self.http_timeout_s)
        except EngineHTTPError as e:  # it may never have joined this generation; the new name is fresh anyway
            log.warning("SGLang at %s did not leave update group %r: %s", url, self.name, e)

    def close(self) -> None:
        """Have every member leave the group, then destroy rank 0 (a broken one is only shut down)."""
        for member in self.members:
            self._leave(member.url)
        if self.group is not None:
            if self.broken:
                self.group.close()
            else:
                release(self.group)
            self.group = None
