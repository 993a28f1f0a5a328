"""The trainer's links to a fleet's engines: one transport per engine, and the fan-out over a wave's links.

Each engine of a fleet has its own link: a transport whose inference side is that engine's ranks only, built
over its own part of the sync session (`SyncSession.part`, a prefix per engine and generation). An engine that
dies takes its link down and nothing else; a restarted engine gets a new link. `FanOut` is the trainer endpoint
of every link of one delivery as one `BucketTransport`: the generic `WeightSender` sends each bucket once per
link, and a link that fails (its engine died or fell silent) or aborts (its engine refused the version) is set
aside with its reason while the others go on. Only a failure of the trainer's own stage fails the whole sync.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_sync.core.errors import AgreedFailure, PeerFailureError, SyncAbortedError
from megatron_sync.core.meta import TensorMeta
from megatron_sync.plan.buckets import BucketPlan
from megatron_sync.transports.base import BucketHeader, BucketTransport, PendingBucket, Transport

log = logging.getLogger("megatron_sync")


def link_name(engine: int, generation: int) -> str:
    """Return the session part an engine's link is built over (unique per engine and generation)."""
    return f"engine{engine}/g{generation}"


@dataclass
class Link:
    """The trainer's end of one engine's link (`transport` is None on trainer ranks that do not join)."""

    engine: int
    generation: int
    transport: Optional[Transport]
    layout: str = ""  # digest of the engine's rank layouts (engines with equal digests can relay)
    relays: bool = False  # its receivers keep the committed version in a staging set another engine can read

    @property
    def name(self) -> str:
        return f"engine {self.engine} (generation {self.generation})"

    def close(self) -> None:
        if self.transport is not None:
            try:
                self.transport.close()
            except Exception as e:  # noqa: BLE001 — a dead engine's link may not close cleanly
                log.info("closing the link of %s: %s", self.name, e)
            self.transport = None


@dataclass
class Outcome:
    """What became of one link in one sync: committed, aborted (the engine keeps its version) or failed."""

    engine: int
    state: str  # "committed", "aborted" or "failed"
    reason: str = ""
    bytes: int = 0  # bucket bytes this trainer rank handed to the engine's link

    def to_wire(self) -> list:
        return [self.state, self.reason, self.bytes]


class FanOut(BucketTransport):
    """The trainer endpoint of several links as one bucket transport (stage `stage` of `num_stages`).

    Every link is a group whose first `num_stages` ranks are the trainer's stage sources, in the same order
    on every link, so this rank's role (sender of its stage's buckets, receiver of the others') is the same
    on each. Per-link problems never raise: `outcomes()` says what became of each link.
    """

    name = "fleet-fanout"  # not registered: the fleet driver builds it

    def __init__(self, stage: int, num_stages: int, device: torch.device) -> None:
        self.rank, self.num_stages, self._device = stage, num_stages, device
        self.world_size = num_stages
        self.links: list[Link] = []
        self._failed: dict[int, str] = {}
        self._aborted: dict[int, str] = {}
        self._sent: dict[int, int] = {}  # engine -> bytes handed to its link in this sync
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}  # (link index, slot) -> receive buffer

    def use(self, links: list[Link]) -> None:
        """Send the next version over `links` (their outcomes start afresh)."""
        self.links = list(links)
        self._failed, self._aborted, self._sent = {}, {}, {}

    @property
    def live(self) -> list[Link]:
        """The links still taking part (neither failed nor aborted in this sync)."""
        return [link for link in self.links if link.engine not in self._failed and link.engine not in self._aborted]

    def outcomes(self) -> list[Outcome]:
        """What became of every link of the last `use()`."""
        def outcome(engine: int) -> Outcome:
            sent = self._sent.get(engine, 0)
            if engine in self._failed:
                return Outcome(engine, "failed", self._failed[engine], sent)
            if engine in self._aborted:
                return Outcome(engine, "aborted", self._aborted[engine], sent)
            return Outcome(engine, "committed", "", sent)

        return [outcome(link.engine) for link in self.links]

    def fail(self, link: Link, error: BaseException) -> None:
        """Set `link` aside for the rest of the sync: its engine died, fell silent or its group broke."""
        if link.engine not in self._failed:
            self._failed[link.engine] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if link.transport is not None:
                link.transport.stop_transfers()  # its other pending operations end at once

    # ---- Transport: a fan-out is assembled by the fleet driver from links, never connected on its own ----

    @classmethod
    def connect_trainer(cls, config: Any, layout: Any, *, session: Any = None) -> "Transport":
        raise TypeError("FanOut is assembled from a fleet's links (FleetDriver), not connected")

    @classmethod
    def connect_inference(cls, config: Any, *, num_trainer_stages: int, inference_rank: int,
                          session: Any = None) -> "Transport":
        raise TypeError("FanOut is the trainer's side of a fleet's links; engines connect their own link")

    @classmethod
    def make_sender(cls, transport: Any, stream: Any, config: Any, keep_together: Any) -> Any:
        raise TypeError("a fleet's sender is a WeightSender over the FanOut, built by FleetDriver")

    def make_receiver(self, engine: Any, config: Any, keep_together: Any, commit: Any = None) -> Any:
        raise TypeError("FanOut is trainer-side only")

    # ---- BucketTransport ----

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def inference_ranks(self) -> range:
        return range(0)  # reports are collected per link by the fleet driver

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self._device)

    def exchange_metadata(self, stage_metas: Optional[list[TensorMeta]]) -> list[list[TensorMeta]]:
        raise NotImplementedError("a fleet's plan is agreed on each link as it opens")

    def all_gather_json(self, obj: Any) -> list[Any]:
        raise NotImplementedError("agreement runs per link (FanOut.agree)")

    def send_bucket(self, bucket: BucketPlan, data: torch.Tensor, seal: Callable[[], BucketHeader]) -> "_FanOutSend":
        """Start the bucket on every live link; the header (and its checksum) is computed once."""
        sealed = functools.lru_cache(maxsize=None)(seal)
        sends = []
        for link in self.live:
            try:
                sends.append((link, link.transport.send_bucket(bucket, data, sealed)))
                self._sent[link.engine] = self._sent.get(link.engine, 0) + bucket.nbytes
            except PeerFailureError as e:
                self.fail(link, e)
        return _FanOutSend(self, sends)

    def recv_bucket(self, bucket: BucketPlan, out: torch.Tensor) -> PendingBucket:
        """Take part in another stage's bucket on every live link (each into its own buffer)."""
        receives = []
        for index, link in enumerate(self.live):
            buffer = out if index == 0 else self._buffer(index, out)
            try:
                receives.append((link, link.transport.recv_bucket(bucket, buffer)))
            except PeerFailureError as e:
                self.fail(link, e)
        return _FanOutReceive(self, receives, out)

    def _buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        slot = like.data_ptr()
        key = (index, slot)
        if key not in self._scratch or self._scratch[key].numel() < like.numel():
            self._scratch[key] = torch.empty_like(like)
        return self._scratch[key][: like.numel()]

    def agree(self, error: Optional[str], *, what: str,
              failure: Callable[[list[tuple[int, str]]], AgreedFailure] | None = None) -> None:
        """One agreement round on every live link. A link whose engine failed is set aside (aborted: that
        engine keeps its version); only when this rank itself failed (`error`) does it raise."""
        raised: Optional[AgreedFailure] = None
        for link in self.live:
            try:
                link.transport.agree(error, what=what, failure=failure)
            except AgreedFailure as e:
                if error is not None:
                    raised = raised or e
                else:
                    self._aborted[link.engine] = "; ".join(f"[rank {r}] {m.splitlines()[0]}" for r, m in e.failures)
            except PeerFailureError as e:
                self.fail(link, e)
        if error is not None:
            raise raised or SyncAbortedError(0, [(self.rank, error)])

    def stop_transfers(self) -> None:
        for link in self.links:
            if link.transport is not None:
                link.transport.stop_transfers()

    def close(self) -> None:
        self._scratch.clear()


class _FanOutSend:
    """A bucket sent on several links: waiting sets a failing link aside instead of raising."""

    def __init__(self, fanout: FanOut, sends: list[tuple[Link, Any]]) -> None:
        self._fanout, self._sends = fanout, sends

    @property
    def done_at(self) -> Optional[float]:
        ends = [pending.done_at for _, pending in self._sends]
        return None if None in ends else max(ends, default=None)

    def wait(self) -> None:
        for link, pending in self._sends:
            try:
                pending.wait()
            except PeerFailureError as e:
                self._fanout.fail(link, e)

    def is_completed(self) -> bool:
        return all(link.engine in self._fanout._failed or pending.is_completed() for link, pending in self._sends)


class _FanOutReceive(PendingBucket):
    """Another stage's bucket on several links; this rank only takes part (the bytes are not used)."""

    def __init__(self, fanout: FanOut, receives: list[tuple[Link, PendingBucket]], out: torch.Tensor) -> None:
        self._fanout, self._receives, self._out = fanout, receives, out

    def wait(self) -> tuple[BucketHeader, torch.Tensor]:
        header = BucketHeader(0, -1, 0, 0)
        for link, pending in self._receives:
            try:
                header, _ = pending.wait()
            except PeerFailureError as e:
                self._fanout.fail(link, e)
        return header, self._out

    def is_completed(self) -> bool:
        return all(link.engine in self._fanout._failed or pending.is_completed() for link, pending in self._receives)

    @property
    def done_at(self) -> Optional[float]:
        ends = [pending.done_at for _, pending in self._receives]
        return None if None in ends else max(ends, default=None)


@dataclass
class Deliveries:
    """Per-engine records of one version across its waves (the fleet part of the trainer's metrics)."""

    version: int
    rows: list[dict] = field(default_factory=list)

    def add(self, engine: int, generation: int, wave: int, source: str, outcome: str, seconds: float,
            trainer_bytes: int = 0, reason: str = "") -> None:
        self.rows.append({"engine": engine, "generation": generation, "version": self.version, "wave": wave,
                          "source": source, "outcome": outcome, "seconds": round(seconds, 6),
                          "trainer_bytes": trainer_bytes, **({"reason": reason} if reason else {})})
