"""The trainer's side of a fleet: membership at sync boundaries, waves, relays, per-engine outcomes.

`TrainerWeightSync` hands a fleet (`weight_sync.fleet: true`) to a `FleetDriver`, built on every trainer rank
(its methods are collective over the trainer ranks, like the sync itself). The leader (the rendezvous host,
stage 0's source) decides; the other ranks follow what it shares through the trainer's own all-gather.

At every sync boundary (and once at start-up):
  0. every linked engine's ranks are asked whether they are there (`liveness.unanswered`): one that does not
     answer within `LIVE_WITHIN_S` (it died or was stopped between syncs) leaves the fleet before the sync;
  1. engines whose ranks were all admitted since the last boundary get a link (`links.Link`): the leader posts
     `fleet/open/<engine>/<generation>` so the engine connects, every stage source connects and agrees on the
     plan over it; a link every source opened joins the fleet, any other is closed and the engine left out;
     an engine superseded by a restarted job of the same id loses its old link first;
  2. the fleet must still hold `min_engines` (else every trainer rank raises FleetTooSmall).

A sync then walks the waves (`waves.plan_waves`): the first from the trainer while the stream is walked (the
host replica fills once, `WeightSender` fans each bucket out over the wave's links, `links.FanOut`); later
waves from the replica (`WeightSender.resend`) or relayed by engines that already committed (the leader tells
both engines over their links; the trainer takes part only in the destination's agreement rounds and the
source's one round). Every engine's commit is its own all-or-nothing agreement; an engine whose link fails
is dropped (one log line) and the others go on; an engine that aborted (a relay that broke off, a corrupt
bucket) gets the version once more from the trainer in a later wave. With `max_staleness: 1` the later waves
run in a background thread on the stage sources (no trainer collective there) while training goes on; the
next sync first waits for them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Optional, Sequence

import torch

from megatron_sync.core.agreement import Gather, describe
from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.core.errors import AgreedFailure, PeerFailureError, SyncAbortedError, SyncError
from megatron_sync.fleet.links import Deliveries, FanOut, Link
from megatron_sync.fleet.relay import relay_part
from megatron_sync.fleet.membership import Membership, link_config
from megatron_sync.fleet.roster import Roster
from megatron_sync.fleet.waves import TRAINER, Delivery, plan_waves
from megatron_sync.core.metrics import SyncMetrics
from megatron_sync.core.grid import ParallelLayout
from megatron_sync.plan.buckets import KeepTogether
from megatron_sync.transports.buckets.sender import WeightSender
from megatron_sync.trainer.stream import HFWeightStream
from megatron_sync.session.commit import sender_rounds
from megatron_sync.session.control import ControlMessage, ControlOp, Report
from megatron_sync.session.board import store_board

log = logging.getLogger("megatron_sync")

ACK_S = 15.0  # how long the leader waits for an engine's stop acknowledgement when closing


class FleetDriver(Membership):
    """A fleet's trainer side on one trainer rank (see the module doc): membership at the boundaries
    (`fleet/membership.py`), and here the waves of a sync."""

    def __init__(self, config: WeightSyncConfig, layout: ParallelLayout, *, session: Any, transport_cls: Any,
                 stream: HFWeightStream, keep_together: KeepTogether, gather: Gather,
                 clients: Optional[Sequence[Any]] = None) -> None:
        self.config, self.layout, self.session = config, layout, session
        self.transport_cls, self.stream, self.keep_together, self.gather = transport_cls, stream, keep_together, gather
        self.joins = transport_cls.trainer_joins(layout)
        self.is_leader = session is not None and session.is_host
        self.link_config = link_config(config)
        self.links: dict[int, Link] = {}
        self.held: dict[int, int] = {}  # engine -> version it committed (0: none of ours yet)
        self.roster = Roster()
        self.clients = dict(enumerate(clients or []))  # driven engines (leader): engine id = index in `engines`
        self.version = 0
        self.plan = None
        backend = config.resolved_backend(torch.cuda.is_available())
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.fanout = FanOut(layout.pp_rank, layout.pp, device) if self.joins else None
        self.sender: Optional[WeightSender] = None if self.joins else WeightSender(stream, None, None)
        self._background: Optional[threading.Thread] = None
        self._late: list[dict] = []  # rows of waves that finished in the background
        self._late_outcomes: dict[int, tuple[str, str, int]] = {}  # engine -> (state, reason, version)
        self._known: set[tuple[int, int]] = set()  # (engine, generation) linked or refused once: never again
        self._rejoining: dict[int, Any] = {}  # driven engine -> its join call under way (leader)
        self._board = store_board(session.store, prefix="", rank=0, timeout_s=config.timeout_s) \
            if self.is_leader else None

    def sync(self, version: int) -> SyncMetrics:
        """Bring `version` to the fleet in waves; return this rank's metrics of the first wave, with a row per
        engine (`metrics.fleet`) and the staleness. Raises only when the trainer itself failed (on every
        trainer rank) or fewer than min_engines remain."""
        self._boundary()
        started = time.perf_counter()
        waves = None
        if self.is_leader:
            records = [self.roster.engines[e] for e in sorted(self.links)]
            waves = [[d.to_wire() for d in wave] for wave in
                     plan_waves(records, wave_size=self.config.wave_size, relay=self.config.relay)]
        waves = [[Delivery.from_wire(d) for d in wave] for wave in self._from_leader(waves)]
        rows = Deliveries(version)
        first = waves[0] if waves else []
        metrics = self._first_wave(version, first, rows, started)
        later = waves[1:]
        if later and self.config.max_staleness == 0:
            self._later_waves(version, later, rows, started, agreed=True)
        elif later and self.joins:
            # rows of their own: the first wave's are this sync's, and theirs go into the next sync's metrics
            self._background = threading.Thread(target=self._later_waves,
                                                args=(version, later, Deliveries(version), started),
                                                kwargs={"agreed": False, "late": True},
                                                name="megatron-sync-fleet-waves", daemon=True)
            self._background.start()
        self._check_minimum()
        self.version = version
        behind = [version - held for held in list(self.held.values())]  # the background waves update `held`
        metrics.staleness = max(behind, default=0) if later and self.config.max_staleness else 0
        late, self._late = self._late, []
        metrics.fleet = late + rows.rows + (self.roster.take_events() if self.is_leader else [])
        return metrics

    def _first_wave(self, version: int, wave: list[Delivery], rows: Deliveries, started: float) -> SyncMetrics:
        """The wave the trainer feeds while it walks the stream (every trainer rank takes part)."""
        links = [self.links[d.engine] for d in wave]
        self._announce(version, wave)
        if self.fanout is not None:
            self.fanout.use(links)
        metrics, error = None, None
        try:
            metrics = self.sender.sync(version)
        except Exception as e:  # noqa: BLE001 — shared below, so every trainer rank raises it together
            error = describe(e, limit=3)
        except BaseException:  # a stop signal: every rank of the job got it
            self._close_driven(version, [d.engine for d in wave], ok=False)
            raise
        try:
                outcomes = self._agreed_outcomes(self.fanout.outcomes() if self.fanout is not None else [], agreed=True,
                                             error=error, version=version)
        except SyncError:
            self._close_driven(version, [d.engine for d in wave], ok=False)
            raise
        self._record(version, 1, wave, outcomes, rows, started)
        return metrics

    def _later_waves(self, version: int, waves: list[list[Delivery]], rows: Deliveries, started: float, *,
                     agreed: bool, late: bool = False) -> None:
        """Waves 2..: from the replica or relayed. `agreed`: every trainer rank runs this and the outcomes are
        shared through the trainer's all-gather; else only stage sources run it (a background thread)."""
        queue = collections.deque(waves)
        retried: set[int] = set()
        index = 2
        try:
            while queue:
                wave = [self._source_for(d, version) for d in queue.popleft() if d.engine in self.links]
                wave = [d for d in wave if self.held.get(d.engine, 0) < version]
                if not wave:
                    continue
                outcomes, error = {}, None
                try:
                    outcomes = self._run_wave(version, wave)
                except Exception as e:  # noqa: BLE001 — shared below (agreed) or logged (background)
                    if not agreed:
                        raise
                    error = describe(e, limit=3)
                outcomes = self._agreed_outcomes(outcomes, agreed=agreed, error=error, version=version)
                self._record(version, index, wave, outcomes, rows, started)
                again = [Delivery(e, TRAINER) for e, (state, _, _) in sorted(outcomes.items())
                         if state == "aborted" and e in self.links and e not in retried]
                retried.update(d.engine for d in again)
                if again:
                    queue.append(again)
                index += 1
        except Exception as e:  # noqa: BLE001 — a background wave never takes the trainer down
            if not late:
                raise
            log.error("fleet: the later waves of version %d failed: %s", version, e)
        if late:
            self._late.extend(rows.rows)

    def _source_for(self, delivery: Delivery, version: int) -> Delivery:
        """The delivery as it can run now: from the trainer when its relay source left or does not hold it."""
        if delivery.relayed and (delivery.source not in self.links or self.held.get(delivery.source) != version):
            return Delivery(delivery.engine, TRAINER)
        return delivery

    def _run_wave(self, version: int, wave: list[Delivery]) -> dict[int, tuple[str, str, int]]:
        """Stage sources: one later wave; return engine -> (state, reason, bytes sent) as this rank saw it."""
        self._announce(version, wave)
        if not self.joins:
            return {}
        fed = [self.links[d.engine] for d in wave if not d.relayed]
        relayed = [d for d in wave if d.relayed]
        outcomes: dict[int, tuple[str, str, int]] = {}
        relays = threading.Thread(target=self._relay_rounds, args=(version, relayed, outcomes),
                                  name="megatron-sync-relay-rounds", daemon=True)
        relays.start()  # the relays run between engines while the trainer feeds the rest of the wave
        if fed:
            self.fanout.use(fed)
            self.sender.resend(version)
            outcomes.update({o.engine: tuple(o.to_wire()) for o in self.fanout.outcomes()})
        relays.join()
        return outcomes

    def _relay_rounds(self, version: int, relayed: list[Delivery], outcomes: dict) -> None:
        """The trainer's part in each relay: the destination's two agreement rounds, the source's one."""
        for delivery in relayed:
            destination, source = self.links[delivery.engine], self.links[delivery.source]
            try:
                sender_rounds(destination.transport, version, None)
                outcomes[delivery.engine] = ("committed", "", 0)
            except AgreedFailure as e:
                outcomes[delivery.engine] = ("aborted", "; ".join(m.splitlines()[0] for _, m in e.failures), 0)
            except PeerFailureError as e:
                outcomes[delivery.engine] = ("failed", str(e).splitlines()[0], 0)
            try:
                source.transport.agree(None, what=f"relay of version {version} to engine {delivery.engine}")
            except AgreedFailure as e:
                log.info("fleet: engine %d could not relay version %d to engine %d: %s", delivery.source, version,
                         delivery.engine, e.failures[0][1].splitlines()[0])
            except PeerFailureError as e:
                outcomes[delivery.source] = ("failed", f"died while relaying to engine {delivery.engine}: "
                                                       f"{str(e).splitlines()[0]}", 0)

    def _announce(self, version: int, wave: list[Delivery]) -> None:
        """Leader: tell each engine of the wave what to do (and pause driven engines); a link whose control
        channel fails is found dead by the transfer itself."""
        if not self.is_leader:
            return
        for d in wave:
            link = self.links[d.engine]
            try:
                if d.relayed:
                    source = self.links[d.source]
                    part = relay_part(version, (source.engine, source.generation), (link.engine, link.generation))
                    source.transport.control.send(ControlMessage(ControlOp.RELAY_SEND, version,
                                                                 {"to": link.engine, "part": part}))
                    link.transport.control.send(ControlMessage(ControlOp.RELAY_RECEIVE, version,
                                                               {"from": source.engine, "part": part}))
                    continue
                client = self.clients.get(d.engine)
                if client is not None:
                    client.before_sync(version)
                    client.begin_transfer(version)
                link.transport.control.send(ControlMessage(ControlOp.SYNC, version))
            except Exception as e:  # noqa: BLE001 — the engine's outcome says what became of it
                log.warning("fleet: engine %d did not take the announcement of version %d: %s", d.engine, version, e)

    def _agreed_outcomes(self, outcomes: Any, *, agreed: bool, error: Optional[str] = None,
                         version: int = 0) -> dict[int, tuple[str, str, int]]:
        """Return engine -> (state, reason, bytes); with `agreed`, the worst any trainer rank saw (failed >
        aborted > committed) and the bytes all stage sources sent, the same on every rank, and every rank
        raises SyncAbortedError when a rank's own part failed (`error`: the trainer itself, not an engine)."""
        if not isinstance(outcomes, dict):
            outcomes = {o.engine: tuple(o.to_wire()) for o in outcomes}
        if not agreed:
            return outcomes
        merged: dict[int, tuple[str, str, int]] = {}
        order = {"committed": 0, "aborted": 1, "failed": 2}
        shared = self.gather({"error": error, "outcomes": {str(e): list(v) for e, v in outcomes.items()}})
        failures = [(rank, entry["error"]) for rank, entry in enumerate(shared) if entry["error"] is not None]
        if failures:
            raise SyncAbortedError(version, failures)
        for entry in shared:
            for engine, (state, reason, sent) in entry["outcomes"].items():
                engine = int(engine)
                before = merged.get(engine, ("committed", "", 0))
                worst = (state, reason) if engine not in merged or order[state] > order[before[0]] else before[:2]
                merged[engine] = (*worst, before[2] + sent)
        return merged

    def _record(self, version: int, wave_index: int, wave: list[Delivery], outcomes: dict, rows: Deliveries,
                started: float) -> None:
        """Apply a wave's outcomes: hold, drop or leave behind; rows and driven engines' close (leader)."""
        seconds = time.perf_counter() - started
        for d in wave:
            state, reason, sent = outcomes.get(d.engine, ("failed", "no outcome (its link was closed)", 0))
            link = self.links.get(d.engine)
            generation = link.generation if link is not None else -1
            source = TRAINER if not d.relayed else f"engine {d.source}"
            rows.add(d.engine, generation, wave_index, source, state, seconds, sent, reason)
            self._close_driven(version, [d.engine], ok=state == "committed")
            if state == "committed" and link is not None:
                self.held[d.engine] = version
                if self.is_leader:
                    self.roster.committed(d.engine, version)
            elif state == "failed":
                self._drop(d.engine, reason)
            elif self.is_leader:
                log.warning("fleet: engine %d did not commit version %d (%s); it keeps version %d", d.engine,
                            version, reason, self.held.get(d.engine, 0))
        for engine, (state, reason, _) in outcomes.items():  # a relay source that died meanwhile
            if state == "failed" and engine in self.links and engine not in {d.engine for d in wave}:
                self._drop(engine, reason)

    def _close_driven(self, version: int, engines: Sequence[int], *, ok: bool) -> None:
        for engine in engines:
            client = self.clients.get(engine)
            if client is not None and self.is_leader:
                try:
                    client.after_sync(version, ok)
                except Exception as e:  # noqa: BLE001 — the engine is dropped at its next transfer
                    log.warning("fleet: closing the update of version %d on engine %d (%s) failed: %s", version,
                                engine, client.url, e)

    def _join_background(self) -> None:
        if self._background is not None:
            self._background.join()
            self._background = None

    # ---- the leader's messages ----

    def send_app_message(self, payload: dict) -> None:
        """Leader: send an application message to every engine in the fleet."""
        for link in list(self.links.values()):
            try:
                link.transport.control.send(ControlMessage(ControlOp.APP, self.version, payload))
            except Exception as e:  # noqa: BLE001 — a dead engine is dropped at the next transfer
                log.warning("fleet: engine %d did not take an application message: %s", link.engine, e)

    def receiver_metrics(self, version: int) -> list[SyncMetrics]:
        """Leader: the metrics of every engine rank that committed `version` (engines behind it are skipped)."""
        import json

        out = []
        for engine, link in sorted(self.links.items()):
            if self.held.get(engine) != version:
                continue
            reports = link.transport.control.collect(Report.METRICS, version, link.transport.inference_ranks)
            out += [SyncMetrics.from_json(json.dumps(json.loads(raw.decode()))) for raw in reports.values()]
        return out

    def engines_holding(self, version: int) -> list[int]:
        """The engines in the fleet that hold `version`."""
        return sorted(e for e, held in self.held.items() if held == version)

    def close(self, reason: Optional[str] = None, *, broken: bool = False) -> None:
        """Stop every engine (leader: "stop", end transfers, wait for acknowledgements), close every link."""
        self._join_background()
        for engine, link in sorted(self.links.items()):
            if self.is_leader and link.transport is not None:
                control = link.transport.control
                try:
                    control.send(ControlMessage(ControlOp.STOP, self.held.get(engine, 0),
                                                {"reason": reason} if reason else {}))
                    link.transport.stop_transfers()
                    control.collect(Report.STOPPED, self.held.get(engine, 0), link.transport.inference_ranks,
                                    timeout_s=ACK_S if broken else None)
                except Exception as e:  # noqa: BLE001 — closing must not mask what stopped the trainer
                    log.info("fleet: engine %d did not acknowledge 'stop': %s", engine, e)
            link.close()
        self.links.clear()
        if self.fanout is not None:
            self.fanout.close()
