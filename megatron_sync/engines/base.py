"""What an inference engine exposes to the receiver, and what the trainer may drive around a sync.

The receiver hands an engine full HF-checkpoint-format tensors one at a time
and asks it for *its own* slice (under the engine's own tensor parallelism);
it stages those slices and only calls `load_shards` once every rank of the
engine holds every tensor of the new version. Engines never see a partial
version. `snapshot()` lets the receiver undo a load that succeeded here but
failed on another rank.

Engines driven through their own API (vLLM, SGLang) also get an
`EngineClient` on the trainer side: the trainer driver calls its hooks around
every sync (pause, open the engine's update session, resume).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

import torch

from megatron_sync.meta import TensorMeta

if TYPE_CHECKING:
    from megatron_sync.p2p.layout import EngineLayout


@runtime_checkable
class EngineAdapter(Protocol):
    """What an engine rank implements so the receiver can update it."""

    def expected_tensors(self) -> list[TensorMeta]:
        """Return the full (unsharded) HF tensors this engine loads: names, shapes, dtypes."""

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Return this rank's slice of the full tensor `name` (a view or a copy; pure)."""

    def load_shards(self, shards: dict[str, torch.Tensor], version: int) -> None:
        """Make `shards` (one entry per expected tensor) the live weights, as `version`."""

    def snapshot(self) -> Optional[dict[str, torch.Tensor]]:
        """Return copies of the live shards (what `load_shards` takes back to undo a load), or None
        when this engine cannot snapshot (a load that fails elsewhere then leaves this rank ahead)."""

    @property
    def version(self) -> int:
        """The version of the weights in use now (0 before the first sync)."""


@runtime_checkable
class LayoutEngine(EngineAdapter, Protocol):
    """An engine rank whose memory layout is known from metadata: what a P2P transport needs.

    Its layout says which region of every HF tensor each rank holds and where it lies
    in the rank's staging memory, so trainer ranks can write exactly those bytes there
    and the rank commits them with `load_shards(layout's shard views of the staging)`.
    """

    def memory_layout(self) -> "EngineLayout":
        """Return the layout of this engine (all its TP ranks): `megatron_sync.p2p.layout`'s classes."""


@runtime_checkable
class EngineClient(Protocol):
    """Trainer-side handle of an engine that is driven over its own API around each sync."""

    def before_sync(self, version: int) -> None:
        """Prepare the engine to receive `version` (pause per the in-flight policy, open an update)."""

    def after_sync(self, version: int, ok: bool) -> None:
        """Finish `version` (commit it and resume if `ok`, else leave the previous version serving)."""

    def close(self) -> None:
        """Release the client (the engine keeps serving)."""
