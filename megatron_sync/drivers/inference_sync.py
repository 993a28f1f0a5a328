"""The inference driver: `InferenceWeightSync` on every inference rank owns the receiver and follows the
trainer's control messages (sync version v, stop, memory handoffs, application messages). It picks the
transport by `weight_sync.transport` from the registry (or adopts the trainer's choice under `auto`) and uses
only the declared `Transport` interface.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from concurrent.futures import Future
from typing import Any, Callable, Optional

import torch

from megatron_sync.convert import get_family, keep_together_of
from megatron_sync.convert.model_digest import model_fields
from megatron_sync.core.errors import (PeerFailureError, RendezvousError, StoreSilentError, SyncAbortedError,
                                       SyncStoppedError, TrainerGoneError)
from megatron_sync.core.metrics import SyncMetrics
from megatron_sync.drivers.canary import engine_scores
from megatron_sync.engines.base import EngineAdapter
from megatron_sync.engines.exporter import MetricsExporter
from megatron_sync.engines.handoff import EngineHandoff
from megatron_sync.engines.serving import GenerationServer
from megatron_sync.fleet.engine import Relays, await_link, hello
from megatron_sync.fleet.membership import link_config
from megatron_sync.session.board import store_board
from megatron_sync.session.control import ControlMessage, ControlOp, Report
from megatron_sync.session.files import presenting
from megatron_sync.session.rendezvous import Identity, disagreements, expectations
from megatron_sync.session.secret import SessionSecret
from megatron_sync.session.session import DIAGNOSE_S, SyncSession
from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.transports import get_transport

log = logging.getLogger("megatron_sync")
IDLE_TIMEOUT_S = 24 * 3600.0  # how long an engine waits for the trainer's next message


AppHandler = Callable[[ControlMessage], None]


def _identity(config: WeightSyncConfig, transport_cls: Any, job_id: Optional[str], inference_rank: int,
              num_trainer_stages: Optional[int], backend: str, hf_config: Any) -> Identity:
    """Return what this inference rank presents at the trainer's rendezvous (its expectations, its model)."""
    return Identity(job=job_id or "", role="inference", member=inference_rank,
                    expects=expectations(config, trainer_stages=num_trainer_stages, backend=backend,
                                         shares=transport_cls.shares if transport_cls is not None else ()),
                    model=model_fields(hf_config) if hf_config is not None else None, session=config.run_id,
                    engine=config.engine_id if config.fleet else None)


def _check_rank(config: WeightSyncConfig, inference_rank: int) -> None:
    """Refuse a fleet engine without its id, and a rank outside the engine (fleet) or the inference job."""
    if config.fleet and config.engine_id is None:
        raise ValueError("weight_sync.fleet is on: say which engine this job is with weight_sync.fleet.engine_id "
                         "(0, 1, ...; a restarted engine presents its id again)")
    ranks = config.engine_tp_size if config.fleet else config.num_inference_ranks
    if not 0 <= inference_rank < ranks:
        raise ValueError(f"inference_rank={inference_rank} is outside " + (
            f"the engine's {ranks} ranks (engine_tp_size; a fleet's engine is its own job)" if config.fleet
            else f"num_inference_ranks={ranks}"))


class InferenceWeightSync:
    """The inference half on one inference rank: joins the transport and applies syncs.

    Commits go through a `GenerationServer` with the config's `inflight_policy`:
    a version arriving while the engine generates goes live at a step boundary
    all of the engine's ranks (`engine_group`) agree on, and requests in flight
    are aborted, recomputed or kept as the policy says. `driven`: the rank is a
    worker of an engine the trainer drives over its own API (vLLM), which calls
    `apply` itself and never reads the control channel (so it cannot relay).
    """

    def __init__(
        self,
        config: WeightSyncConfig,
        engine: EngineAdapter,
        *,
        num_trainer_stages: Optional[int] = None,
        inference_rank: int,
        engine_group: Any = None,
        hf_config: Any = None,
        job_id: Optional[str] = None,
        driven: bool = False,
    ):
        _check_rank(config, inference_rank)
        self.config, self.engine = config, engine
        self.relays: Optional[Relays] = None  # a fleet engine's relays to and from other engines
        self.stop_reason: Optional[str] = None  # why the trainer stopped the session, when it said
        self.synced_version = 0  # the last version the trainer synced here (its numbering), for a "left" report
        self._acknowledged = False  # told the leader it stopped or left
        self._first_of_engine = inference_rank % config.engine_tp_size == 0  # reports the engine's canary scores
        self.exporter = MetricsExporter(config.metrics_port + inference_rank, inference_rank) \
            if config.metrics_port else None
        self.server = GenerationServer(engine, engine_group=engine_group, inflight_policy=config.inflight_policy,
                                       commit_timeout_s=config.timeout_s)
        auto = config.transport == "auto"  # adopt the trainer's choice once admitted to its session
        transport_cls = None if auto else get_transport(config.transport)
        self.transport = None
        self._fleet_board = None  # p2p in a fleet: where engines chained across links meet (closed with this)
        backend = config.resolved_backend(torch.cuda.is_available())
        identity = self._identity = _identity(config, transport_cls, job_id, inference_rank, num_trainer_stages,
                                              backend, hf_config)
        meets_at_store = auto or transport_cls.meets_at_store  # auto chooses among transports that do
        if hf_config is None and meets_at_store:
            log.warning("[inference rank %d] no HF config given: the trainer cannot check that this engine's "
                        "model-defining config fields equal its own", inference_rank)
        self.session = (SyncSession.join(config.master_address, config.master_port, identity,
                                         timeout_s=config.timeout_s, secret=SessionSecret.from_environment())
                        if meets_at_store else None)
        try:
            if num_trainer_stages is None:  # the trainer's, adopted at the rendezvous
                num_trainer_stages = self._trainer_stages(transport_cls)
            if auto:
                transport_cls = self._adopt_auto(identity, num_trainer_stages, backend)
            if self.session is not None:
                self.session.wait_ready()
            self._connect(transport_cls, num_trainer_stages, inference_rank, driven)
        except BaseException as e:
            if self.session is not None and not isinstance(e, RendezvousError):
                self.session.fail(f"{identity.describe()} failed while connecting: {type(e).__name__}: {e}")
            self.close()
            raise

    def _adopt_auto(self, identity: Identity, num_trainer_stages: int, backend: str) -> Any:
        """Take the transport the trainer chose under `transport: auto` (and its bucket size); refuse this job's
        own settings of that transport where they differ from the trainer's. Returns the transport class."""
        from megatron_sync.scale.auto import adopt_host_choice

        config = self.config = adopt_host_choice(self.config, dict(self.session.host_identity.expects))
        transport_cls = get_transport(config.transport)
        adopted = expectations(config, trainer_stages=num_trainer_stages, backend=backend, shares=transport_cls.shares)
        differ = disagreements(self.session.host_identity, dataclasses.replace(identity, expects=adopted))
        if differ:
            raise ValueError(f"transport auto: the trainer chose {config.transport}, and this job's "
                             "settings of it differ: " + "; ".join(differ))
        log.info("transport auto: the trainer chose %s with %g MiB buckets", config.transport, config.bucket_size_mb)
        return transport_cls

    def _connect(self, transport_cls: Any, num_trainer_stages: Optional[int], inference_rank: int,
                 driven: bool) -> None:
        """Connect the transport (a fleet engine: over its own link, once the trainer opens it), build the
        receiver, and in a fleet say hello and set up relays; then the memory handoff."""
        config, engine = self.config, self.engine
        # the same groups as the trainer's converter: the family's, plus each quantized weight with its scales
        keep_together = keep_together_of(get_family(config.require_family()),
                                         [m.name for m in engine.expected_tensors()])
        session, settings = self.session, config
        if transport_cls.meets_in_files:  # the trainer's directory session: presented where the transport meets
            session = presenting(self._identity, timeout_s=config.timeout_s, secret=SessionSecret.from_environment())
        if config.fleet:  # this engine's own link, opened by the trainer at a sync boundary
            session = self.session.part(await_link(self.session, config.engine_id, IDLE_TIMEOUT_S))
            settings = link_config(config)
        self.transport = transport_cls.connect_inference(
            settings, num_trainer_stages=num_trainer_stages, inference_rank=inference_rank, session=session)
        self.receiver = self.transport.make_receiver(engine, settings, keep_together, commit=self.server.commit)
        if config.fleet:
            hello(self.transport, self.receiver, relays=not driven)
            if hasattr(self.receiver, "join_fleet") and not driven:  # p2p: engines chain across links
                # blocking: a round's report from the engine chained before this one is taken at once
                self._fleet_board = store_board(self.session.store, prefix="", rank=inference_rank,
                                                timeout_s=config.timeout_s, blocking=True)
                self.receiver.join_fleet(self._fleet_board, config.engine_id, self.session.generation)
            self.relays = None if driven else Relays(self.session, self.receiver, self.transport, config,
                                                     rank=inference_rank, ranks=config.engine_tp_size)
        self.handoff = EngineHandoff(engine, self.transport.rank, self.receiver.live_shards, config.metrics_path)

    def _trainer_stages(self, transport_cls: Any) -> Optional[int]:
        """Return the trainer's pipeline stages as its rendezvous host stated them (an inference job need not
        repeat the trainer's layout): None where the transport takes them from its directory session; a
        transport that meets by its own means cannot tell them."""
        if transport_cls is not None and transport_cls.meets_in_files:
            return None
        if self.session is None:
            raise ValueError(f"transport {transport_cls.name!r} meets by its own means, not at the trainer's "
                             "rendezvous: pass num_trainer_stages (the serve job's --trainer-stages), the "
                             "trainer's pipeline-parallel size")
        return int(self.session.host_identity.expects["trainer_stages"])

    def next_control(self, timeout_s: float = IDLE_TIMEOUT_S) -> ControlMessage:
        """Wait for the trainer's next control message and return it.

        Raises TrainerGoneError when the trainer's rendezvous stops answering
        (it exited without "stop"; or it is stopped or hung: no answer within
        `config.timeout_s`) or nothing comes within `timeout_s`; no sync is
        running then, and the engine holds its last committed version.
        """
        try:
            return self.transport.control.next(timeout_s)
        except PeerFailureError as e:
            where = f"{self.config.master_address}:{self.config.master_port}"
            if isinstance(e, TrainerGoneError):  # the transport saw it go (disk_delta: its writers' locks)
                what = f"the trainer went away while this engine was idle: {e}"
            elif isinstance(e, StoreSilentError):
                what = (f"the trainer stopped answering while this engine was idle: its rendezvous at {where} accepts "
                        f"connections but has not answered for {self.config.timeout_s:g}s (the trainer is stopped, "
                        "e.g. SIGSTOP, or hung)")
            elif e.__cause__ is not None:
                what = (f"the trainer went away while this engine was idle: its rendezvous at {where} stopped "
                        "answering (it exited without 'stop')")
            else:
                what = f"no message from the trainer within {timeout_s:g}s while this engine was idle"
            raise TrainerGoneError(f"{what}; no sync was running, the engine holds version {self.engine.version}"
                                   ) from e

    def apply(self, version: int, relay: Optional[ControlMessage] = None,
              payload: Optional[dict] = None) -> Optional[SyncMetrics]:
        """Receive `version`; return metrics, or None if the sync was aborted on every rank.

        An aborted sync leaves the engine on its previous version and the
        transport ready for the next one. When the transfer breaks off, the
        engine keeps what it holds too and raises: SyncStoppedError if the
        trainer said "stop" (it is stopping, e.g. on SIGTERM, and ended the
        transfer; acknowledged here), else PeerFailureError saying what the
        trainer's rendezvous host answers now (stopped or hung, gone, or alive),
        within `timeout_s` plus at most 2 x `session.DIAGNOSE_S` (a probe of
        the host, then, if it answers, a look for "stop").
        """
        try:
            with self.handoff.around_sync(version, report=lambda row: self._report_handoff(
                    Report.RESTORED, self.handoff.handoff, row, None)):  # a released engine takes its memory back
                if relay is not None:
                    metrics = self.relays.receive(relay)
                else:
                    route = (payload or {}).get("route")
                    metrics = self.receiver.receive(version, route) if route else self.receiver.receive(version)
        except SyncAbortedError as e:
            log.error("%s", e)
            why = "; ".join(f"[transport rank {rank}] {message.splitlines()[0]}" for rank, message in e.failures)
            self._report_outcome(version, json.dumps({"aborted": why}).encode())
            if self.exporter is not None:
                self.exporter.aborted()
            return None
        except PeerFailureError as e:
            answers, host = self.session.host_state() if self.session is not None else (True, "")
            stop = self._stop_posted() if answers else None
            if stop is not None:
                self.handle(stop, {})  # acknowledged
                raise SyncStoppedError(f"the trainer ended the session during the sync of version {version}"
                                       + (f": {self.stop_reason}" if self.stop_reason else "")) from e
            raise PeerFailureError(f"sync of version {version} failed: {e}" + (f"; {host}" if host else "")) from e
        self.synced_version = version
        scores = engine_scores(self.engine, payload or {})  # the canary: every rank of the engine scores it
        if scores is not None and self._first_of_engine:
            metrics.canary = scores
        if self.exporter is not None:
            self.exporter.committed(metrics, self.engine.version)
        self._report_outcome(version, metrics.to_json().encode())
        return metrics

    def _report_outcome(self, version: int, payload: bytes) -> None:
        """Report this rank's metrics of `version`, or that every rank aborted it (for `receiver_metrics`)."""
        self.transport.control.report(Report.METRICS, version, self.transport.rank, payload)

    def _stop_posted(self) -> Optional[ControlMessage]:
        """Return the trainer's "stop" if it is posted within `DIAGNOSE_S` (a trainer that stops mid-sync posts
        it before it ends the transfer), else None (the trainer is gone or silent, or another rank failed)."""
        try:
            message = self.transport.control.next(DIAGNOSE_S)
        except PeerFailureError:
            return None
        return message if message.op is ControlOp.STOP else None

    def _hand_over(self, message: ControlMessage) -> None:
        """Release the engine's memory (RELEASE) or take it back (RESTORE); report the row, or the error."""
        release = message.op is ControlOp.RELEASE
        handoff = int(message.payload["handoff"])
        try:
            row, error = (self.handoff.release(handoff) if release else self.handoff.restore()), None
        except Exception as e:  # noqa: BLE001 — the trainer raises it, naming this rank
            row, error = None, f"{type(e).__name__}: {e}"
        self._report_handoff(Report.RELEASED if release else Report.RESTORED, handoff, row, error)

    def _report_handoff(self, kind: Report, handoff: int, row: Optional[SyncMetrics], error: Optional[str]) -> None:
        payload = {"row": row.to_json() if row is not None else None, "error": error}
        self.transport.control.report(kind, handoff, self.transport.rank, json.dumps(payload).encode())

    def apply_in_background(self, version: int) -> Future:
        """Receive `version` while the engine keeps generating; the switch obeys `inflight_policy`."""
        return self.server.run_in_background(self.apply, version)

    def serve(self, handlers: Optional[dict[str, AppHandler]] = None) -> None:
        """Follow control messages until "stop": apply each sync, pass application messages to
        `handlers[payload["name"]]`."""
        while self.handle(self.next_control(), handlers or {}):
            pass

    def handle(self, message: ControlMessage, handlers: dict[str, AppHandler]) -> bool:
        """Act on one control message; return False once it was "stop" (acknowledged to the trainer)."""
        if message.op is ControlOp.STOP:
            self.stop_reason = message.payload.get("reason")
            self.transport.control.report(Report.STOPPED, message.version, self.transport.rank,
                                          str(self.engine.version).encode())
            self._acknowledged = True
            return False
        if message.op is ControlOp.SYNC:
            self.apply(message.version, payload=message.payload)
            return True
        if message.op is ControlOp.RELAY_RECEIVE:  # a fleet: the version comes from another engine
            self.apply(message.version, relay=message)
            return True
        if message.op is ControlOp.RELAY_SEND:
            self.relays.send(message)
            return True
        if message.op in (ControlOp.RELEASE, ControlOp.RESTORE):
            self._hand_over(message)
            return True
        name = message.payload.get("name")
        if name not in handlers:
            raise ValueError(f"application message {name!r} has no handler on this engine; "
                             f"handlers: {sorted(handlers)}")
        handlers[name](message)
        return True

    def close(self, why: str = "") -> None:
        """Finish a background receive, then release the transport and the session; safe to call twice.

        A rank leaving without having read "stop" says so first (`why`), where the leader collects stop
        acknowledgements, so a trainer that stops later does not wait for it."""
        self.server.close()
        if getattr(self, "exporter", None) is not None:
            self.exporter.close()
        if self.transport is not None:
            if not self._acknowledged:
                try:
                    self.transport.control.report(Report.STOPPED, self.synced_version, self.transport.rank,
                                                  f"left: {why}".encode())
                except Exception as e:  # noqa: BLE001 — the trainer may be gone; nothing waits then
                    log.info("[inference rank %d] could not say it leaves: %s", self.transport.rank, e)
                self._acknowledged = True
            self.transport.close()
            self.transport = None
        if getattr(self, "_fleet_board", None) is not None:
            self._fleet_board.close()
            self._fleet_board = None
        if self.session is not None:
            self.session.close()
            self.session = None
