"""The transport interface: everything the drivers, the sender and the receiver use of a transport.

A `Transport` is one endpoint (a trainer rank or an inference rank) of one way
of moving weights. It declares how each side connects, the typed control
channel, the all-gather that agreement runs on, buffer allocation, the
transport's own phase timings, and how the two halves of a sync are built
(`make_sender` / `make_receiver`), so a transport with its own data path
(P2P, disk delta) plugs in without the drivers changing.

`BucketTransport` is the family of transports that move the plan's buckets
(broadcast, SGLang's group, and any toy transport a test registers): they
implement three byte-moving methods, and the generic `WeightSender` /
`WeightReceiver` do the rest (replica, checksums, staging, two-phase commit,
rollback); `transport.buckets.PlanBucketTransport` wires those in. A bucket's
header follows its payload, so the sender checksums the bytes while they travel.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Protocol

import torch

from megatron_sync.core import agreement
from megatron_sync.core.errors import AgreedFailure
from megatron_sync.core.meta import TensorMeta
from megatron_sync.core.metrics import SyncMetrics
from megatron_sync.plan.buckets import BucketPlan, KeepTogether
from megatron_sync.session.commit import Commit
from megatron_sync.session.control import ControlChannel

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.engines.base import EngineAdapter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.stream import HFWeightStream
    from megatron_sync.session.session import SyncSession



class Waitable(Protocol):
    """An in-flight send. `done_at`: perf_counter() when it finished, None while running or when
    the transport cannot tell (timelines then use the time the caller saw it complete)."""

    done_at: Optional[float]

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class Sender(abc.ABC):
    """The trainer half of one sync, on one trainer rank."""

    keep_sent: bool = False
    """Checks and dumps: keep the HF tensors each sync sent, for `sent_tensors` (a transport that keeps a copy
    for its own use, such as the bucket sender's host replica, returns that whatever this says)."""

    @abc.abstractmethod
    def sync(self, version: int) -> SyncMetrics:
        """Send `version`; return once every rank committed it (raise `SyncError` on every rank otherwise)."""

    def sent_tensors(self) -> Optional[Mapping[str, torch.Tensor]]:
        """Return the HF tensors this rank sent in its last sync (views of what it keeps, by HF name).

        Empty on a rank that sends nothing; None where the transport keeps no copy after sending (disk_delta
        hands its buffer to the writer; p2p unless `keep_sent` was set before the sync). For checks and
        debugging, not the data path.
        """
        return None


class Receiver(abc.ABC):
    """The inference half of one sync, on one inference rank."""

    @abc.abstractmethod
    def receive(self, version: int) -> SyncMetrics:
        """Receive, verify and (once every rank agrees) commit `version`; return its metrics."""

    def live_shards(self, version: int) -> Optional[Mapping[str, torch.Tensor]]:
        """Return this receiver's own copy of the engine's live params when the engine runs `version`
        (what a released engine is restored from, `megatron_sync.engines.handoff`); None when it keeps none."""
        return None


class Transport(abc.ABC):
    """One endpoint of a transport. Subclasses register under `name` in `megatron_sync.transports`."""

    name: ClassVar[str]
    meets_at_store: ClassVar[bool] = True
    """True: the two jobs meet at weight_sync.master_address:master_port, where the drivers host and join a
    sync session (the join handshake, `session/session.py`) and pass it, ready, as `session=`. False: the
    transport meets by its own means (see `meets_in_files`; SGLang: its servers' own update group)."""
    meets_in_files: ClassVar[bool] = False
    """True: the jobs meet in a directory session (`session/files.py`: the same join handshake, through files);
    the drivers pass what this rank presents there (a `FileRendezvous`) as `session=`, and the transport hosts
    or joins it where its files live (disk_delta: delta_dir/control)."""
    keeps_server_fleet: ClassVar[bool] = False
    """True: with fleet.enabled the engines are driven servers this transport's rank 0 sends to directly, whose
    membership the trainer's leader keeps (`fleet.servers.ServerFleet`); False: a fleet of linked engines
    (`fleet.trainer.FleetDriver`)."""
    shares: ClassVar[tuple[str, ...]] = ()
    """Settings (rows of `rendezvous.EXPECTATIONS`) both halves of this transport must agree on beyond the
    common ones (`rendezvous.COMMON`): the join handshake refuses a job that differs, naming the setting."""
    rank: int
    world_size: int
    control: ControlChannel

    # ---- connecting (collective over the transport's group) ----

    @classmethod
    def trainer_joins(cls, layout: "ParallelLayout") -> bool:
        """Return True if a trainer rank at `layout` joins this transport (default: stage sources)."""
        return layout.is_stage_source

    @classmethod
    @abc.abstractmethod
    def connect_trainer(cls, config: "WeightSyncConfig", layout: "ParallelLayout", *,
                        session: Optional["SyncSession"] = None) -> "Transport":
        """Return the endpoint of a joining trainer rank.

        `session` (when `meets_at_store`) is the ready sync session both jobs
        were admitted to (the drivers host and join it): build the transport's
        rendezvous on `session.store` under a prefix carrying `session.id`
        (`group.transport_group_over` does this for a process group).
        """

    @classmethod
    @abc.abstractmethod
    def connect_inference(cls, config: "WeightSyncConfig", *, num_trainer_stages: int,
                          inference_rank: int, session: Optional["SyncSession"] = None) -> "Transport":
        """Return the endpoint of inference rank `inference_rank` (0-based among inference ranks)."""

    # ---- what every endpoint offers ----

    @property
    @abc.abstractmethod
    def inference_ranks(self) -> range:
        """The transport ranks of the inference side (the ranks whose reports the leader collects)."""

    @property
    def is_leader(self) -> bool:
        """True on the one trainer endpoint that talks to the engines (transport rank 0)."""
        return self.rank == 0

    @abc.abstractmethod
    def all_gather_json(self, obj: Any) -> list[Any]:
        """Return every transport rank's JSON-serialisable `obj`, indexed by rank."""

    def agree(self, error: Optional[str], *, what: str,
              failure: Callable[[list[tuple[int, str]]], AgreedFailure] | None = None) -> None:
        """Share this rank's `error` (None: ok) with every transport rank; all raise if any failed."""
        agreement.agree(error, what=what, gather=self.all_gather_json, failure=failure)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Return an uninitialised byte buffer of `nbytes` where this transport moves bytes from."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def take_media_bytes(self) -> dict[str, int]:
        """Return (and reset) the bytes this endpoint moved per medium since the last call, for transports
        that count them (ipc: {"shm": ..., "socket": ...}); {} where the transport does not."""
        return {}

    def take_phase_seconds(self) -> dict[str, float]:
        """Return (and reset) seconds this transport spent per phase outside the caller's timers."""
        return {}

    def stop_transfers(self) -> None:
        """End this endpoint's part in any transfer now, so that peers waiting on it fail at once instead of
        after `timeout_s`; the control channel stays usable (a trainer that stops calls it after posting
        "stop", before it waits for the engines to acknowledge). Default: nothing in flight to end."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the group and buffers; safe to call twice and after a failure."""

    # ---- the two halves of a sync (the drivers call only these) ----

    @classmethod
    @abc.abstractmethod
    def make_sender(cls, transport: Optional["Transport"], stream: "HFWeightStream",
                    config: "WeightSyncConfig", keep_together: KeepTogether) -> Sender:
        """Return the sender of a trainer rank (`transport` is None on ranks that do not join)."""

    @abc.abstractmethod
    def make_receiver(self, engine: "EngineAdapter", config: "WeightSyncConfig", keep_together: KeepTogether,
                      commit: Optional[Commit] = None) -> Receiver:
        """Return the receiver of this inference endpoint (collective: it runs the plan handshake)."""


@dataclass(frozen=True)
class BucketHeader:
    """What travels with each bucket's payload (right after it): version, bucket index, nbytes, checksum.

    nbytes == ABORTED_NBYTES marks a bucket whose sender failed before filling
    it; the payload still travels (so every rank stays in lockstep) and is dropped.
    """

    version: int
    index: int
    nbytes: int
    checksum: int

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.version, self.index, self.nbytes, self.checksum],
                            dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "BucketHeader":
        return cls(*(int(x) for x in t.tolist()))


ABORTED_NBYTES = -1


class PendingBucket(abc.ABC):
    """An in-flight bucket receive."""

    @abc.abstractmethod
    def wait(self) -> tuple[BucketHeader, torch.Tensor]:
        """Block until the bucket arrived; return its header and its payload bytes."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once `wait()` would not block."""

    @property
    def done_at(self) -> Optional[float]:
        """perf_counter() when the bucket had arrived; None while in flight or when the transport
        cannot tell (timelines then use the time the receiver saw it)."""
        return None


class BucketTransport(Transport):
    """A transport that moves the plan's buckets from stage sources to every inference rank."""

    num_stages: int

    shares: ClassVar[tuple[str, ...]] = ("checksum",)  # every bucket is checked with it on both sides
    max_buckets_in_flight: ClassVar[int] = 2
    """Buckets a sender may have on the wire at once (a transport whose receivers must take
    buckets strictly one after another says 1)."""

    delivers_in_place: ClassVar[bool] = False
    """True: `recv_bucket` hands back the bytes where they already lie (ipc: a shared segment), so the
    receiver allocates no receive buffers and passes `out=None`. A receiver holds at most two buckets:
    asking for a stage's bucket k means it is done with that stage's bucket k - 2."""

    @abc.abstractmethod
    def exchange_metadata(self, stage_metas: Optional[list[TensorMeta]]) -> list[list[TensorMeta]]:
        """Return every stage's tensor metadata; stage sources pass their own stage's list, others None."""

    @property
    def device(self) -> torch.device:
        """Where this endpoint's bucket bytes live (what `alloc` returns; the CPU unless overridden)."""
        return torch.device("cpu")

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Return an uninitialised byte buffer of `nbytes` on this endpoint's `device`."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    @abc.abstractmethod
    def send_bucket(self, bucket: BucketPlan, data: torch.Tensor, seal: Callable[[], BucketHeader]) -> Waitable:
        """Start sending one bucket of this rank's stage, then its header; return the in-flight handle
        of both.

        The payload goes first; `seal()` is called once it is on its way and returns the header
        (version, index, nbytes, checksum), which follows the payload, so the checksum is computed
        while the bytes travel. Receivers get both from `recv_bucket(...).wait()`.
        """

    @abc.abstractmethod
    def recv_bucket(self, bucket: BucketPlan, out: Optional[torch.Tensor]) -> PendingBucket:
        """Start receiving `bucket` (every rank but its stage's source) into `out` (None when
        `delivers_in_place`)."""
