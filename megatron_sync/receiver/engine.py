"""The interface an inference engine exposes to the receiver.

The receiver hands an engine full HF-checkpoint-format tensors one at a time
and asks it for *its own* slice (under the engine's own tensor parallelism);
it stages those slices and only calls `load_shards` once every rank of the
engine holds every tensor of the new version. Engines never see a partial
version.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from megatron_sync.meta import TensorMeta


@runtime_checkable
class EngineAdapter(Protocol):
    """What an engine rank implements so the receiver can update it."""

    def expected_tensors(self) -> list[TensorMeta]:
        """Return the full (unsharded) HF tensors this engine loads: names, shapes, dtypes."""

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Return this rank's slice of the full tensor `name` (a view or a copy; pure)."""

    def load_shards(self, shards: dict[str, torch.Tensor], version: int) -> None:
        """Make `shards` (one entry per expected tensor) the live weights, as `version`."""

    @property
    def version(self) -> int:
        """The version of the weights in use now (0 before the first sync)."""
