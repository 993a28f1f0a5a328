"""The drivers on both sides: set up once, then sync (trainer) or serve syncs (inference).

Trainer: `TrainerWeightSync` on every trainer rank owns the HF weight stream and
the sender the configured transport builds. Inference: `InferenceWeightSync` on
every inference rank owns the receiver and follows the trainer's control
messages (sync version v, stop, application messages). Both pick the transport
by `weight_sync.transport` from the registry and use only the declared
`Transport` interface, so a new transport needs no change here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_sync.convert import get_converter, get_family, keep_together_of
from megatron_sync.convert.hf_config import HFConfig
from megatron_sync.core.agreement import failing_together, torch_gather
from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.settings.sections import resolved
from megatron_sync.engines.base import EngineAdapter, EngineClient
from megatron_sync.engines.driven import EngineFleet, clients_from_config
from megatron_sync.engines.serving import GenerationServer
from megatron_sync.core.errors import (AgreedFailure, PeerFailureError, RendezvousError, StoreSilentError,
                                  SyncAbortedError, SyncStoppedError, TrainerGoneError)
from megatron_sync.fleet.engine import Relays, await_link, hello
from megatron_sync.fleet.p2p import P2PFleetDriver
from megatron_sync.fleet.trainer import FleetDriver, link_config
from megatron_sync.drivers.canary import TrainerCanary, engine_scores
from megatron_sync.engines.exporter import MetricsExporter
from megatron_sync.engines.handoff import EngineHandoff
from megatron_sync.trainer.forward import token_logprobs
from megatron_sync.trainer.megatron_config import check_model_config
from megatron_sync.core.meta import dtype_from_name
from megatron_sync.core.metrics import SyncMetrics
from megatron_sync.convert.model_digest import model_digest, model_fields
from megatron_sync.core.grid import ParallelLayout
from megatron_sync.trainer.stream import MegatronWeightStream, all_stage_metadata, check_model_complete
from megatron_sync.transports import get_transport
from megatron_sync.session.control import ControlMessage, ControlOp, Report
from megatron_sync.session.group import StoreBoard
from megatron_sync.session.rendezvous import Identity, disagreements, expectations
from megatron_sync.session.secret import SessionSecret
from megatron_sync.session.session import DIAGNOSE_S, SyncSession, new_session_id

log = logging.getLogger("megatron_sync")
MiB = 2**20
IDLE_TIMEOUT_S = 24 * 3600.0  # how long an engine waits for the trainer's next message
ACK_AFTER_BREAK_S = 15.0
"""When a sync was ended (or failed without an agreed abort), how long the leader waits for the engines'
stop acknowledgements at most (they notice the ended transfer within about a second; a dead one never
answers, so this replaces timeout_s; generous for a loaded machine)."""


def load_hf_config(config: WeightSyncConfig, hf_config: Any = None) -> Any:
    """Return `hf_config` when given (a transformers config or a dict), else the JSON at `config.hf_config_path`."""
    if hf_config is not None:
        return hf_config
    if config.hf_config_path is None:
        raise ValueError(
            "no HF config for the inference model: set weight_sync.hf_config_path to its config.json "
            "or pass hf_config= (the shapes every converted tensor is checked against)"
        )
    try:
        with open(config.hf_config_path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"weight_sync.hf_config_path={config.hf_config_path!r} cannot be read as a config.json: "
                         f"{e}") from e


def build_converter(config: WeightSyncConfig, hf_config: Any = None) -> Any:
    """Return the converter for `config.family`, `config.dtype` and `config.draft` over the HF config (`load_hf_config`)."""
    hf_config = load_hf_config(config, hf_config)
    return get_converter(config.require_family(), hf_config, dtype=dtype_from_name(config.dtype),
                         draft=config.draft == "sync")


class TrainerWeightSync:
    """The trainer half. Construct and call `sync()` on every trainer rank (both are collective).

    Start-up, before any weight moves: the first joining trainer rank hosts the
    sync session (the rendezvous, `transport/session.py`) and the other joining
    ranks join it; every Megatron parameter has a conversion rule, the stages
    together produce exactly the HF checkpoint the converter expects; the
    inference job's ranks are admitted only if they expect the same layout and
    model (`transport/rendezvous.py`); every rank of the transport computed the
    same plan. Any failure is raised on every trainer rank and posted to the
    session, so the engines fail at once quoting it.

    `keep_sent`: for checks and dumps, the sender keeps what each sync sent (`sender.sent_tensors()`), also
    for transports that keep no copy otherwise (p2p).

    Engines driven over their own API (vLLM, SGLang): `engine_clients`
    (pass the same list on every trainer rank; default: built from
    `config.engines`). The leader starts their workers joining the transport
    group before it connects, pauses them before each sync and resumes them
    after it; a failed sync names the failing worker ("vLLM worker 1 of URL").
    """

    def __init__(
        self,
        config: WeightSyncConfig,
        chunks: list[torch.nn.Module],
        converter: Any = None,
        layout: Optional[ParallelLayout] = None,
        *,
        hf_config: Any = None,
        trainer_group: Any = None,
        engine_clients: Optional[Sequence[EngineClient]] = None,
        keep_sent: bool = False,
    ):
        if not config.enabled:
            raise ValueError("weight_sync.enabled is false; build no TrainerWeightSync (WeightSyncCallback.from_config skips it)")
        self.config = config
        self.layout = layout or ParallelLayout.from_megatron()
        self.version = 0
        self.transport = None
        self.session: Optional[SyncSession] = None
        self._transfer_broken = False  # the last sync failed without an agreed abort
        self._syncing = False  # a sync is under way (a watchdog closing from its own thread sees it)
        self.engines_released = False  # the engines freed their memory for training (`release_engines`)
        self.handoff_rows: list[SyncMetrics] = []  # the engines' restore rows of the last sync that restored them
        self._handoffs = 0
        self.engines = EngineFleet([], driven=False)
        self.fleet: Optional[FleetDriver] = None  # weight_sync.fleet: engines come and go (megatron_sync.fleet)
        self._gather = torch_gather(trainer_group)
        self._secret = SessionSecret.from_environment()  # MEGATRON_SYNC_SECRET: proven, never sent or logged
        if converter is None or hf_config is not None:
            hf_config = load_hf_config(config, hf_config)
        self.auto_choice = None  # transport auto: what the scale model chose, and its prediction
        if config.transport == "auto":
            config = self.config = self._resolve_auto(config, hf_config if hf_config is not None else converter.config)
        transport_cls = get_transport(config.transport)
        try:
            if transport_cls.meets_at_store:
                self._open_session(transport_cls, hf_config)
            self._start(transport_cls, chunks, converter, hf_config, trainer_group, engine_clients)
            self.sender.keep_sent = keep_sent  # checks and dumps: keep what each sync sent (`sent_tensors`)
            self.canary = self._canary(chunks, hf_config if hf_config is not None else self.stream.converter.config)
        except BaseException as e:
            self._close_after_failed_start(e)
            raise

    def _close_after_failed_start(self, error: BaseException) -> None:
        """Post `error` to the session and close. When every trainer rank agreed on it, the host keeps the
        rendezvous open (up to `timeout_s`) until every inference rank, including those still starting,
        was told, and the other trainer ranks wait for it (so their launcher does not end the host first)."""
        agreed = isinstance(error, AgreedFailure)
        # driven engines are every inference rank: if none was asked to join (refused up front), none is coming
        nobody_coming = self.engines.driven and self.engines.clients and not self.engines.joins_started
        if self.session is not None:
            self.session.fail(f"the trainer failed while starting: {error}")
            if agreed:
                self.session.close(linger_s=0.0 if nobody_coming else self.config.timeout_s)
        self.close()
        if agreed:
            try:
                self._gather(None)  # every rank leaves once the host has
            except Exception:  # noqa: BLE001 — the start-up error is the one to raise
                log.warning("the trainer ranks could not wait for the rendezvous host to leave", exc_info=True)

    def _canary(self, chunks: list, hf_config: Any) -> TrainerCanary:
        """The canary check of this trainer (off unless canary_length or canary_tokens is set)."""
        vocab = HFConfig(hf_config)["vocab_size"]

        def score(tokens: list[int]) -> list[float]:
            return token_logprobs(chunks, self.layout, torch.tensor(tokens), vocab).tolist()

        return TrainerCanary(self.config, vocab, score, self._gather)

    def _start(self, transport_cls: Any, chunks: list, converter: Any, hf_config: Any, trainer_group: Any,
               engine_clients: Optional[Sequence[EngineClient]]) -> None:
        """The start-up checks, then (once every rank of both jobs was admitted) the transport and sender."""
        config = self.config
        with failing_together("starting the trainer's weight sync", self._gather):
            if hf_config is not None:  # the model trained and the one the engines serve must be the same
                check_model_config(chunks, hf_config)
            converter = converter if converter is not None else build_converter(config, hf_config)
            self.stream = MegatronWeightStream(
                chunks, self.layout, converter,
                gather_budget_bytes=int(config.gather_budget_mb * MiB), group=trainer_group,
            )
            if self.stream.is_source:
                check_model_complete(all_stage_metadata(self.stream), converter)
        self.engines = self._engine_fleet(config, engine_clients, transport_cls.trainer_joins(self.layout))
        if config.fleet:
            self._start_fleet(transport_cls, converter)
            return
        with failing_together("checking the driven engines and starting their joins", self._gather):
            # Driven engines join this session only (run_id), like a launched inference job would.
            joining = config.replace(run_id=self.session.id) if self.session is not None else config
            self.engines.start_joins(joining, num_trainer_stages=self.layout.pp)
        with failing_together("connecting to the inference ranks", self._gather):
            with self.engines.joined():  # driven engines' workers join while the trainer connects
                if transport_cls.trainer_joins(self.layout):
                    if self.session is not None:
                        self.session.wait_ready()
                    self.transport = transport_cls.connect_trainer(config, self.layout, session=self.session)
                self.sender = transport_cls.make_sender(self.transport, self.stream, config,
                                                        converter.keep_together)

    def _start_fleet(self, transport_cls: Any, converter: Any) -> None:
        """A fleet: the session is ready for the trainer ranks; link the initial engines (megatron_sync.fleet)."""
        with failing_together("checking the driven engines and starting their joins", self._gather):
            joining = self.config.replace(run_id=self.session.id) if self.session is not None else self.config
            self.engines.start_joins(joining, num_trainer_stages=self.layout.pp)
        with failing_together("linking the fleet's engines", self._gather):
            if self.session is not None:
                self.session.wait_ready()
            with self.engines.joined():  # driven engines' workers join as their links open
                driver = P2PFleetDriver if self.config.transport == "p2p" else FleetDriver
                self.fleet = driver(self.config, self.layout, session=self.session, transport_cls=transport_cls,
                                         stream=self.stream, keep_together=converter.keep_together,
                                         gather=self._gather, clients=self.engines.clients)
                self.fleet.start()
                self.sender = self.fleet.sender

    def _resolve_auto(self, config: WeightSyncConfig, hf_config: Any) -> WeightSyncConfig:
        """Return `config` with transport auto resolved by the scale model (every rank computes the same
        choice from the same inputs; the ranks check that they agree), and log the choice."""
        from megatron_sync.scale.auto import resolve

        with failing_together("choosing the transport (transport: auto)", self._gather):
            choice = resolve(config, self.layout, config.require_family(), hf_config)
            chosen = self._gather(choice.to_wire())
            if any(c != chosen[0] for c in chosen):
                raise RuntimeError(f"trainer ranks resolved transport auto differently: {chosen}")
        self.auto_choice = choice
        log.info("%s", choice.describe())
        return resolved(config, transport=choice.transport, bucket_size_mb=choice.bucket_size_mb)

    def _engine_fleet(self, config: WeightSyncConfig, clients: Optional[Sequence[EngineClient]],
                      joins: bool) -> EngineFleet:
        """Return the driven engines: their clients on the leader (stage 0's source), none elsewhere."""
        clients = list(clients) if clients is not None else clients_from_config(config)
        leads = joins and self.layout.is_stage_source and self.layout.pp_rank == 0
        return EngineFleet(clients if leads else [], driven=any(self._gather(bool(clients))))

    def _open_session(self, transport_cls: Any, hf_config: Any) -> None:
        """Host (the first joining trainer rank) or join the sync session; collective on every trainer rank."""
        joins = transport_cls.trainer_joins(self.layout)
        token = uuid.uuid4().hex  # the first trainer rank's token names the trainer job
        roster = self._gather({"joins": joins, "token": token, "session": self.config.run_id or new_session_id()})
        members = [entry["token"] for entry in roster if entry["joins"]]
        me = members.index(token) if joins else None
        backend = self.config.resolved_backend(torch.cuda.is_available())
        identity = Identity(job=f"trainer-{roster[0]['token'][:8]}", role="trainer",
                            member=me if me is not None else -1,
                            expects=expectations(self.config, trainer_stages=self.layout.pp, backend=backend,
                                                 shares=transport_cls.shares),
                            model=model_fields(hf_config) if hf_config is not None else None,
                            session=roster[0]["session"])
        if hf_config is None:
            log.warning("no HF config (a converter was passed without hf_config=): the rendezvous cannot compare "
                        "the engines' model-defining config fields with the trainer's")
        where = (self.config.master_address, self.config.master_port)
        with failing_together("hosting the sync session", self._gather):
            if me == 0:
                fleet = self.config.fleet  # a fleet's engines join whenever they come (not members)
                self.session = SyncSession.host(
                    *where, identity, timeout_s=self.config.timeout_s,
                    members={"trainer": len(members)} if fleet else {"trainer": len(members),
                                                                      "inference": self.config.num_inference_ranks},
                    engine_ranks=self.config.engine_tp_size if fleet else None, secret=self._secret)
                log.info("hosting weight-sync session %s at %s:%d (model digest %s)", self.session.id, *where,
                         model_digest(identity.model or {})[:12])
        with failing_together("joining the sync session", self._gather):
            if me is not None and me > 0:
                self.session = SyncSession.join(*where, identity, timeout_s=self.config.timeout_s,
                                                secret=self._secret)

    @property
    def is_leader(self) -> bool:
        """True on the rank that talks to the engines (the transport's rank 0; a fleet's rendezvous host)."""
        if self.fleet is not None:
            return self.fleet.is_leader
        return self.transport is not None and self.transport.is_leader

    def sync(self) -> SyncMetrics:
        """Stream the current weights as the next version; return this rank's metrics.

        Returns only after every inference rank committed; raises on every
        trainer rank if any rank failed (the engines then keep the previous version).
        """
        version = self.version + 1
        started = time.perf_counter()
        if self.fleet is not None:  # per-engine outcomes; raises only when the trainer failed or too few remain
            self._syncing = True
            try:
                metrics = self.fleet.sync(version)
            finally:
                self._syncing = False
                self.sender = self.fleet.sender
            self.version = version
            return metrics
        if self.engines.driven:
            with failing_together(f"pausing the engines for version {version}", self._gather):
                self.engines.before_sync(version)
        if self.is_leader:
            self.engines.begin_transfer(version)
            self.transport.control.send(ControlMessage(ControlOp.SYNC, version, self.canary.payload))
        self._syncing = True
        try:
            with failing_together(f"weight sync of version {version}", self._gather):
                try:
                    metrics = self.sender.sync(version)
                except SyncAbortedError as e:
                    raise self.engines.named(e, self.transport.inference_ranks if self.transport is not None else None)
        except BaseException as e:
            # not an abort every rank agreed on: a peer died or fell silent, or this rank was stopped
            self._transfer_broken = not (isinstance(e, AgreedFailure) and
                                         all(m.startswith("SyncAbortedError") for _, m in e.failures))
            self.engines.after_sync(version, ok=False)  # resumes them on the previous version; never raises
            self.engines_released = False  # a released engine restored itself for the sync, whatever its outcome
            raise
        finally:
            self._syncing = False
        if self.engines_released:
            self.handoff_rows = self._handoff_rows(Report.RESTORED) if self.is_leader else []
            self.engines_released = False
        if self.engines.driven:
            with failing_together(f"committing version {version} on the engines", self._gather):
                self.engines.after_sync(version, ok=True)
        self.version = version
        self._check_canary(version, metrics)
        if self.auto_choice is not None and self.is_leader:
            log.info("version %d: synced in %.3f s measured; the scale model predicted %.3f s (transport auto: "
                     "%s, %g MiB buckets, profile %s)", version, time.perf_counter() - started,
                     self.auto_choice.predicted_s, self.auto_choice.transport, self.auto_choice.bucket_size_mb,
                     self.auto_choice.profile)
        return metrics

    def _check_canary(self, version: int, metrics: SyncMetrics) -> None:
        """Compare every engine's canary scores with the trainer's own (`drivers.canary`); collective."""
        leader = None
        if self.is_leader:
            ranks, tp = self.transport.inference_ranks, self.config.engine_tp_size
            firsts = [] if self.engines.driven else list(range(ranks.start, ranks.stop, tp))
            leader = (self.transport.control, firsts)
        with failing_together(f"checking the engines' canary scores of version {version}", self._gather):
            self.canary.check(version, metrics, leader=leader, clients=self.engines.clients,
                              timeout_s=self.config.timeout_s)

    def release_engines(self) -> list[SyncMetrics]:
        """Have every inference rank free its live weights, and wait until all did; return their rows
        (leader; [] elsewhere). Collective on every trainer rank: afterwards the trainer may take the
        memory. The next sync (or `restore_engines`) gives it back. See `megatron_sync.engines.handoff`."""
        return self._hand_over(ControlOp.RELEASE, Report.RELEASED, "releasing the engines' memory")

    def restore_engines(self) -> list[SyncMetrics]:
        """Have every released inference rank take its memory back and reload the version it holds, for
        generation without a sync first; return their rows (leader). Collective on every trainer rank."""
        if not self.engines_released:
            return []
        return self._hand_over(ControlOp.RESTORE, Report.RESTORED, "restoring the engines' memory")

    def _hand_over(self, op: ControlOp, kind: Report, what: str) -> list[SyncMetrics]:
        if self.engines.driven:
            raise ValueError(f"{what}: engines driven over their own API (weight_sync.engines) release memory "
                             "through their own sleep mode, not through the sync's control channel")
        if op is ControlOp.RELEASE:
            self._handoffs += 1
        rows: list[SyncMetrics] = []
        with failing_together(what, self._gather):
            if self.is_leader:
                self.transport.control.send(ControlMessage(op, self.version, {"handoff": self._handoffs}))
                rows = self._handoff_rows(kind)
        self.engines_released = op is ControlOp.RELEASE
        return rows

    def _handoff_rows(self, kind: Report) -> list[SyncMetrics]:
        """Return every inference rank's row of the current handoff (leader); raise naming the ranks that failed."""
        reports = self.transport.control.collect(kind, self._handoffs, self.transport.inference_ranks)
        answers = {rank: json.loads(raw.decode()) for rank, raw in reports.items()}
        failed = [f"inference rank {rank}: {a['error']}" for rank, a in answers.items() if a["error"]]
        if failed:
            raise RuntimeError(f"{kind.value} on the engines failed: " + "; ".join(failed))
        return [SyncMetrics.from_json(a["row"]) for a in answers.values()]

    def send_app_message(self, payload: dict) -> None:
        """Send an application message (JSON-serialisable) to every inference rank (leader only)."""
        assert self.is_leader, "only the leader talks to the engines"
        if self.fleet is not None:
            self.fleet.send_app_message(payload)
            return
        self.transport.control.send(ControlMessage(ControlOp.APP, self.version, payload))

    def receiver_metrics(self, version: int) -> list[SyncMetrics]:
        """Return the metrics each inference rank reported for `version` (leader only).

        Raises SyncAbortedError when the inference ranks aborted it (a transport whose `sync()` returns
        before the engines apply, disk_delta: e.g. its writer could not publish the version)."""
        reports = {rank: json.loads(raw.decode())
                   for rank, raw in self.transport.control.collect(Report.METRICS, version,
                                                                   self.transport.inference_ranks).items()}
        aborted = [(rank, report["aborted"]) for rank, report in reports.items() if "aborted" in report]
        if aborted:
            raise SyncAbortedError(version, aborted)
        return [SyncMetrics.from_json(json.dumps(report)) for report in reports.values()]

    def close(self, reason: Optional[str] = None) -> None:
        """Tell the engines to stop (leader), then release the transport and the session; safe to call twice.

        The engines exit 0 on the version they hold, printing `reason` (why the
        trainer stopped, when it did not simply finish), also when they were in
        the middle of a sync (a trainer stopped by SIGTERM): see `_stop_engines`.
        """
        self.engines.close()  # driven engines' workers acknowledge "stop" as they leave
        if self.fleet is not None:
            self.fleet.close(reason, broken=self._syncing)
            self.fleet = None
        if self.transport is not None:
            if self.is_leader:
                self._stop_engines(reason)
            self.transport.close()
            self.transport = None
        if self.session is not None:
            self.session.close()
            self.session = None

    def _stop_engines(self, reason: Optional[str]) -> None:
        """Post "stop", end any transfer still in flight, and wait for every engine rank to acknowledge.

        Engine ranks waiting in a transfer fail at once when it ends, read "stop"
        and leave on the version they hold; the leader hosts the rendezvous store,
        so it waits for their acknowledgements (or their word that they already
        left) before the store goes away: up to `timeout_s`, or `ACK_AFTER_BREAK_S`
        when a sync was ended (during one, or after one failed without an agreed
        abort: engines that lost a peer leave by themselves; one that died says nothing).
        """
        control = self.transport.control
        try:
            control.send(ControlMessage(ControlOp.STOP, self.version, {"reason": reason} if reason else {}))
            self.transport.stop_transfers()
            acks = control.collect(Report.STOPPED, self.version, self.transport.inference_ranks,
                                   timeout_s=ACK_AFTER_BREAK_S if self._transfer_broken or self._syncing else None)
        except Exception as e:  # noqa: BLE001 — closing after a failure must not mask it
            log.warning("the engines did not all acknowledge 'stop': %s", e)
            return
        left = {rank: payload.decode() for rank, payload in acks.items() if payload.startswith(b"left")}
        if left:
            log.info("engine ranks that had left before 'stop': %s", left)


AppHandler = Callable[[ControlMessage], None]


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
        if config.fleet and config.engine_id is None:
            raise ValueError("weight_sync.fleet is on: say which engine this job is with weight_sync.fleet.engine_id "
                             "(0, 1, ...; a restarted engine presents its id again)")
        ranks = config.engine_tp_size if config.fleet else config.num_inference_ranks
        if not 0 <= inference_rank < ranks:
            raise ValueError(f"inference_rank={inference_rank} is outside " + (
                f"the engine's {ranks} ranks (engine_tp_size; a fleet's engine is its own job)" if config.fleet
                else f"num_inference_ranks={ranks}"))
        self.config = config
        self.relays: Optional[Relays] = None  # a fleet engine's relays to and from other engines
        self.engine = engine
        self.stop_reason: Optional[str] = None  # why the trainer stopped the session, when it said
        self.synced_version = 0  # the last version the trainer synced here (its numbering), for a "left" report
        self._acknowledged = False  # told the leader it stopped or left
        self._first_of_engine = inference_rank % config.engine_tp_size == 0  # reports the engine's canary scores
        self.exporter = MetricsExporter(config.metrics_port + inference_rank, inference_rank) \
            if config.metrics_port else None
        self.server = GenerationServer(engine, engine_group=engine_group, inflight_policy=config.inflight_policy,
                                       commit_timeout_s=config.timeout_s)
        # the same groups as the trainer's converter: the family's, plus each quantized weight with its scales
        keep_together = keep_together_of(get_family(config.require_family()),
                                         [m.name for m in engine.expected_tensors()])
        auto = config.transport == "auto"  # adopt the trainer's choice once admitted to its session
        transport_cls = None if auto else get_transport(config.transport)
        self.transport = None
        backend = config.resolved_backend(torch.cuda.is_available())
        identity = Identity(job=job_id or "", role="inference", member=inference_rank,
                            expects=expectations(config, trainer_stages=num_trainer_stages, backend=backend,
                                                 shares=transport_cls.shares if transport_cls is not None else ()),
                            model=model_fields(hf_config) if hf_config is not None else None, session=config.run_id,
                            engine=config.engine_id if config.fleet else None)
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
                from megatron_sync.scale.auto import adopt_host_choice

                config = self.config = adopt_host_choice(config, dict(self.session.host_identity.expects))
                transport_cls = get_transport(config.transport)
                adopted = expectations(config, trainer_stages=num_trainer_stages, backend=backend,
                                       shares=transport_cls.shares)
                differ = disagreements(self.session.host_identity, dataclasses.replace(identity, expects=adopted))
                if differ:
                    raise ValueError(f"transport auto: the trainer chose {config.transport}, and this job's "
                                     "settings of it differ: " + "; ".join(differ))
                log.info("transport auto: the trainer chose %s with %g MiB buckets", config.transport,
                         config.bucket_size_mb)
            if self.session is not None:
                self.session.wait_ready()
            session, settings = self.session, config
            if config.fleet:  # this engine's own link, opened by the trainer at a sync boundary
                session = self.session.part(await_link(self.session, config.engine_id, IDLE_TIMEOUT_S))
                settings = link_config(config)
            self.transport = transport_cls.connect_inference(
                settings, num_trainer_stages=num_trainer_stages, inference_rank=inference_rank, session=session)
            self.receiver = self.transport.make_receiver(engine, settings, keep_together, commit=self.server.commit)
            if config.fleet:
                hello(self.transport, self.receiver, relays=not driven)
                if hasattr(self.receiver, "join_fleet") and not driven:  # p2p: engines chain across links
                    self.receiver.join_fleet(StoreBoard(self.session.store, prefix="", rank=inference_rank,
                                                        timeout_s=config.timeout_s),
                                             config.engine_id, self.session.generation)
                self.relays = None if driven else Relays(self.session, self.receiver, self.transport, config, rank=inference_rank,
                                     ranks=config.engine_tp_size)
            self.handoff = EngineHandoff(engine, self.transport.rank, self.receiver.live_shards, config.metrics_path)
        except BaseException as e:
            if self.session is not None and not isinstance(e, RendezvousError):
                self.session.fail(f"{identity.describe()} failed while connecting: {type(e).__name__}: {e}")
            self.close()
            raise

    def _trainer_stages(self, transport_cls: Any) -> int:
        """Return the trainer's pipeline stages as its rendezvous host stated them (an inference job need not
        repeat the trainer's layout); a transport that meets by its own means cannot tell it."""
        if self.session is None:
            raise ValueError(f"transport {transport_cls.name!r} meets through files, not at the trainer's "
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
        if self.session is not None:
            self.session.close()
            self.session = None
