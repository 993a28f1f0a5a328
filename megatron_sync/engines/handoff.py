"""The memory handoff of colocated jobs: each side releases what it does not need while the other runs.

A colocated RL loop takes turns on the same devices: generate, train, hand the
weights over, generate. Around a sync the memory changes hands, as explicit,
timed steps (each a `SyncMetrics` row of role "engine-handoff", ranked by
transport rank like the receivers' rows, or "trainer-handoff", ranked by
trainer rank; phase "release" or "restore", `bytes` the bytes freed or taken
back, `held_bytes` what stayed; appended to `metrics_path`):

- to training (`TrainerWeightSync.release_engines`, then the trainer's
  `TrainerMemory.restore`): every engine rank frees its live weights
  (`ReleasesMemory`; the receiver's live staging set still holds the version,
  so nothing is lost), and only once all did the trainer takes back its
  gradient buffers and optimizer state;
- to generation (`TrainerMemory.release`, then the next sync or
  `TrainerWeightSync.restore_engines`): the trainer frees its gradient buffers
  (and moves its optimizer state to the host, where it lived on a GPU), then
  each engine rank allocates its live weights again. A sync fills them, so the
  restore at a sync costs an allocation and no copy; only when the version is
  not committed (a failed sync) or no sync comes is the live version copied
  back from the staging set.

`WeightSyncCallback(..., memory=TrainerMemory(model, optimizer))` runs both:
`to_training()` before a training step, and `after_optimizer_step()` hands the
memory back before it syncs.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, runtime_checkable

import torch

from megatron_sync.core.metrics import SyncMetrics

ENGINE_ROLE, TRAINER_ROLE = "engine-handoff", "trainer-handoff"


@runtime_checkable
class ReleasesMemory(Protocol):
    """An engine rank that can free its live weights while the trainer trains (the reference engine)."""

    def release_memory(self) -> int:
        """Free the live weights' memory; return the bytes freed."""

    def restore_memory(self) -> int:
        """Allocate the live weights again (values undefined until the next load); return the bytes."""


def handoff_row(role: str, version: int, rank: int, phase: str, seconds: float, nbytes: int,
                kept: int = 0) -> SyncMetrics:
    """Return the metrics row of one handoff step: `phase` ("release" / "restore") took `seconds` and
    moved `nbytes` of memory; `kept` bytes stayed where they were."""
    row = SyncMetrics(version, role=role, rank=rank, bytes=nbytes, held_bytes=kept)
    row.add(phase, seconds)
    row.add("total", seconds)
    return row


class EngineHandoff:
    """One inference rank's part (`rank`: its transport rank): release on the trainer's word, restore at
    the next sync or on its word.

    `live_shards(version)` returns the receiver's copy of the live version's params (None when it holds
    none: before the first sync the engine runs on its checkpoint, and cannot be released).
    """

    def __init__(self, engine: Any, rank: int, live_shards: Callable[[int], Optional[Mapping[str, torch.Tensor]]],
                 metrics_path: Optional[str] = None) -> None:
        self.engine, self.rank, self.live_shards, self.metrics_path = engine, rank, live_shards, metrics_path
        self.released = False
        self.handoff = 0  # the number of the trainer's handoff that released the engine last

    def release(self, handoff: int) -> SyncMetrics:
        """Free the engine's live weights for the trainer's `handoff`-th turn; return the step's row.
        ValueError (naming the fix) when it cannot."""
        if not isinstance(self.engine, ReleasesMemory):
            raise ValueError(f"{type(self.engine).__name__} cannot release its memory (it has no release_memory / "
                             "restore_memory); drop the trainer's to_training() call or use an engine that can")
        version = self.engine.version
        if self.released:
            return self._row(version, "release", 0.0, 0)
        if self.live_shards(version) is None:
            raise ValueError(f"inference rank {self.rank} holds no copy of version {version} to restore its weights "
                             "from (none before the first sync): release the engines only after a sync")
        start = time.perf_counter()
        freed = self.engine.release_memory()
        self.released, self.handoff = True, handoff
        return self._row(version, "release", time.perf_counter() - start, freed)

    def restore(self) -> SyncMetrics:
        """Allocate the live weights and copy the live version back into them (no sync came); return the row."""
        version = self.engine.version
        if not self.released:
            return self._row(version, "restore", 0.0, 0)
        start = time.perf_counter()
        taken = self.engine.restore_memory()
        self.released = False
        self._reload(version)
        return self._row(version, "restore", time.perf_counter() - start, taken)

    @contextmanager
    def around_sync(self, version: int, report: Callable[[SyncMetrics], None]) -> Iterator[None]:
        """Restore a released engine for the sync of `version` (allocation only: the sync writes every live
        weight); if the version is not committed, copy the previous one back. Reports the step's row."""
        if not self.released:
            yield
            return
        previous = self.engine.version
        start = time.perf_counter()
        taken = self.engine.restore_memory()
        self.released = False
        seconds = time.perf_counter() - start
        try:
            yield
        finally:
            if self.engine.version != version:
                start = time.perf_counter()
                self._reload(previous)
                seconds += time.perf_counter() - start
            report(self._row(version, "restore", seconds, taken))

    def _reload(self, version: int) -> None:
        live = self.live_shards(version)
        assert live is not None, f"the live staging set of version {version} is gone"
        self.engine.load_shards(live, version)  # the receiver's set as it is: an engine may run on it again

    def _row(self, version: int, phase: str, seconds: float, nbytes: int) -> SyncMetrics:
        row = handoff_row(ENGINE_ROLE, version, self.rank, phase, seconds, nbytes)
        row.append_to(self.metrics_path)
        return row


class TrainerMemory:
    """What one trainer rank gives the engines while they generate: Megatron DDP gradient buffers and
    the optimizer's state.

    Gradients are freed (`DistributedDataParallel.offload_grad_buffers`; restored zeroed, as the next
    step needs them). Optimizer state moves to host memory when it lives on a GPU (Megatron's optimizer:
    its own `offload_to_cpu`; a torch optimizer: its state tensors); on a CPU-only trainer there is no
    other memory to move it to, so it stays, and the rows say how many bytes were kept.
    """

    def __init__(self, chunks: list[torch.nn.Module], optimizer: Any = None, *, gradients: bool = True,
                 optimizer_state: bool = True, rank: int = -1, metrics_path: Optional[str] = None) -> None:
        self.chunks, self.optimizer = chunks, optimizer
        self.gradients, self.optimizer_state = gradients, optimizer_state
        self.rank, self.metrics_path = rank, metrics_path
        self.released = False
        self._on_device: dict[tuple[int, str], torch.device] = {}  # (id(state), key) -> device, while on the host
        self._megatron_moved = 0  # bytes Megatron's optimizer moved to the host

    def release(self, version: int) -> SyncMetrics:
        """Free the gradient buffers and move device optimizer state to the host; return the step's row."""
        if self.released:
            return self._row(version, "release", 0.0, 0)
        start = time.perf_counter()
        freed = self._grad_bytes() if self.gradients else 0
        cuda = torch.cuda.is_available()
        if self.gradients:
            for chunk in self._ddp_chunks():
                chunk.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)
        if self.optimizer_state:
            freed += self._move_state(to_host=True)
        self.released = True
        return self._row(version, "release", time.perf_counter() - start, freed)

    def restore(self, version: int) -> SyncMetrics:
        """Allocate the gradient buffers again (zeroed) and bring the optimizer state back; return the row."""
        if not self.released:
            return self._row(version, "restore", 0.0, 0)
        start = time.perf_counter()
        if self.gradients:
            for chunk in self._ddp_chunks():
                chunk.restore_grad_buffers(synchronize=torch.cuda.is_available())
        taken = self._grad_bytes() if self.gradients else 0
        if self.optimizer_state:
            taken += self._move_state(to_host=False)
        self.released = False
        return self._row(version, "restore", time.perf_counter() - start, taken)

    def _ddp_chunks(self) -> list[Any]:
        return [chunk for chunk in self.chunks if hasattr(chunk, "offload_grad_buffers")]

    def _grad_bytes(self) -> int:
        return sum(buffer.grad_data.untyped_storage().nbytes() for chunk in self._ddp_chunks()
                   for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers] if buffer.grad_data is not None)

    def _state_tensors(self) -> list[tuple[dict, str, torch.Tensor]]:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # Megatron wraps a torch optimizer
        if inner is None:
            return []
        return [(state, key, value) for state in inner.state.values() for key, value in state.items()
                if isinstance(value, torch.Tensor) and value.dim() > 0]

    def _move_state(self, *, to_host: bool) -> int:
        """Move device optimizer state to the host (or back); return the bytes moved."""
        if hasattr(self.optimizer, "offload_to_cpu"):  # Megatron's optimizer moves its state and main params
            if to_host:
                self._megatron_moved = self._megatron_device_bytes()
                self.optimizer.offload_to_cpu()
                return self._megatron_moved
            self.optimizer.restore_from_cpu()
            moved, self._megatron_moved = self._megatron_moved, 0
            return moved
        moved = 0
        for state, key, value in self._state_tensors():
            if to_host and value.is_cuda:
                self._on_device[id(state), key] = value.device
                state[key] = value.to("cpu")
                moved += value.nbytes
            elif not to_host and (id(state), key) in self._on_device:
                state[key] = value.to(self._on_device.pop((id(state), key)))
                moved += value.nbytes
        if to_host and moved:
            torch.cuda.empty_cache()
        return moved

    def _megatron_device_bytes(self) -> int:
        inner = self.optimizer.optimizer
        params = [p for group in inner.param_groups for p in group["params"] if isinstance(p, torch.Tensor)]
        return (sum(p.nbytes for p in params if p.is_cuda)
                + sum(v.nbytes for _, _, v in self._state_tensors() if v.is_cuda))

    def _kept(self) -> int:
        """Bytes of optimizer state that stay in this rank's memory (device or host) while the engines generate."""
        if self.released and self.optimizer_state:
            return sum(v.nbytes for state, key, v in self._state_tensors()
                       if (id(state), key) not in self._on_device and not v.is_cuda and not self._megatron_moved)
        return sum(v.nbytes for _, _, v in self._state_tensors())

    def _row(self, version: int, phase: str, seconds: float, nbytes: int) -> SyncMetrics:
        row = handoff_row(TRAINER_ROLE, version, self.rank, phase, seconds, nbytes,
                          self._kept() if phase == "release" else 0)
        row.append_to(self.metrics_path)
        return row
