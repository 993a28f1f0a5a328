"""The one public stream of inference-format weights that every transport consumes.

(Interface first; the implementation over Megatron model chunks follows in this module.)
"""

from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable

import torch

from megatron_sync.meta import TensorMeta


@runtime_checkable
class HFWeightStream(Protocol):
    """HF-format tensors of one pipeline stage, produced by gathering and converting.

    Iterating is collective: every trainer rank of the stage iterates it in
    lockstep (the gathers are collectives), and only the stage's source rank
    receives tensors. `metadata()` lists, on the source rank, exactly what
    iteration yields, in the same order, without moving any data.
    """

    @property
    def is_source(self) -> bool:
        """True on the rank that yields this stage's tensors (the stage's first rank)."""

    @property
    def stage(self) -> int:
        """The pipeline stage (PP rank) this stream belongs to."""

    def metadata(self) -> list[TensorMeta]:
        """Return the stage's HF tensors in yield order (empty on non-source ranks)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, tensor) on the source rank; participate in gathers elsewhere."""
