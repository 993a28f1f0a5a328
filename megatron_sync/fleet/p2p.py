"""A fleet over P2P: each engine its own link, engines of one layout chained across links.

Membership is the fleet's (`FleetDriver`: links opened and dropped at sync boundaries, generations,
`min_engines`); what differs is how a version reaches the engines. Every link is a P2P transport of all
trainer ranks and one engine's ranks, with its own schedule (the engine is its only head). At each sync the
leader cuts the engines into waves (`wave_size`) and, within a wave, chains the engines of one layout
(`plan_chains`): the trainer writes only the first of each chain through its link; each later engine's rank r
receives what rank r of the engine before it received, round by round, written from that rank's window into
its own (a one-sided backend's writes across links, addressed through the session's root store). The
trainer's egress per version is one copy per layout and wave, however many engines.

Every engine still commits on its own link (both agreement rounds with every trainer rank), so one that
fails is dropped or left behind alone. An engine whose feed died or failed aborts the version and keeps the
previous one; it gets the version again in a later wave, from the trainer. A driven engine (vLLM) is always
fed by the trainer and forwards to no one: its workers follow their server's API, not the link's control.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Optional, Sequence

from megatron_sync.core.agreement import describe
from megatron_sync.core.errors import AgreedFailure, PeerFailureError, SyncError
from megatron_sync.core.metrics import SyncMetrics
from megatron_sync.fleet.links import Deliveries, Link, link_name
from megatron_sync.fleet.roster import EngineRecord
from megatron_sync.fleet.trainer import FleetDriver
from megatron_sync.fleet.waves import TRAINER, Delivery
from megatron_sync.session.control import ControlMessage, ControlOp
from megatron_sync.transports.base import Sender
from megatron_sync.transports.p2p.sender import P2PSender

log = logging.getLogger("megatron_sync")


def plan_chains(engines: Sequence[EngineRecord], *, wave_size: int = 0, chain: bool = True) -> list[list[Delivery]]:
    """Return the waves bringing a version to `engines`: each wave at most `wave_size` engines (0: all), in
    id order; within a wave the engines of one layout form a chain (the first from the trainer, each other
    from the one before it). An engine of unknown layout ("") is fed by the trainer and ends its chain."""
    if wave_size < 0:
        raise ValueError(f"wave_size={wave_size} must be >= 0 (0: every engine at once)")
    ordered = sorted(engines, key=lambda r: r.engine)
    size = wave_size or max(1, len(ordered))
    waves = []
    for start in range(0, len(ordered), size):
        last: dict[str, int] = {}
        wave = []
        for record in ordered[start:start + size]:
            source = last.get(record.layout, TRAINER) if chain and record.layout else TRAINER
            wave.append(Delivery(record.engine, source))
            if record.layout:
                last[record.layout] = record.engine
        waves.append(wave)
    return waves


def chain_layout_digest(sender: P2PSender) -> str:
    """Return the digest of a link's engine rank layouts (engines with equal digests can be chained)."""
    return hashlib.sha256("|".join(r.layout.digest() for r in sender.schedule.receivers).encode()).hexdigest()


class P2PFleetDriver(FleetDriver):
    """The trainer's side of a fleet whose transport is p2p (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fanout = None
        self.senders: dict[int, P2PSender] = {}  # engine -> the P2P sender of its link
        self.sender = FleetSends(self.senders)
        self.chainable = self.config.p2p_forward and self.config.p2p_backend != "torch"
        self._syncs = 0  # syncs so far: names the keys chained engines meet under

    def _open(self, engine: int, generation: int) -> Any:
        """Build the engine's link and its schedule (every trainer rank); return the Link, or the error."""
        transport = None
        try:
            part = self.session.part(link_name(engine, generation))
            transport = self.transport_cls.connect_trainer(self.link_config, self.layout, session=part)
            sender = P2PSender.connect(transport, self.stream, self.link_config)
            transport.all_gather_json({"stage": self.layout.pp_rank})  # the engines' hello
            driven = engine in self.clients or not self.chainable
            sender.keep_sent = self.sender.keep_sent
            self.senders[engine] = sender
            return Link(engine, generation, transport, "" if driven else chain_layout_digest(sender), not driven)
        except Exception as e:  # noqa: BLE001 — agreed on by every trainer rank, then the engine is left out
            if transport is not None:
                transport.close()
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def _drop(self, engine: int, reason: str) -> None:
        super()._drop(engine, reason)
        self.senders.pop(engine, None)

    def sync(self, version: int) -> SyncMetrics:
        """Bring `version` to every linked engine, wave by wave and chain by chain; an engine left behind gets
        it from the trainer in a later wave. Raises only when the trainer itself failed or too few remain."""
        self._boundary()
        started = time.perf_counter()
        waves = None
        if self.is_leader:
            records = [self.roster.engines[e] for e in sorted(self.links)]
            waves = [[d.to_wire() for d in wave] for wave in plan_chains(records, wave_size=self.config.wave_size)]
        queue = [[Delivery.from_wire(d) for d in wave] for wave in self._from_leader(waves)]
        rows, metrics, retried, index = Deliveries(version), None, set(), 1
        self.sender.heads = []
        while queue:
            wave = [d for d in queue.pop(0) if d.engine in self.links]
            if not wave:
                continue
            wave_metrics, outcomes = self._wave(version, wave)
            metrics = metrics or wave_metrics
            self._record(version, index, wave, outcomes, rows, started)
            again = [e for e, (state, _, _) in sorted(outcomes.items())
                     if state == "aborted" and e in self.links and e not in retried]  # the same on every rank
            retried.update(again)
            if again:  # each from the trainer this time (its feed may be what failed)
                queue.append([Delivery(e, TRAINER) for e in again])
            index += 1
        self._check_minimum()
        self.version = version
        metrics = metrics or SyncMetrics(version, role="sender", rank=self.layout.pp_rank)
        metrics.fleet = rows.rows + (self.roster.take_events() if self.is_leader else [])
        return metrics

    def _wave(self, version: int, wave: list[Delivery]) -> tuple[SyncMetrics | None, dict]:
        """One wave: announce every engine's route, then per engine in chain order this rank's part (write a
        head's pieces, or only agree); return the first head's metrics and the agreed outcomes."""
        self._syncs += 1
        self._announce_routes(version, wave)
        outcomes: dict[int, tuple[str, str, int]] = {}
        first, error = None, None
        for d in wave:
            sender = self.senders.get(d.engine)
            if sender is None:
                outcomes[d.engine] = ("failed", "no link", 0)
                continue
            try:
                if d.relayed:
                    sender.agree_only(version)
                    outcomes[d.engine] = ("committed", "", 0)
                else:
                    self.sender.heads.append(d.engine)
                    m = sender.sync(version)
                    first = first or m
                    outcomes[d.engine] = ("committed", "", m.bytes)
            except AgreedFailure as e:
                if all(rank < sender.transport.num_trainer_ranks for rank, _ in e.failures):
                    error = describe(e, limit=3)  # only trainer ranks failed: the trainer's own part
                outcomes[d.engine] = ("aborted", "; ".join(msg.splitlines()[0] for _, msg in e.failures), 0)
            except PeerFailureError as e:
                outcomes[d.engine] = ("failed", str(e).splitlines()[0], 0)
                self.links[d.engine].transport.stop_transfers()
            except SyncError as e:
                error = describe(e, limit=3)
        return first, self._agreed_outcomes(outcomes, agreed=True, error=error, version=version)

    def _announce_routes(self, version: int, wave: list[Delivery]) -> None:
        """Leader: tell each engine of the wave where its bytes come from and go to (and pause driven ones)."""
        if not self.is_leader:
            return
        after = {d.source: d.engine for d in wave if d.relayed}
        for d in wave:
            link = self.links[d.engine]
            route = {"sync": self._syncs}
            if d.relayed:
                route["feed"] = [d.source, self.links[d.source].generation]
            if d.engine in after:
                route["next"] = [after[d.engine], self.links[after[d.engine]].generation]
            try:
                client = self.clients.get(d.engine)
                if client is not None:
                    client.before_sync(version)
                    client.begin_transfer(version)
                link.transport.control.send(ControlMessage(ControlOp.SYNC, version, {"route": route}))
            except Exception as e:  # noqa: BLE001 — the engine's outcome says what became of it
                log.warning("fleet: engine %d did not take the announcement of version %d: %s", d.engine, version, e)


class FleetSends(Sender):
    """The trainer's sends to a P2P fleet as one `Sender` for checks and dumps: `keep_sent` reaches every
    link's sender, `sent_tensors` merges what the heads of the last sync were given."""

    def __init__(self, senders: dict[int, P2PSender]) -> None:
        self.senders, self.heads = senders, []
        self._keep = False

    @property
    def keep_sent(self) -> bool:  # type: ignore[override]
        return self._keep

    @keep_sent.setter
    def keep_sent(self, value: bool) -> None:
        self._keep = value
        for sender in self.senders.values():
            sender.keep_sent = value

    def sent_tensors(self) -> Optional[dict]:
        if not self._keep:
            return None
        merged: dict = {}
        for engine in self.heads:
            if engine in self.senders:
                merged.update(self.senders[engine].sent_tensors() or {})
        return merged

    def sync(self, version: int) -> SyncMetrics:
        raise TypeError("a fleet's sends are run by its driver (P2PFleetDriver.sync)")
