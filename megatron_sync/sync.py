"""The drivers on both sides: set up once, then sync (trainer) or serve syncs (inference).

Trainer: `TrainerWeightSync` on every trainer rank owns the HF weight stream and
the sender the configured transport builds. Inference: `InferenceWeightSync` on
every inference rank owns the receiver and follows the trainer's control
messages (sync version v, stop, application messages). Both pick the transport
by `weight_sync.transport` from the registry and use only the declared
`Transport` interface, so a new transport needs no change here.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import torch

from converters import get_converter, get_family, keep_together_of
from megatron_sync.agreement import failing_together, torch_gather
from megatron_sync.config import WeightSyncConfig
from megatron_sync.engines.base import EngineAdapter, EngineClient
from megatron_sync.engines.fleet import EngineFleet, clients_from_config
from megatron_sync.engines.serving import GenerationServer
from megatron_sync.errors import PeerFailureError, RendezvousError, SyncAbortedError, TrainerGoneError
from megatron_sync.meta import dtype_from_name
from megatron_sync.metrics import SyncMetrics
from megatron_sync.model_digest import model_digest, model_fields
from megatron_sync.parallel import ParallelLayout
from megatron_sync.stream import MegatronWeightStream, all_stage_metadata, check_model_complete
from megatron_sync.transport import get_transport
from megatron_sync.transport.control import ControlMessage, ControlOp, Report
from megatron_sync.transport.rendezvous import Identity, expectations
from megatron_sync.transport.session import SyncSession, new_session_id

log = logging.getLogger("megatron_sync")
MiB = 2**20
IDLE_TIMEOUT_S = 24 * 3600.0  # how long an engine waits for the trainer's next message


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
    ):
        if not config.enabled:
            raise ValueError("weight_sync.enabled is false; build no TrainerWeightSync (WeightSyncCallback.from_config skips it)")
        self.config = config
        self.layout = layout or ParallelLayout.from_megatron()
        self.version = 0
        self.transport = None
        self.session: Optional[SyncSession] = None
        self.engines = EngineFleet([], driven=False)
        self._gather = torch_gather(trainer_group)
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
        except BaseException as e:
            if self.session is not None:
                self.session.fail(f"the trainer failed while starting: {e}")
            self.close()
            raise

    def _start(self, transport_cls: Any, chunks: list, converter: Any, hf_config: Any, trainer_group: Any,
               engine_clients: Optional[Sequence[EngineClient]]) -> None:
        """The start-up checks, then (once every rank of both jobs was admitted) the transport and sender."""
        config = self.config
        with failing_together("starting the trainer's weight sync", self._gather):
            converter = converter if converter is not None else build_converter(config, hf_config)
            self.stream = MegatronWeightStream(
                chunks, self.layout, converter,
                gather_budget_bytes=int(config.gather_budget_mb * MiB), group=trainer_group,
            )
            if self.stream.is_source:
                check_model_complete(all_stage_metadata(self.stream), converter)
        self.engines = self._engine_fleet(config, engine_clients, transport_cls.trainer_joins(self.layout))
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
        return config.replace(transport=choice.transport, bucket_size_mb=choice.bucket_size_mb)

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
                            expects=expectations(self.config, trainer_stages=self.layout.pp, backend=backend),
                            model=model_fields(hf_config) if hf_config is not None else None,
                            session=roster[0]["session"])
        if hf_config is None:
            log.warning("no HF config (a converter was passed without hf_config=): the rendezvous cannot compare "
                        "the engines' model-defining config fields with the trainer's")
        where = (self.config.master_address, self.config.master_port)
        with failing_together("hosting the sync session", self._gather):
            if me == 0:
                self.session = SyncSession.host(*where, identity, timeout_s=self.config.timeout_s,
                                                members={"trainer": len(members),
                                                         "inference": self.config.num_inference_ranks})
                log.info("hosting weight-sync session %s at %s:%d (model digest %s)", self.session.id, *where,
                         model_digest(identity.model or {})[:12])
        with failing_together("joining the sync session", self._gather):
            if me is not None and me > 0:
                self.session = SyncSession.join(*where, identity, timeout_s=self.config.timeout_s)

    @property
    def is_leader(self) -> bool:
        """True on the rank that talks to the engines (the transport's rank 0)."""
        return self.transport is not None and self.transport.is_leader

    def sync(self) -> SyncMetrics:
        """Stream the current weights as the next version; return this rank's metrics.

        Returns only after every inference rank committed; raises on every
        trainer rank if any rank failed (the engines then keep the previous version).
        """
        version = self.version + 1
        started = time.perf_counter()
        if self.engines.driven:
            with failing_together(f"pausing the engines for version {version}", self._gather):
                self.engines.before_sync(version)
        if self.is_leader:
            self.engines.begin_transfer(version)
            self.transport.control.send(ControlMessage(ControlOp.SYNC, version))
        try:
            with failing_together(f"weight sync of version {version}", self._gather):
                try:
                    metrics = self.sender.sync(version)
                except SyncAbortedError as e:
                    raise self.engines.named(e, self.transport)
        except BaseException:
            self.engines.after_sync(version, ok=False)  # resumes them on the previous version; never raises
            raise
        if self.engines.driven:
            with failing_together(f"committing version {version} on the engines", self._gather):
                self.engines.after_sync(version, ok=True)
        self.version = version
        if self.auto_choice is not None and self.is_leader:
            log.info("version %d: synced in %.3f s measured; the scale model predicted %.3f s (transport auto: "
                     "%s, %g MiB buckets, profile %s)", version, time.perf_counter() - started,
                     self.auto_choice.predicted_s, self.auto_choice.transport, self.auto_choice.bucket_size_mb,
                     self.auto_choice.profile)
        return metrics

    def send_app_message(self, payload: dict) -> None:
        """Send an application message (JSON-serialisable) to every inference rank (leader only)."""
        assert self.is_leader, "only the leader talks to the engines"
        self.transport.control.send(ControlMessage(ControlOp.APP, self.version, payload))

    def receiver_metrics(self, version: int) -> list[SyncMetrics]:
        """Return the metrics each inference rank reported for `version` (leader only)."""
        reports = self.transport.control.collect(Report.METRICS, version, self.transport.inference_ranks)
        return [SyncMetrics.from_json(raw.decode()) for raw in reports.values()]

    def close(self, reason: Optional[str] = None) -> None:
        """Tell the engines to stop (leader), then release the transport and the session; safe to call twice.

        The engines exit 0 on the version they hold, printing `reason` (why the
        trainer stopped, when it did not simply finish). The leader hosts the
        rendezvous store, so it waits (up to `timeout_s`) until every engine
        rank has read "stop" before the store goes away.
        """
        self.engines.close()  # driven engines' workers acknowledge "stop" as they leave
        if self.transport is not None:
            if self.is_leader:
                try:
                    payload = {"reason": reason} if reason else {}
                    self.transport.control.send(ControlMessage(ControlOp.STOP, self.version, payload))
                    self.transport.control.collect(Report.STOPPED, self.version, self.transport.inference_ranks)
                except Exception:  # noqa: BLE001 — closing after a failure must not mask it
                    log.warning("the engines did not all acknowledge 'stop'", exc_info=True)
            self.transport.close()
            self.transport = None
        if self.session is not None:
            self.session.close()
            self.session = None


AppHandler = Callable[[ControlMessage], None]


class InferenceWeightSync:
    """The inference half on one inference rank: joins the transport and applies syncs.

    Commits go through a `GenerationServer` with the config's `inflight_policy`:
    a version arriving while the engine generates goes live at a step boundary
    all of the engine's ranks (`engine_group`) agree on, and requests in flight
    are aborted, recomputed or kept as the policy says.
    """

    def __init__(
        self,
        config: WeightSyncConfig,
        engine: EngineAdapter,
        *,
        num_trainer_stages: int,
        inference_rank: int,
        engine_group: Any = None,
        hf_config: Any = None,
        job_id: Optional[str] = None,
    ):
        if not 0 <= inference_rank < config.num_inference_ranks:
            raise ValueError(
                f"inference_rank={inference_rank} is outside num_inference_ranks={config.num_inference_ranks}"
            )
        self.config = config
        self.engine = engine
        self.stop_reason: Optional[str] = None  # why the trainer stopped the session, when it said
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
                            expects=expectations(config, trainer_stages=num_trainer_stages, backend=backend),
                            model=model_fields(hf_config) if hf_config is not None else None, session=config.run_id)
        meets_at_store = auto or transport_cls.meets_at_store  # auto chooses among transports that do
        if hf_config is None and meets_at_store:
            log.warning("[inference rank %d] no HF config given: the trainer cannot check that this engine's "
                        "model-defining config fields equal its own", inference_rank)
        self.session = (SyncSession.join(config.master_address, config.master_port, identity,
                                         timeout_s=config.timeout_s) if meets_at_store else None)
        try:
            if auto:
                from megatron_sync.scale.auto import adopt_host_choice

                config = self.config = adopt_host_choice(config, dict(self.session.host_identity.expects))
                transport_cls = get_transport(config.transport)
                log.info("transport auto: the trainer chose %s with %g MiB buckets", config.transport,
                         config.bucket_size_mb)
            if self.session is not None:
                self.session.wait_ready()
            self.transport = transport_cls.connect_inference(
                config, num_trainer_stages=num_trainer_stages, inference_rank=inference_rank, session=self.session)
            self.receiver = self.transport.make_receiver(engine, config, keep_together, commit=self.server.commit)
        except BaseException as e:
            if self.session is not None and not isinstance(e, RendezvousError):
                self.session.fail(f"{identity.describe()} failed while connecting: {type(e).__name__}: {e}")
            self.close()
            raise

    def next_control(self, timeout_s: float = IDLE_TIMEOUT_S) -> ControlMessage:
        """Wait for the trainer's next control message and return it.

        Raises TrainerGoneError when the trainer's rendezvous stops answering
        (it exited without "stop") or nothing comes within `timeout_s`; no sync
        is running then, and the engine holds its last committed version.
        """
        try:
            return self.transport.control.next(timeout_s)
        except PeerFailureError as e:
            gone = e.__cause__ is not None
            where = f"{self.config.master_address}:{self.config.master_port}"
            raise TrainerGoneError(
                (f"the trainer went away while this engine was idle: its rendezvous at {where} stopped answering "
                 "(it exited without 'stop')" if gone else
                 f"no message from the trainer within {timeout_s:g}s while this engine was idle")
                + f"; no sync was running, the engine holds version {self.engine.version}") from e

    def apply(self, version: int) -> Optional[SyncMetrics]:
        """Receive `version`; return metrics, or None if the sync was aborted on every rank.

        An aborted sync leaves the engine on its previous version and the
        transport ready for the next one; a dead peer raises PeerFailureError.
        """
        try:
            metrics = self.receiver.receive(version)
        except SyncAbortedError as e:
            log.error("[inference rank %d] %s", self.transport.rank, e)
            return None
        self.transport.control.report(Report.METRICS, version, self.transport.rank, metrics.to_json().encode())
        return metrics

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
            return False
        if message.op is ControlOp.SYNC:
            self.apply(message.version)
            return True
        name = message.payload.get("name")
        if name not in handlers:
            raise ValueError(f"application message {name!r} has no handler on this engine; "
                             f"handlers: {sorted(handlers)}")
        handlers[name](message)
        return True

    def close(self) -> None:
        """Finish a background receive, then release the transport and the session; safe to call twice."""
        self.server.close()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.session is not None:
            self.session.close()
            self.session = None
