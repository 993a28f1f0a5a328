"""The vLLM worker side of backend "megatron_sync": a `WeightTransferEngine` that joins the transport group.

vLLM builds one per worker (`Worker.load_model`) when it is started with
--weight-transfer-config '{"backend": "megatron_sync"}' and this package's
plugin registered the name. The trainer drives it through vLLM's own routes:

- /init_weight_transfer_engine {init_info: JoinInfo}: join the transport group
  as inference rank first_inference_rank + worker rank (through the same
  `InferenceWeightSync` and transport connect as any inference rank), run the
  plan handshake (the plan must cover exactly the served model's HF
  checkpoint tensors).
- /start_weight_update: open a session (nothing is touched yet).
- /update_weights {update_info: {version}}: the project's receiver receives
  every bucket, verifies its CRC-32, stages the tensors, and only after every
  transport rank agreed they are intact loads them through vLLM's layerwise
  reload (`VLLMModelAdapter`); every rank then agrees the load succeeded, and
  a rank that loaded a version another rank failed reloads the previous one.
- /finish_weight_update: closes the session (the trainer adds the version tag
  only when every rank committed; a session closed without an update, or
  after a failed one, leaves the weights as they are).

A server running a speculative MTP draft. vLLM points this engine at its draft
model for a draft session (/start_draft_weight_update); one before
/init_weight_transfer_engine hands the draft over (`attach_draft`), so its
params are part of the worker's layout. Then each version spans two vLLM
sessions and one agreed commit: the target session's /update_weights receives
and stages the whole version and loads the target's params, and returns while
the version waits (`DraftPhase`); the draft session's /update_weights loads
the draft's params and finishes the version (its second agreement round, the
commit). A failure in either part, or a draft session that does not come
within timeout_s, restores target and draft to the previous version.

Errors and vLLM's RPCs. vLLM 0.32's multiprocess executor stops reading the
other workers' replies at the first failed one, so with more than one worker
an error raised out of an RPC would surface again as the answer to the next,
unrelated RPC (and every reply after it would be off by one). So an agreed
failure (`SyncError`) is never raised: the trainer already has it, naming the
failing ranks, from the same agreement; the worker logs it and the session
closes normally with the previous weights in place. Any other error is raised
only by an engine of one worker (the trainer's request then fails with it);
with more, it is logged and the trainer learns of it from the transport (the
plan handshake's agreement, or the missing rank at the rendezvous).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import Any, Optional

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from megatron_sync.engines.vllm.adapter import VLLMModelAdapter
from megatron_sync.engines.vllm.wire import JoinInfo, UpdateInfo
from megatron_sync.core.errors import PeerFailureError, SyncError
from megatron_sync.core.meta import dtype_from_name
from megatron_sync.drivers.sync import InferenceWeightSync
from megatron_sync.transports import get_transport
from megatron_sync.session.control import Report
from megatron_sync.session.rendezvous import Identity
from megatron_sync.session.secret import SessionSecret
from megatron_sync.session.session import report_failure

log = logging.getLogger("megatron_sync")


class MegatronSyncTransferEngine(WeightTransferEngine[JoinInfo, UpdateInfo]):
    """Receives megatron-sync buckets into one vLLM worker and loads them all-or-nothing."""

    init_info_cls = JoinInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = True  # an MTP draft's params are part of every version (module doc)

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        parallel = vllm_config.parallel_config
        self.worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        label = f"vLLM worker {self.worker_rank} (pid {os.getpid()})"
        self.adapter = VLLMModelAdapter(model, vllm_config, worker_rank=self.worker_rank, label=label)
        self.single_worker = parallel.world_size == 1  # an RPC may raise (module doc)
        self._sync: Optional[InferenceWeightSync] = None
        self._session: Optional[int] = None  # 0 once started, the version once update_weights ran
        self._failure: Optional[Exception] = None  # the failure of the open session
        self._drafting = False  # vLLM's open session is a draft session
        self._phase: Optional[DraftPhase] = None  # a version loading with a draft, between its two sessions

    def init_transfer_engine(self, init_info: JoinInfo) -> None:
        """Join the transport group as inference rank `first_inference_rank + worker rank`; agree on the plan."""
        if self._sync is not None:
            self.shutdown()  # a new trainer: leave the old group first
        try:
            config = init_info.config()
            try:
                self.adapter.configure(config.family, dtype_from_name(config.dtype), draft=config.draft == "sync")
            except Exception as e:  # noqa: BLE001 — told to the trainer's rendezvous, which waits for this rank
                self._report_start_failure(init_info, config, e)
                raise
            self._sync = InferenceWeightSync(config, self.adapter, num_trainer_stages=init_info.num_trainer_stages,
                                             inference_rank=init_info.first_inference_rank + self.worker_rank,
                                             job_id=init_info.job_id or None, driven=True,
                                             hf_config=self.vllm_config.model_config.hf_config)
        except Exception as e:  # noqa: BLE001 — see the module doc
            self._leave_group()
            self._refuse("/init_weight_transfer_engine", e)
            return
        log.info("%s joined the transport group as rank %d", self.adapter.label, self._sync.transport.rank)

    def start_weight_update(self) -> None:
        """Open an update session; the weights are only touched once the whole version arrived. A draft
        session (vLLM targets its draft model) hands the draft over before joining, else opens the draft's
        part of the version under way."""
        self._drafting = self.model is not self.adapter.model
        if self._drafting:
            self.adapter.attach_draft(self.model, self.model_config)  # the same draft again: nothing changes
        if self._drafting and self._sync is None:
            return
        if self._require_joined("/start_weight_update") is not None and not self._drafting:
            self._session, self._failure = 0, None

    def receive_weights(self, update_info: UpdateInfo) -> None:
        """Receive, verify and (if every rank agrees) load `update_info.version` (with a draft: its target's
        part in the target session, its draft's part in the draft session)."""
        sync = self._require_joined("/update_weights")
        if sync is None:
            return
        if self._drafting:
            self._finish_phase(update_info.version)
            return
        if self._session is None:
            self._refuse("/update_weights", RuntimeError("it came before /start_weight_update"))
            return
        if self.adapter.draft is not None:
            self._phase = DraftPhase(self.adapter, sync, update_info.version, sync.config.timeout_s)
            self._phase.target_loaded_or_ended()
            return
        self._apply(sync, update_info.version)

    def _finish_phase(self, version: int) -> None:
        """Draft session: let the version under way load the draft and commit; take its outcome."""
        phase, self._phase = self._phase, None
        if phase is None or phase.version != version:
            log.info("%s: no version %d waits for its draft (it ended before: its outcome is known)",
                     self.adapter.label, version)
            return
        self._outcome(version, *phase.finish())

    def _apply(self, sync: InferenceWeightSync, version: int) -> None:
        try:
            metrics = sync.apply(version)  # reports metrics to the trainer's leader
        except Exception as e:  # noqa: BLE001 — see the module doc
            self._outcome(version, None, e)
            return
        self._outcome(version, metrics, None)

    def _outcome(self, version: int, metrics: Any, error: Optional[Exception]) -> None:
        """Record how applying `version` ended (module doc: which errors are raised)."""
        if error is not None:
            e = error
            self._failure = e
            if isinstance(e, PeerFailureError):
                self._leave_group()  # the group is unusable; the trainer must join again
            if isinstance(e, SyncError):  # agreed (or a dead peer): the previous weights are in place
                log.error("%s: version %d was not committed: %s", self.adapter.label, version, e)
            else:
                self._refuse("/update_weights", e)
            return
        if metrics is None:  # aborted on every rank (logged by apply); the previous weights are in place
            self._failure = SyncError(f"version {version} was aborted")
            return
        self._session = version

    def finish_weight_update(self) -> None:
        """Close the session. Never raises: the trainer knows the outcome from the agreement (module doc).
        The target session of a version that waits for its draft stays open until the draft session."""
        drafting, self._drafting = self._drafting, False
        if not drafting and self._phase is not None and self._phase.waiting():
            return
        if self._phase is not None:  # it ended before its draft session (an abort): take its outcome now
            phase, self._phase = self._phase, None
            self._outcome(phase.version, *phase.finish())
        session, failure = self._session, self._failure
        self._session, self._failure = None, None
        if failure is None and session and session != self.adapter.version:
            log.error("%s: session of version %s closed while the weights are at version %d",
                      self.adapter.label, session, self.adapter.version)

    def shutdown(self) -> None:
        """Leave the transport group, acknowledging "stop" for the version held; the weights stay as they are."""
        if self._sync is None:
            return
        transport = self._sync.transport
        try:
            version = self.adapter.version
            transport.control.report(Report.STOPPED, version, transport.rank, str(version).encode())
        except Exception as e:  # noqa: BLE001 — the trainer may already be gone
            log.info("%s: could not acknowledge stop: %s", self.adapter.label, e)
        self._leave_group()

    def _leave_group(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    def _require_joined(self, route: str) -> Optional[InferenceWeightSync]:
        if self._sync is None:
            self._refuse(route, RuntimeError("this worker has not joined a transport group "
                                             "(/init_weight_transfer_engine first, or it failed)"))
        return self._sync

    def _report_start_failure(self, init_info: JoinInfo, config: Any, error: Exception) -> None:
        """Post that this worker cannot join to the trainer's rendezvous, so the trainer fails at once naming
        it rather than after timeout_s waiting for the rank (transports that meet at the store)."""
        if not get_transport(config.transport).meets_at_store:
            return
        me = Identity(job=init_info.job_id, role="inference", member=init_info.first_inference_rank + self.worker_rank,
                      session=config.run_id)
        report_failure(config.master_address, config.master_port, me,
                       f"{self.adapter.label}: {type(error).__name__}: {error}", timeout_s=config.timeout_s,
                       secret=SessionSecret.from_environment())

    def _refuse(self, route: str, error: Exception) -> None:
        """Log `error` of `route`; raise it only when this engine has one worker (module doc)."""
        log.error("%s: %s failed: %s: %s", self.adapter.label, route, type(error).__name__, error)
        if self.single_worker:
            raise error


class DraftPhase:
    """One version applied with a draft: `sync.apply` runs on a thread of its own, and between the target's
    load and the draft's (`adapter.between_models`) it waits for vLLM's draft session (module doc)."""

    def __init__(self, adapter: VLLMModelAdapter, sync: InferenceWeightSync, version: int, timeout_s: float):
        self.adapter, self.version, self.timeout_s = adapter, version, timeout_s
        self._target_loaded, self._draft_session = threading.Event(), threading.Event()
        self._done: Future = Future()
        adapter.between_models = self._between
        threading.Thread(target=self._run, args=(sync,), name="megatron-sync-draft-phase", daemon=True).start()

    def _run(self, sync: InferenceWeightSync) -> None:
        try:
            self._done.set_result(sync.apply(self.version))
        except BaseException as e:  # noqa: BLE001 — handed to the session that takes the outcome
            self._done.set_exception(e)
        finally:
            self.adapter.between_models = None
            self._target_loaded.set()

    def _between(self, version: int) -> None:
        """The target holds `version`: tell the target session, wait for the draft session."""
        self._target_loaded.set()
        if not self._draft_session.wait(self.timeout_s):
            raise RuntimeError(f"vLLM's draft session for version {version} did not start within timeout_s="
                               f"{self.timeout_s:g}s after the target's (/start_draft_weight_update, then "
                               "/update_weights): the draft cannot get this version")

    def target_loaded_or_ended(self) -> None:
        """Return once the target holds the version (it waits for its draft) or the version ended."""
        self._target_loaded.wait(3 * self.timeout_s + 60)

    def waiting(self) -> bool:
        """True while the version waits for its draft session."""
        return not self._done.done()

    def finish(self) -> tuple[Any, Optional[Exception]]:
        """Open the draft's part and return the version's (metrics, error) once it ended."""
        self._draft_session.set()
        try:
            return self._done.result(3 * self.timeout_s + 60), None
        except Exception as e:  # noqa: BLE001 — the caller records it like any apply's outcome
            return None, e
