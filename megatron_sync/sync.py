"""The driver on both sides: set up once, then sync (trainer) or serve syncs (inference).

Trainer: `TrainerWeightSync` per trainer rank owns the HF weight stream and,
on each pipeline stage's source rank, the transport and the sender. Inference:
`InferenceWeightSync` per inference rank owns the receiver and follows the
trainer's control messages (sync version v, stop). Control messages go
through the rendezvous store, not collectives, so an engine can idle between
syncs for as long as training takes while a dead trainer is still noticed.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Optional

import torch

from megatron_sync.agreement import failing_together
from megatron_sync.config import WeightSyncConfig
from megatron_sync.meta import dtype_from_name
from megatron_sync.metrics import SyncMetrics
from megatron_sync.parallel import ParallelLayout
from megatron_sync.receiver.engine import EngineAdapter
from megatron_sync.receiver.receiver import WeightReceiver
from megatron_sync.sender import WeightSender
from megatron_sync.stream import MegatronWeightStream, all_stage_metadata, check_model_complete
from megatron_sync.transport.base import SyncAbortedError, init_transport_group
from megatron_sync.transport.broadcast import BroadcastTransport

log = logging.getLogger("megatron_sync")
MiB = 2**20


def build_converter(config: WeightSyncConfig, hf_config: Any = None) -> Any:
    """Return the converter for `config.family` and `config.dtype`.

    The HF config is `hf_config` when given (a transformers config or a dict),
    else the JSON file at `config.hf_config_path`.
    """
    from converters import get_converter

    if hf_config is None:
        if config.hf_config_path is None:
            raise ValueError(
                "no HF config for the inference model: set weight_sync.hf_config_path to its config.json "
                "or pass hf_config= (the shapes every converted tensor is checked against)"
            )
        with open(config.hf_config_path) as f:
            hf_config = json.load(f)
    return get_converter(config.family, hf_config, dtype=dtype_from_name(config.dtype))


def _transport(config: WeightSyncConfig, num_stages: int, rank: int) -> BroadcastTransport:
    backend = config.resolved_backend(torch.cuda.is_available())
    world = num_stages + config.num_inference_ranks
    group = init_transport_group(
        config.master_address, config.master_port, world, rank,
        backend=backend, timeout=config.timeout_s, group_name="megatron_sync",
    )
    return BroadcastTransport(group, num_stages)


class TrainerWeightSync:
    """The trainer half. Construct and call `sync()` on every trainer rank (both are collective).

    Start-up checks, before any weight moves: every Megatron parameter has a
    conversion rule, the stages together produce exactly the HF checkpoint the
    converter expects, and every rank of the transport group computed the same
    plan. Any failure is raised on every trainer rank.
    """

    def __init__(
        self,
        config: WeightSyncConfig,
        chunks: list[torch.nn.Module],
        converter: Any = None,
        layout: Optional[ParallelLayout] = None,
        *,
        trainer_group: Any = None,
    ):
        if not config.enabled:
            raise ValueError("weight_sync.enabled is false; build no TrainerWeightSync (WeightSyncCallback.from_config skips it)")
        converter = converter if converter is not None else build_converter(config)
        self.config = config
        self.layout = layout or ParallelLayout.from_megatron()
        self.trainer_group = trainer_group
        self.version = 0
        self.transport: Optional[BroadcastTransport] = None
        self.stream = MegatronWeightStream(
            chunks, self.layout, converter,
            gather_budget_bytes=int(config.gather_budget_mb * MiB), group=trainer_group,
        )
        with failing_together("checking that the stages produce a complete HF checkpoint", trainer_group):
            if self.stream.is_source:
                check_model_complete(all_stage_metadata(self.stream), converter)
        with failing_together("connecting to the inference ranks", trainer_group):
            if self.stream.is_source:
                self.transport = _transport(config, self.layout.pp, rank=self.stream.stage)
            self.sender = WeightSender.connect(
                self.stream, self.transport, bucket_size_bytes=config.bucket_size_bytes,
                metrics_path=config.metrics_path,
            )

    @property
    def is_leader(self) -> bool:
        """True on the rank that talks to the engines (stage 0's source)."""
        return self.transport is not None and self.transport.rank == 0

    def sync(self) -> SyncMetrics:
        """Stream the current weights as the next version; return this rank's metrics.

        Returns only after every inference rank committed; raises on every
        trainer rank if any rank failed (the engines then keep the previous version).
        """
        version = self.version + 1
        if self.is_leader:
            self.post_control({"op": "sync", "version": version})
        with failing_together(f"weight sync of version {version}", self.trainer_group):
            metrics = self.sender.sync(version)
        self.version = version
        return metrics

    def post_control(self, message: dict) -> None:
        """Send a control message to every inference rank (leader only); numbered in order."""
        assert self.is_leader, "only stage 0's source rank talks to the engines"
        self._sequence = getattr(self, "_sequence", 0) + 1
        self.transport.group.post(f"control/{self._sequence}", json.dumps(message).encode())

    def receiver_metrics(self, version: int) -> list[SyncMetrics]:
        """Return the metrics each inference rank posted for `version` (leader only)."""
        group = self.transport.group
        first = group.rank + self.layout.pp
        return [
            SyncMetrics.from_json(group.fetch(f"metrics/{version}/{rank}").decode())
            for rank in range(first, group.world_size)
        ]

    def close(self) -> None:
        """Tell the engines to stop (leader) and release the transport group.

        The leader hosts the rendezvous store, so it waits (up to `timeout_s`)
        until every engine rank has read "stop" before the store goes away.
        """
        if self.transport is not None:
            if self.is_leader:
                try:
                    self.post_control({"op": "stop"})
                    group = self.transport.group
                    for rank in range(self.layout.pp, group.world_size):
                        group.fetch(f"stopped/{rank}")
                except Exception:  # noqa: BLE001 — closing after a failure must not mask it
                    log.warning("the engines did not all acknowledge 'stop'", exc_info=True)
            self.transport.close()
            self.transport = None


class InferenceWeightSync:
    """The inference half on one inference rank: joins the transport group and applies syncs."""

    def __init__(
        self,
        config: WeightSyncConfig,
        engine: EngineAdapter,
        *,
        num_trainer_stages: int,
        inference_rank: int,
        engine_group: Any = None,
        commit: Optional[Callable[[dict, int], None]] = None,
    ):
        if not 0 <= inference_rank < config.num_inference_ranks:
            raise ValueError(
                f"inference_rank={inference_rank} is outside num_inference_ranks={config.num_inference_ranks}"
            )
        self.config = config
        self.engine = engine
        self.transport = _transport(config, num_trainer_stages, rank=num_trainer_stages + inference_rank)
        receiver_kwargs = {"commit": commit} if commit is not None else {}
        self.receiver = WeightReceiver(
            engine, self.transport, engine_group, bucket_size_bytes=config.bucket_size_bytes,
            metrics_path=config.metrics_path, **receiver_kwargs,
        )
        self._sequence = 0

    def next_control(self, idle_timeout_s: float = 24 * 3600) -> dict:
        """Wait for the trainer's next control message and return it."""
        self._sequence += 1
        raw = self.transport.group.fetch(f"control/{self._sequence}", timeout_s=idle_timeout_s)
        return json.loads(raw.decode())

    def apply(self, version: int) -> Optional[SyncMetrics]:
        """Receive `version`; return metrics, or None if the sync was aborted on every rank.

        An aborted sync leaves the engine on its previous version and the group
        ready for the next one; a dead peer raises PeerFailureError.
        """
        try:
            metrics = self.receiver.receive(version)
        except SyncAbortedError as e:
            log.error("[inference rank %d] %s", self.transport.rank, e)
            return None
        self.transport.group.post(f"metrics/{version}/{self.transport.rank}", metrics.to_json().encode())
        return metrics

    def serve(self, handlers: Optional[dict[str, Callable[[dict], None]]] = None) -> None:
        """Follow control messages until "stop": apply each sync, call `handlers[op]` for others."""
        handlers = handlers or {}
        while True:
            message = self.next_control()
            op = message["op"]
            if op == "stop":
                self.transport.group.post(f"stopped/{self.transport.rank}", b"1")
                return
            if op == "sync":
                self.apply(message["version"])
            elif op in handlers:
                handlers[op](message)
            else:
                raise ValueError(f"unknown control message {message!r}; this engine handles {['sync', 'stop', *handlers]}")

    def close(self) -> None:
        self.transport.close()
