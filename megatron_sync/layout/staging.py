"""The staging sets of one inference rank: flat buffers of its params that versions are received into.

Two sets (`staging_sets: 2`; what "auto", the default, means for an engine that may run on a set): a version
is staged into the set the engine is not running from, so the other set still holds the live version's params:
that set is the rollback source when a load fails on another rank, and no sync copies a snapshot. Both sets
are one allocation (what a one-sided transport registers once), made and zeroed at start-up from the rank's
layout (bytes no region lands in, such as vocabulary padding rows, stay zero): 2 x this rank's params, held
between syncs. A set's params are handed to the engine as `HeldShards`: the receiver does not write a set
while the engine may run on it, so an engine whose memory matches the layout runs on the set itself (the
reference engine) and a commit switches sets instead of copying; the engine then holds no weights of its own.

One set (`staging_sets: 1`; "auto" for engines that copy every shard into weights of their own, vLLM): each
version is staged into the same memory, so the engine rank holds its weights + 1 x its params instead of
+ 2 x. The rollback source is then a host copy of the live version (`HostCopy`), taken in the background
after each commit (on a GPU a side stream into pinned memory; a thread on the CPU) and waited for before
the set is written again: between syncs, not inside one. Its params are handed over as `StagedCopy`: the
engine copies them, and an engine that must undo its own load part-way finds the version before in
`StagedCopy.previous`.
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping, Optional

import torch

from megatron_sync.core.errors import SyncError
from megatron_sync.layout.rank import RankLayout

STAGING_SETS = ("auto", 1, 2)
AUTO = "auto"


def check_staging_sets(count: object) -> None:
    """Raise ValueError naming every choice unless `count` is "auto", 1 or 2 (`weight_sync.staging_sets`)."""
    if count not in STAGING_SETS or isinstance(count, bool):
        raise ValueError(f"staging_sets={count!r}: use \"auto\" (the default: 1 for an engine that copies every "
                         "version into weights of its own, 2 for one that may run on a set), 2 (the engine may run on "
                         "a set, and the other is the rollback source) or 1 (weights + one set, with a host copy of "
                         "the live version for rollback)")


def copies_shards(engine: object) -> bool:
    """Whether `engine` copies every version's shards into weights of its own (its `copies_shards`, default False:
    it may run on a staging set, as the reference engine does)."""
    return bool(getattr(engine, "copies_shards", False))


def resolve_staging_sets(setting: object, *, copies: bool) -> int:
    """Return the staging sets `setting` means for engines that copy (`copies`) or not: "auto" is 1 for the
    first, since a second set would only be a rollback source on the device, and 2 for the second, which run
    on the set a version arrived in; 1 and 2 are themselves."""
    check_staging_sets(setting)
    if setting == AUTO:
        return 1 if copies else 2
    return int(setting)  # type: ignore[call-overload]


class HeldShards(dict):
    """A version's params (by param name) whose memory the receiver leaves untouched while they are live and
    until the next version is live: an engine may run on these tensors in place of its own (`load_shards`)."""


class StagedCopy(dict):
    """A version's params in a receiver's only staging set: the next version is received into the same
    memory, so an engine copies them and keeps no reference. `previous`: the host copy of the version the
    engine ran before this load (None when there is none: the first sync), what an engine that must undo a
    load part-way loads back."""

    previous: Optional[Mapping[str, torch.Tensor]] = None


class HostCopy:
    """A host copy of one staging set's bytes as `version` (`staging_sets: 1`: the rollback source)."""

    def __init__(self, layout: RankLayout, nbytes: int, device: torch.device, timeout_s: float) -> None:
        self.memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.params = layout.param_views(self.memory)
        self.version: Optional[int] = None
        self.timeout_s = timeout_s
        self._pending: Optional[tuple[Callable[[], None], int]] = None

    def start(self, source: torch.Tensor, version: int) -> None:
        """Begin copying `source` (the set just made live as `version`) without waiting for it."""
        self.wait()
        self.version = None
        if source.is_cuda:
            stream = torch.cuda.Stream(source.device)
            stream.wait_stream(torch.cuda.current_stream(source.device))  # after the set's last writes
            with torch.cuda.stream(stream):
                self.memory.copy_(source, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            self._pending = (done.synchronize, version)
            return
        errors: list[BaseException] = []

        def copy() -> None:
            try:
                self.memory.copy_(source)
            except BaseException as e:  # noqa: BLE001 — raised by wait()
                errors.append(e)

        thread = threading.Thread(target=copy, name=f"megatron-sync host copy v{version}", daemon=True)
        thread.start()

        def join() -> None:
            thread.join(self.timeout_s)
            if thread.is_alive() or errors:
                raise SyncError(f"the host copy of version {version}'s staging set (the rollback source) "
                                f"{'failed: ' + repr(errors[0]) if errors else f'took over {self.timeout_s:g}s'}")
        self._pending = (join, version)

    def wait(self) -> None:
        """Wait for the copy in flight, if any; it then holds its version."""
        if self._pending is not None:
            join, version = self._pending
            self._pending = None
            join()
            self.version = version


class StagingSets:
    """`count` flat buffers laid out as `layout`'s params; `alloc(nbytes)` makes the one allocation. With one
    set, `keep` a host copy of the live version after each commit (`timeout_s`: the longest wait for it)."""

    def __init__(self, layout: RankLayout, alloc: Callable[[int], torch.Tensor], count: int = 2, *,
                 keep: bool = True, timeout_s: float = 600.0) -> None:
        if count not in (1, 2) or isinstance(count, bool):
            raise ValueError(f"StagingSets holds 1 or 2 sets, got {count!r} (resolve weight_sync.staging_sets "
                             "with resolve_staging_sets first)")
        self.layout, self.count = layout, count
        self.set_bytes = layout.nbytes
        self.memory = alloc(count * self.set_bytes)
        self.memory.zero_()  # bytes no region lands in (padding rows) stay zero, as engines expect
        kind = HeldShards if count == 2 else StagedCopy
        self._params = [kind(layout.param_views(self.buffer(i))) for i in range(count)]
        self._versions: list[Optional[int]] = [None] * count
        self._live: Optional[int] = None  # the set whose contents the engine runs on
        self.host = HostCopy(layout, self.set_bytes, self.memory.device, timeout_s) if count == 1 and keep else None

    @property
    def target(self) -> int:
        """Index of the set the next version is staged into."""
        return 0 if self._live is None or self.count == 1 else 1 - self._live

    def buffer(self, index: int) -> torch.Tensor:
        """Return set `index` as a flat uint8 view of the allocation."""
        return self.memory[index * self.set_bytes:(index + 1) * self.set_bytes]

    def begin(self) -> Mapping[str, torch.Tensor]:
        """Return the target set's params (views), now holding no complete version. With one set, first wait
        for the host copy of the live version: from here on it is the rollback source."""
        params = self._params[self.target]
        if self.host is not None:
            self.host.wait()
            params.previous = self.host.params if self.host.version is not None else None
        self._versions[self.target] = None
        return params

    def write(self, name: str, full: torch.Tensor) -> int:
        """Copy this rank's regions of full HF tensor `name` into the target set; return bytes copied."""
        return self.layout.write(self.buffer(self.target), name, full)

    def params(self, index: Optional[int] = None) -> Mapping[str, torch.Tensor]:
        """Return set `index`'s params (default: the target set's) as typed views."""
        return self._params[self.target if index is None else index]

    def live_params(self, engine_version: int) -> Optional[Mapping[str, torch.Tensor]]:
        """Return the params of `engine_version`, the version the engine runs, if this receiver committed it and
        still holds it: its set, or with one set being written, the host copy (plain tensors: copied)."""
        if self._live is not None and self._versions[self._live] == engine_version:
            return self._params[self._live]
        if self.host is not None and self.host.version == engine_version:
            return dict(self.host.params)
        return None

    def live_buffer(self, engine_version: int) -> Optional[torch.Tensor]:
        """Return the flat bytes of the set the engine runs on, if it runs on the version we last committed
        (what a fleet engine relays to another engine of the same layout)."""
        if self._live is not None and self._versions[self._live] == engine_version:
            return self.buffer(self._live)
        return None

    def committed(self, version: int) -> None:
        """The target set is now live as `version` (with one set: its host copy starts)."""
        target = self.target
        self._versions[target], self._live = version, target
        if self.host is not None:
            self.host.start(self.buffer(target), version)

    @property
    def nbytes(self) -> int:
        """Bytes held by the sets (in the mover's memory; the host copy is `host_bytes`)."""
        return self.count * self.set_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copy of the live version (one set only)."""
        return 0 if self.host is None else self.set_bytes
