"""Fault injection the demo's engine job and the test suite share: a rank that dies or hangs part-way through a version."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_sync.layout.rank import RankLayout


@dataclass(frozen=True)
class FaultyLayout(RankLayout):
    """A rank layout that calls `before_write(n)` before staging its n-th tensor (1-based), for fault
    injection: a receiver's process that dies or hangs part-way through a version."""

    before_write: Callable[[int], None] = lambda n: None
    writes: list = field(default_factory=lambda: [0])

    @classmethod
    def wrap(cls, layout: RankLayout, before_write: Callable[[int], None]) -> "FaultyLayout":
        return cls(layout.params, layout.placements, before_write=before_write)

    def write(self, staging: torch.Tensor, name: str, full: torch.Tensor) -> int:
        self.writes[0] += 1
        self.before_write(self.writes[0])
        return super().write(staging, name, full)
