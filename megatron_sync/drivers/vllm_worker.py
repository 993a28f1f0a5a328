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
    supports_draft_weight_update = False

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
        """Open an update session; the weights are only touched once the whole version arrived."""
        if self._require_joined("/start_weight_update") is not None:
            self._session, self._failure = 0, None

    def receive_weights(self, update_info: UpdateInfo) -> None:
        """Receive, verify and (if every rank agrees) load `update_info.version`."""
        sync = self._require_joined("/update_weights")
        if sync is None:
            return
        if self._session is None:
            self._refuse("/update_weights", RuntimeError("it came before /start_weight_update"))
            return
        try:
            metrics = sync.apply(update_info.version)  # reports metrics to the trainer's leader
        except Exception as e:  # noqa: BLE001 — see the module doc
            self._failure = e
            if isinstance(e, PeerFailureError):
                self._leave_group()  # the group is unusable; the trainer must join again
            if isinstance(e, SyncError):  # agreed (or a dead peer): the previous weights are in place
                log.error("%s: version %d was not committed: %s", self.adapter.label, update_info.version, e)
            else:
                self._refuse("/update_weights", e)
            return
        if metrics is None:  # aborted on every rank (logged by apply); the previous weights are in place
            self._failure = SyncError(f"version {update_info.version} was aborted")
            return
        self._session = update_info.version

    def finish_weight_update(self) -> None:
        """Close the session. Never raises: the trainer knows the outcome from the agreement (module doc)."""
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
