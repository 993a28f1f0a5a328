"""The trainer's driver: set up once, then sync. `TrainerWeightSync` on every trainer rank owns the HF weight
stream and the sender the configured transport builds; it picks the transport by `weight_sync.transport` from
the registry and uses only the declared `Transport` interface, so a new transport needs no change here.

The inference half is `megatron_sync.drivers.inference_sync.InferenceWeightSync` (importable from here too,
as in earlier releases).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Optional, Sequence

import torch

from megatron_sync.convert.hf_config import HFConfig
from megatron_sync.core.agreement import failing_together, torch_gather
from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.settings.sections import resolved
from megatron_sync.engines.base import EngineClient
from megatron_sync.engines.driven import EngineFleet, clients_from_config
from megatron_sync.core.errors import AgreedFailure, SyncAbortedError
from megatron_sync.fleet.p2p import P2PFleetDriver
from megatron_sync.fleet.trainer import FleetDriver
from megatron_sync.fleet.servers import ServerFleet
from megatron_sync.drivers.canary import TrainerCanary
from megatron_sync.trainer.forward import token_logprobs
from megatron_sync.trainer.megatron_config import check_model_config
from megatron_sync.core.metrics import SyncMetrics
from megatron_sync.core.grid import ParallelLayout
from megatron_sync.trainer.stream import MegatronWeightStream, all_stage_metadata, check_model_complete
from megatron_sync.transports import get_transport
from megatron_sync.session.control import ControlMessage, ControlOp, Report
from megatron_sync.session.secret import SessionSecret
from megatron_sync.session.session import SyncSession

from megatron_sync.drivers.inference_sync import AppHandler, IDLE_TIMEOUT_S, InferenceWeightSync  # noqa: F401
from megatron_sync.drivers.trainer_start import (
    build_converter, files_presentation, load_hf_config, open_trainer_session,
)

log = logging.getLogger("megatron_sync")
MiB = 2**20
ACK_AFTER_BREAK_S = 15.0
"""When a sync was ended (or failed without an agreed abort), how long the leader waits for the engines'
stop acknowledgements at most (they notice the ended transfer within about a second; a dead one never
answers, so this replaces timeout_s; generous for a loaded machine)."""


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
        if config.fleet and not transport_cls.keeps_server_fleet:
            self._start_fleet(transport_cls, converter)
            return
        with failing_together("checking the driven engines and starting their joins", self._gather):
            # Driven engines join this session only (run_id), like a launched inference job would; servers the
            # transport sends to directly take consecutive ranks even in a fleet (it keeps their membership)
            joining = config.replace(run_id=self.session.id) if self.session is not None else config
            joining = joining.replace(fleet=False) if transport_cls.keeps_server_fleet else joining
            self.engines.start_joins(joining, num_trainer_stages=self.layout.pp)
        with failing_together("connecting to the inference ranks", self._gather):
            with self.engines.joined():  # driven engines' workers join while the trainer connects
                if transport_cls.trainer_joins(self.layout):
                    if self.session is not None:
                        self.session.wait_ready()
                    meeting = self.session or files_presentation(config, self.layout, transport_cls, hf_config,
                                                                 self._secret)
                    self.transport = transport_cls.connect_trainer(config, self.layout, session=meeting)
                self.sender = transport_cls.make_sender(self.transport, self.stream, config,
                                                        converter.keep_together)
        if config.fleet:  # servers come and go between and during syncs (megatron_sync.fleet.servers)
            self.engines = ServerFleet.over(self.engines, self.transport, config.min_engines)

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
        from megatron_sync.drivers.colocate import colocated
        from megatron_sync.scale.auto import resolve

        with failing_together("choosing the transport (transport: auto)", self._gather):
            choice = resolve(config, self.layout, config.require_family(), hf_config, colocated=colocated())
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
        open_trainer_session(self.config, self.layout, transport_cls, hf_config, self._gather, self._secret,
                             opened=lambda session: setattr(self, "session", session))

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
        if self.fleet is not None:
            return self._sync_fleet(version)
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
        if isinstance(self.engines, ServerFleet):
            metrics.fleet = self.engines.take_rows()
        self.version = version
        self._check_canary(version, metrics)
        if self.auto_choice is not None and self.is_leader:
            log.info("%s", self.auto_choice.measured(version, time.perf_counter() - started))
        return metrics

    def _sync_fleet(self, version: int) -> SyncMetrics:
        """Sync `version` into the fleet: per-engine outcomes; raises only when the trainer failed or too few
        engines remain."""
        self._syncing = True
        try:
            metrics = self.fleet.sync(version)
        finally:
            self._syncing = False
            self.sender = self.fleet.sender
        self.version = version
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
