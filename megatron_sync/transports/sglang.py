"""Transport "sglang": the trainer's end of SGLang's own weight-update group, fed by the plan's buckets.

SGLang's ranks join the group through `init_custom_process_group`: torch's
tcp:// rendezvous, the store wrapped in `PrefixStore(group_name)`, and torch's
own process-group helper (which adds its own prefixes). `init_update_group`
builds rank 0 the same way, so both sides use the same store keys. The
engines' joins (POST /init_weights_update_group) are started by their
`SGLangEngineClient`s, which `TrainerWeightSync` drives; the servers are
listed in `weight_sync.engines` ("sglang=http://host:port").

A `BucketTransport` of which only the trainer runs code: per bucket, every
engine gets POST /update_weights_from_distributed (names, dtypes, shapes,
`load_format: flattened_bucket`) on a thread, and rank 0 broadcasts the
bucket's bytes once; SGLang rebuilds the tensors and calls its model's
`load_weights`. The agreement is local, fed by the engines' HTTP answers: a
bucket an engine refused fails the sync, naming the engine. What SGLang's API
does not allow, compared with the project's own receiver: SGLang receives
from group rank 0 only (one trainer stage: PP=1), verifies no checksum, and
loads each bucket as it arrives, so a failed sync leaves an engine partially
updated (`SGLangEngineClient.after_sync` then keeps it paused).
"""

from __future__ import annotations

import datetime
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

from megatron_sync.settings.config import parse_engine
from megatron_sync.engines.http import BackgroundCall, EngineHTTPError
from megatron_sync.engines.sglang import requests
from megatron_sync.engines.sglang.client import call_sglang
from megatron_sync.core.errors import AgreedFailure
from megatron_sync.core.meta import TensorMeta
from megatron_sync.plan.buckets import BucketPlan
from megatron_sync.transports.base import BucketHeader, Commit, PendingBucket, Receiver
from megatron_sync.transports.buckets.transport import PlanBucketTransport
from megatron_sync.session.control import ControlChannel, ControlMessage, Report
from megatron_sync.session.group import Pending, TransportGroup

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.engines.base import EngineAdapter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.plan.buckets import KeepTogether


def init_update_group(master_address: str, master_port: int, world_size: int, *, group_name: str,
                      backend: str, timeout_s: float) -> tuple[TransportGroup, Any]:
    """Return (group, torch process group) of rank 0 of an SGLang weight-update group.

    The trainer hosts the rendezvous store. Collective with every engine's
    POST /init_weights_update_group, which must run concurrently (it blocks
    until all ranks joined).
    """
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(
        world_size, 0, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
        group_name=group_name, timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {r: r for r in range(world_size)}  # group ranks are global ranks here
    group = TransportGroup(pg, store, rank=0, world_size=world_size, backend=backend, timeout_s=timeout_s,
                           group_name=group_name)
    return group, pg


class HTTPOnlyControl(ControlChannel):
    """SGLang's ranks follow HTTP calls, not control messages: nothing is sent and no report comes back."""

    def send(self, message: ControlMessage) -> None:
        """Nothing to send: the engine clients drive SGLang over HTTP."""

    def next(self, timeout_s: float) -> ControlMessage:
        raise NotImplementedError("transport 'sglang' has no inference endpoint that reads control messages")

    def report(self, kind: Report, version: int, rank: int, payload: bytes) -> None:
        raise NotImplementedError("transport 'sglang' has no inference endpoint that reports")

    def collect(self, kind: Report, version: int, ranks: Iterable[int],
                timeout_s: Optional[float] = None) -> dict[int, bytes]:
        """Return {}: SGLang reports nothing through the store (its answers come over HTTP)."""
        return {}


class _BucketSent:
    """The payload broadcast of one bucket plus every engine's HTTP call for it."""

    def __init__(self, broadcast: Pending, calls: list[BackgroundCall], transport: "SGLangTransport") -> None:
        self._broadcast, self._calls, self._transport = broadcast, calls, transport

    def wait(self) -> None:
        """Wait for the bytes and the engines' answers; an engine's refusal is kept for `agree`."""
        self._broadcast.wait()
        for call in self._calls:
            try:
                call.wait(self._transport.group.timeout_s + 60)
            except (EngineHTTPError, TimeoutError) as e:
                self._transport.record_failure(f"{call.what}: {e}")
        self._calls = []

    def is_completed(self) -> bool:
        return self._broadcast.is_completed() and all(c.done() for c in self._calls)

    @property
    def done_at(self) -> Optional[float]:
        """When the bytes had left (the engines' answers are not timed); None before."""
        return self._broadcast.done_at


class SGLangTransport(PlanBucketTransport):
    """Rank 0 of SGLang's update group: sends plan buckets to the SGLang servers of `weight_sync.engines`."""

    name = "sglang"
    max_buckets_in_flight = 1  # each bucket's HTTP announcements and broadcast finish before the next's
    meets_at_store = False  # SGLang's update group has its own rendezvous at master_address:master_port

    def __init__(self, group: TransportGroup, process_group: Any, urls: list[str], timeout_s: float) -> None:
        self.group, self._process_group, self.urls, self.timeout_s = group, process_group, urls, timeout_s
        self.rank, self.world_size, self.num_stages = 0, group.world_size, 1
        self.control = HTTPOnlyControl()
        self._failures: list[str] = []
        self._lock = threading.Lock()

    @classmethod
    def connect_trainer(cls, config: "WeightSyncConfig", layout: "ParallelLayout", *,
                        session: Any = None) -> "SGLangTransport":
        """Return rank 0 of the update group (the engines' joins, started by their clients, run meanwhile)."""
        if layout.pp != 1:
            raise ValueError(f"transport 'sglang' takes one trainer pipeline stage (SGLang receives from update "
                             f"group rank 0 only); this trainer has PP={layout.pp}: use transport 'broadcast' "
                             "with megatron-sync engines, or PP=1")
        urls = [url for kind, url in map(parse_engine, config.engines) if kind == "sglang"]
        if not urls or len(urls) != len(config.engines):
            raise ValueError("transport 'sglang' sends to SGLang servers only: list them in weight_sync.engines "
                             f"as 'sglang=http://host:port' (got {list(config.engines)})")
        backend = config.resolved_backend(torch.cuda.is_available())
        group, pg = init_update_group(config.master_address, config.master_port, 1 + config.num_inference_ranks,
                                      group_name=requests.GROUP_NAME, backend=backend, timeout_s=config.timeout_s)
        return cls(group, pg, urls, config.timeout_s)

    @classmethod
    def connect_inference(cls, config: "WeightSyncConfig", *, num_trainer_stages: int,
                          inference_rank: int, session: Any = None) -> "SGLangTransport":
        raise ValueError("transport 'sglang' has no megatron-sync inference ranks: SGLang's own ranks receive, "
                         "driven over HTTP by the trainer (weight_sync.engines)")

    def make_receiver(self, engine: "EngineAdapter", config: "WeightSyncConfig", keep_together: "KeepTogether",
                      commit: Optional[Commit] = None) -> Receiver:
        raise ValueError("transport 'sglang' has no megatron-sync receiver: SGLang receives with its own code")

    @property
    def inference_ranks(self) -> range:
        return range(1, self.world_size)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """Return a buffer on the group's device."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)

    def exchange_metadata(self, stage_metas: Optional[list[TensorMeta]]) -> list[list[TensorMeta]]:
        """Return the one stage's metadata (SGLang takes no part in the plan handshake)."""
        assert stage_metas is not None, "the trainer is rank 0 and stage 0's source"
        return [list(stage_metas)]

    @property
    def device(self) -> torch.device:
        return self.group.device

    @classmethod
    def make_sender(cls, transport, stream, config: "WeightSyncConfig", keep_together: "KeepTogether"):
        """The bucket sender, without checksums: SGLang verifies none (its transport is trusted)."""
        return super().make_sender(transport, stream, config.replace(checksum="none"), keep_together)

    def send_bucket(self, bucket: BucketPlan, data: torch.Tensor,
                    seal: Callable[[], BucketHeader]) -> "_BucketSent | Pending":
        """Announce `bucket` to every engine over HTTP, then broadcast its bytes from rank 0."""
        header = seal()  # no checksum to overlap (SGLang checks none); it says whether the sender aborted
        if header.nbytes < 0:  # the sender failed before filling it: announce nothing, SGLang would load garbage
            return Pending(self.group, "broadcast", None)
        body = requests.update_weights_from_distributed(bucket, group_name=requests.GROUP_NAME)
        calls = [BackgroundCall(self._announcer(url, body), f"SGLang at {url}, bucket {bucket.index}")
                 for url in self.urls]
        payload = data[: bucket.nbytes]
        if payload.device != self.group.device:
            payload = payload.to(self.group.device)
        return _BucketSent(self.group.broadcast(payload, src=0, async_op=True), calls, self)

    def _announcer(self, url: str, body: dict) -> Callable[[], Any]:
        return lambda: call_sglang(url, "/update_weights_from_distributed", body=body, timeout_s=self.timeout_s)

    def recv_bucket(self, bucket: BucketPlan, out: torch.Tensor) -> PendingBucket:
        """Not used: the trainer is the only sender and SGLang's ranks receive with their own code."""
        raise NotImplementedError("SGLang's update group has one sender (rank 0); nothing is received here")

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Return [obj]: only the trainer runs this code (SGLang's ranks never join our collectives)."""
        return [obj]

    def record_failure(self, message: str) -> None:
        """Keep an engine's refusal of a bucket for the next `agree`."""
        with self._lock:
            self._failures.append(message)

    def agree(self, error: Optional[str], *, what: str,
              failure: Optional[Callable[[list[tuple[int, str]]], AgreedFailure]] = None) -> None:
        """Raise if this rank failed or an engine refused a bucket since the last call (rank 0 names them)."""
        with self._lock:
            refused, self._failures = self._failures, []
        failures = [(0, message) for message in ([error] if error is not None else []) + refused]
        if failures:
            raise failure(failures) if failure is not None else AgreedFailure(what, failures)

    def close(self) -> None:
        """Destroy the group on the trainer's side (the engines leave through their clients)."""
        import torch.distributed as dist

        if self._process_group is not None:
            dist.destroy_process_group(self._process_group)  # also shuts the backend down
            self._process_group = None
