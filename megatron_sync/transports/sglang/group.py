"""SGLang's weight-update group, from the trainer's side: rank 0 of it, and the engines' joins over HTTP.

SGLang's ranks join through `init_custom_process_group`: torch's tcp://
rendezvous at master_address:master_port, the store wrapped in
`PrefixStore(group_name)`, and torch's own process-group helper. The trainer
hosts that store (a `TCPStore` it owns, so the trainer's later pipeline stages
can meet on it too, `stages.py`) and builds rank 0 over the same prefix.

Each server has its own group (`UpdateGroup`). A group whose broadcast was
left pending (the server refused the bucket, or died) cannot be used again:
the next broadcast would be matched with the stale one. `UpdateGroup.rebuild`
shuts the trainer's end down, has the server leave the old group and join a
new one under the next generation's name (fresh store keys), and builds rank
0 again.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Optional

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


class UpdateGroup:
    """Rank 0 of one SGLang server's update group (the trainer and the server's TP ranks 1..tp), rebuilt under
    a new name after a break.

    One group per server: a server that refuses a bucket or dies breaks only its own group. In one group
    for all servers, gloo's broadcast aborts on the first dead peer, before it sent to the others, whose
    ranks then wait inside SGLang for bytes that never come (until SGLang's own group timeout). The cost:
    rank 0 sends every bucket once per server.
    """

    def __init__(self, store: Any, url: str, tp_size: int, index: int, *, master_address: str, master_port: int,
                 backend: str, timeout_s: float, http_timeout_s: float) -> None:
        """Named after `master_port` and the server's `index`, so a trainer process that connects again on
        another port never meets torch's registry entry of a group it could not destroy."""
        self.store, self.url, self.tp_size, self.index = store, url, tp_size, index
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.timeout_s, self.http_timeout_s = backend, timeout_s, http_timeout_s
        self.generation = 0
        self.group: Optional[TransportGroup] = None
        self.broken = False

    @property
    def name(self) -> str:
        """The group's name on both sides (the prefix of its store keys), one per port, server and generation."""
        return f"{requests.GROUP_NAME}.{self.master_port}.{self.index}.{self.generation}"

    def form(self) -> None:
        """Have the server's ranks join (POST /init_weights_update_group on a thread) while rank 0 joins here."""
        body = requests.init_weights_update_group(
            master_address=self.master_address, master_port=self.master_port, rank_offset=1,
            world_size=1 + self.tp_size, group_name=self.name, backend=self.backend)
        join = BackgroundCall(lambda: call_sglang(self.url, "/init_weights_update_group", body=body,
                                                  timeout_s=self.timeout_s + JOIN_GRACE_S),
                              f"SGLang at {self.url} joining update group {self.name!r}")
        try:
            self.group = group_over(self.store, self.name, 1 + self.tp_size, 0, backend=self.backend,
                                    timeout_s=self.timeout_s)
        finally:
            join.wait(self.timeout_s + JOIN_GRACE_S)
        self.broken = False

    def break_off(self) -> None:
        """Never use this generation again (gloo cannot cancel a pending broadcast); `rebuild` forms the next."""
        self.broken = True
        if self.group is not None:
            self.group.close_backend()

    def rebuild(self) -> None:
        """Have the server leave this generation and form the next one with it."""
        self.break_off()
        self._leave()
        self.generation += 1
        self.group = None
        self.form()

    def _leave(self) -> None:
        try:
            call_sglang(self.url, "/destroy_weights_update_group",
                        body=requests.destroy_weights_update_group(group_name=self.name),
                        timeout_s=self.http_timeout_s)
        except EngineHTTPError as e:  # it may never have joined this generation; the next name is fresh anyway
            log.warning("SGLang at %s did not leave update group %r: %s", self.url, self.name, e)

    def close(self, *, reachable: bool = True) -> None:
        """Have the server leave (when `reachable`), then destroy rank 0 (a broken group is only shut down)."""
        if reachable:
            self._leave()
        if self.group is not None:
            if self.broken:
                self.group.close()
            else:
                release(self.group)
            self.group = None
