"""The two staging sets of one inference rank: flat buffers of its params that versions are received into.

A version is staged into the set the engine is not running from, so the other
set still holds the live version's params: that set is the rollback source when
a load fails on another rank, and no sync copies a snapshot. Both sets are one
allocation (what a one-sided transport registers once), made and zeroed at
start-up from the rank's layout (bytes no region lands in, such as vocabulary
padding rows, stay zero): 2 x this rank's params, held between syncs.

A set's params are handed to the engine as `HeldShards`: the receiver does not
write a set while the engine may run on it, so an engine whose memory matches
the layout runs on the set itself (the reference engine) and a commit switches
sets instead of copying; the engine then holds no weights of its own.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_sync.layout.rank import RankLayout


class HeldShards(dict):
    """A version's params (by param name) whose memory the receiver leaves untouched while they are live and
    until the next version is live: an engine may run on these tensors in place of its own (`load_shards`)."""


class StagingSets:
    """Two flat buffers laid out as `layout`'s params; `alloc(nbytes)` makes the one allocation."""

    def __init__(self, layout: RankLayout, alloc: Callable[[int], torch.Tensor]) -> None:
        self.layout = layout
        self.set_bytes = layout.nbytes
        self.memory = alloc(2 * self.set_bytes)
        self.memory.zero_()  # bytes no region lands in (padding rows) stay zero, as engines expect
        self._params = [HeldShards(layout.param_views(self.buffer(i))) for i in range(2)]
        self._versions: list[Optional[int]] = [None, None]
        self._live: Optional[int] = None  # the set whose contents the engine runs on

    @property
    def target(self) -> int:
        """Index of the set the next version is staged into."""
        return 0 if self._live is None else 1 - self._live

    def buffer(self, index: int) -> torch.Tensor:
        """Return set `index` as a flat uint8 view of the allocation."""
        return self.memory[index * self.set_bytes:(index + 1) * self.set_bytes]

    def begin(self) -> HeldShards:
        """Return the target set's params (views), now holding no complete version."""
        self._versions[self.target] = None
        return self._params[self.target]

    def write(self, name: str, full: torch.Tensor) -> int:
        """Copy this rank's regions of full HF tensor `name` into the target set; return bytes copied."""
        return self.layout.write(self.buffer(self.target), name, full)

    def params(self, index: Optional[int] = None) -> HeldShards:
        """Return set `index`'s params (default: the target set's) as typed views."""
        return self._params[self.target if index is None else index]

    def live_params(self, engine_version: int) -> Optional[HeldShards]:
        """Return the set the engine runs on, if it runs on the version we last committed."""
        if self._live is not None and self._versions[self._live] == engine_version:
            return self._params[self._live]
        return None

    def live_buffer(self, engine_version: int) -> Optional[torch.Tensor]:
        """Return the flat bytes of the set the engine runs on, if it runs on the version we last committed
        (what a fleet engine relays to another engine of the same layout)."""
        if self._live is not None and self._versions[self._live] == engine_version:
            return self.buffer(self._live)
        return None

    def committed(self, version: int) -> None:
        """The target set is now live as `version`."""
        target = self.target
        self._versions[target], self._live = version, target

    @property
    def nbytes(self) -> int:
        """Bytes held by both sets."""
        return 2 * self.set_bytes
