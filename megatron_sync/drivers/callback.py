"""The hook a Megatron training loop calls after each optimizer step."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any, Optional, Protocol

import torch

from megatron_sync.engines.handoff import TrainerMemory
from megatron_sync.core.lifecycle import stop_on_signals
from megatron_sync.core.writers import log_sync
from megatron_sync.drivers.sync import TrainerWeightSync

log = logging.getLogger("megatron_sync")

STOP_GRACE_S = 10.0
"""After SIGTERM / SIGINT, how long a trainer rank may take to leave the `with` block (its sync abandoned,
the engines told) before the watchdog tells the engines itself and exits the process: a rank blocked in
a collective is never left for its launcher to kill (torchrun waits 30 s)."""


class Syncer(Protocol):
    def sync(self) -> Any:
        """Stream the current weights as the next version; return that sync's metrics."""

    def close(self, reason: Optional[str] = None) -> None:
        """Tell the engines to stop (saying `reason` when the trainer did not simply finish) and release
        the transport."""


def ensure_params_gathered(chunks: list[torch.nn.Module]) -> None:
    """Finish Megatron's distributed-optimizer parameter all-gather before weights are read.

    With `overlap_param_gather`, `optimizer.step()` leaves each DP rank holding
    only its updated shard; the all-gather normally runs hidden inside the next
    forward. Reading weights before that would send stale values, so force a
    synchronous all-gather on every DDP-wrapped chunk that uses one.
    """
    for chunk in chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not getattr(ddp_config, "use_distributed_optimizer", False):
            continue
        if getattr(ddp_config, "overlap_param_gather", False):
            chunk.start_param_sync(force_sync=True)


class WeightSyncCallback:
    """Syncs weights to the inference engines after every N-th optimizer update.

    N counts successful optimizer updates (`optimizer.step()` calls that
    changed the weights), not rollout iterations or microbatches: an RL loop
    that takes 4 optimizer steps per rollout batch and wants fresh weights
    once per rollout sets N=4. Call `after_optimizer_step` on every trainer
    rank, right after the optimizer step (Megatron: after `train_step`
    returns with `update_successful`); it is collective when it syncs.

    Use it as a context manager (or call `close()` after the loop): leaving
    the block tells the engines to stop, and they exit 0 on the version they
    hold. Inside the block SIGTERM and SIGINT raise `lifecycle.Terminated` in
    the main thread (unless the application installed its own handlers), so a
    trainer stopped by its launcher still tells the engines why it stopped; a
    sync under way is abandoned (the engines keep the previous version), and a
    rank still blocked `STOP_GRACE_S` after the signal is ended by a watchdog
    that first tells the engines.
    """

    def __init__(self, syncer: Syncer | None, chunks: list[torch.nn.Module], *, every_n_steps: int = 1,
                 memory: Optional[TrainerMemory] = None, writer: Any = None):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.syncer = syncer
        self.chunks = chunks
        self.every_n_steps = every_n_steps
        self.memory = memory  # what this trainer rank releases while the engines generate (colocated jobs)
        self.writer = writer  # where each sync's figures go on this rank (TensorBoard, W&B; `core.writers`)
        self.updates = 0
        self.initial_metrics: Any = None  # the start-up sync's metrics (weight_sync.sync_on_start)
        self.handoff_rows: list[Any] = []  # the rows of the last handoff step (megatron_sync.engines.handoff)
        self._training = False  # to_training() handed the memory to training; the next update hands it back
        self._signals = ExitStack()

    @classmethod
    def from_config(cls, config: Any, chunks: list[torch.nn.Module], **sync_kwargs) -> "WeightSyncCallback":
        """Return the callback a training config asks for (collective when sync is enabled).

        With `enabled: false` nothing is connected and the callback only counts updates.
        With `sync_on_start: true` the current weights are synced once before this returns
        (version 1; its metrics in `initial_metrics`). `writer` (TensorBoard's, a W&B run: `core.writers`) gets
        each sync's figures on this rank; `memory` is what this rank hands over (colocated). The other
        `sync_kwargs` go to `TrainerWeightSync`
        (converter or hf_config, layout, trainer_group, engine_clients, keep_sent).
        """
        memory, writer = sync_kwargs.pop("memory", None), sync_kwargs.pop("writer", None)
        syncer = TrainerWeightSync(config, chunks, **sync_kwargs) if config.enabled else None
        callback = cls(syncer, chunks, every_n_steps=config.every_n_steps, memory=memory, writer=writer)
        if config.enabled and config.sync_on_start:
            try:
                callback.initial_metrics = callback.sync_now()
            except BaseException as e:
                callback.close(reason=f"the trainer's start-up sync failed: {type(e).__name__}")
                raise
        return callback

    def after_optimizer_step(self, update_successful: bool = True) -> Any:
        """Count one optimizer update and sync when it is the N-th; return metrics or None.

        Skipped updates (loss-scale overflow: `update_successful=False`) leave
        the weights unchanged and are not counted.
        """
        handing_back, self._training = self._training, False
        if handing_back and self.memory is not None:  # first this rank's memory goes, then the engines take theirs
            self.handoff_rows = [self.memory.release(self._version())]
        if update_successful:
            self.updates += 1
        if not update_successful or self.updates % self.every_n_steps:
            if handing_back and self.syncer is not None:
                self.handoff_rows += self.syncer.restore_engines()  # no sync now: they reload what they hold
            return None
        metrics = self.sync_now()  # a released engine takes its memory back as the sync begins
        if handing_back and self.syncer is not None:
            self.handoff_rows += self.syncer.handoff_rows
        return metrics

    def to_training(self) -> list[Any]:
        """Hand the memory to training (colocated jobs, `megatron_sync.engines.handoff`); return the steps' rows.

        Every engine rank frees its live weights and all have done so when this returns; then this rank
        takes back what `memory` released. Call it before each training step; the next
        `after_optimizer_step` hands the memory back (this rank's first, then the engines take theirs
        as the sync begins). Collective on every trainer rank.
        """
        rows = self.syncer.release_engines() if self.syncer is not None else []
        if self.memory is not None:
            rows.append(self.memory.restore(self._version()))
        self._training = True
        self.handoff_rows = rows
        return rows

    def _version(self) -> int:
        return getattr(self.syncer, "version", 0)

    def sync_now(self) -> Any:
        """Sync the current weights at once (e.g. the initial weights before training); return metrics
        or None when sync is disabled. Collective on every trainer rank."""
        if self.syncer is None:
            return None
        ensure_params_gathered(self.chunks)
        metrics = self.syncer.sync()
        if self.writer is not None:
            log_sync(self.writer, metrics)
        return metrics

    def close(self, reason: Optional[str] = None) -> None:
        """Tell the engines to stop and release the transport (call once training ends); safe to call twice.

        The engines exit 0 on the version they hold and print `reason` when given.
        """
        try:
            if self.syncer is not None:
                syncer, self.syncer = self.syncer, None
                syncer.close(reason)
        finally:
            self._signals.close()

    def __enter__(self) -> "WeightSyncCallback":
        self._signals.enter_context(stop_on_signals(grace_s=STOP_GRACE_S, report=self._stopped_while_blocked))
        return self

    def _stopped_while_blocked(self, what: str) -> None:
        """The watchdog's report (its own thread; the process exits right after): tell the engines."""
        log.error("stopped by %s; telling the engines to stop", what)
        if self.syncer is not None:
            self.syncer.close(f"the trainer stopped by {what}")

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(None if exc is None else f"the trainer stopped on {type(exc).__name__}: {exc}")
