"""How one bucket reaches every SGLang server: over the update group, or in shared memory on the same host.

- `GroupDelivery` ("distributed"): POST /update_weights_from_distributed
  (names, dtypes, shapes, `load_format: flattened_bucket`) to every server on
  a thread, and a broadcast of the bucket's bytes from rank 0 in each
  server's own update group. Both are watched together: a server that
  answers with a refusal (or stops answering) while its broadcast waits for
  its ranks is left at once, so the sync fails within the HTTP answer's
  time, not the group's timeout; its group is rebuilt before anything else
  moves on it. The other servers' groups are untouched.
- `TensorDelivery` ("tensor", colocated): the bucket's tensors, pickled as
  torch shares CPU memory (named files in /dev/shm, the "file_system"
  strategy: the default passes file descriptors over a socket that only the
  sender's own process tree may connect to, and SGLang's scheduler dies on
  the refused handshake), in one POST /update_weights_from_tensor per server.
"""

from __future__ import annotations

import base64
import contextlib
import io
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from megatron_sync.core.wait import poll
from megatron_sync.engines.http import BackgroundCall, EngineHTTPError
from megatron_sync.engines.sglang import requests
from megatron_sync.engines.sglang.client import call_sglang
from megatron_sync.plan.buckets import BucketPlan
from megatron_sync.transports.sglang.group import UpdateGroup

ANSWER_GRACE_S = 30.0
"""How much longer than the transfer's timeout a server may take to answer for a bucket it received."""


class Delivered:
    """One bucket on its way to every server; `wait` returns the refusals (URL -> message), {} when all took it.

    `transfers` holds each server's broadcast (none on the colocated path); `broken(url)` is told when a
    server's broadcast can never complete (the server refused, or its group failed).
    """

    def __init__(self, calls: dict[str, BackgroundCall], transfers: dict[str, Any], timeout_s: float,
                 broken: Callable[[str], None]) -> None:
        self._calls, self._transfers, self._timeout_s, self._broken = calls, transfers, timeout_s, broken
        self.refusals: Optional[dict[str, str]] = None

    def _settled(self, url: str) -> bool:
        call, transfer = self._calls[url], self._transfers.get(url)
        return call.done() and (transfer is None or call.failed() or transfer.is_completed())

    def is_completed(self) -> bool:
        return all(self._settled(url) for url in self._calls)

    @property
    def done_at(self) -> Optional[float]:
        times = [getattr(t, "done_at", None) for t in self._transfers.values()]
        return None if not times or None in times else max(times)

    def wait(self) -> dict[str, str]:
        """Wait until every server answered and its bytes went (a refusal ends that server's wait at once)."""
        if self.refusals is not None:
            return self.refusals
        with contextlib.suppress(TimeoutError):  # what is still open then is reported below
            poll(lambda: self.is_completed(), within=self._timeout_s + ANSWER_GRACE_S,
                 what="SGLang's answers for a bucket", max_pause_s=0.02,
                 timeout=lambda waited: TimeoutError(f"no answer within {waited:.3g}s"))
        self.refusals = {}
        for url, call in self._calls.items():
            problem = self._outcome(url, call)
            if problem is not None:
                self.refusals[url] = problem
        return self.refusals

    def _outcome(self, url: str, call: BackgroundCall) -> Optional[str]:
        transfer = self._transfers.get(url)
        if not call.done():
            self._broken(url)
            return f"SGLang at {url} did not answer within {self._timeout_s + ANSWER_GRACE_S:g}s"
        try:
            call.wait(0)
        except EngineHTTPError as e:
            if transfer is not None and not transfer.is_completed():
                self._broken(url)  # its ranks never take part, and gloo cannot cancel the broadcast
            return str(e)
        if transfer is not None:
            try:
                transfer.wait()
            except RuntimeError as e:  # PeerFailureError: the group broke (the server died mid-bucket)
                self._broken(url)
                return str(e)
        return None


class GroupDelivery:
    """Buckets to each server's update group: announced over HTTP, broadcast from rank 0."""

    def __init__(self, groups: Sequence[UpdateGroup], timeout_s: float) -> None:
        self.groups = {g.url: g for g in groups}
        self.timeout_s = timeout_s
        self._dropped: dict[str, UpdateGroup] = {}  # groups of servers that stopped answering: `rejoin` re-forms

    @property
    def urls(self) -> list[str]:
        return list(self.groups)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if next(iter(self.groups.values())).backend == \
            "nccl" else torch.device("cpu")

    def deliver(self, bucket: BucketPlan, payload: torch.Tensor, urls: Sequence[str]) -> Delivered:
        """Announce `bucket` to the servers at `urls` and broadcast `payload` (its bytes) in each one's group."""
        calls, transfers = {}, {}
        data = payload if payload.device == self.device else payload.to(self.device)
        for url in urls:
            group = self.groups[url]
            body = requests.update_weights_from_distributed(bucket, group_name=group.name)
            calls[url] = BackgroundCall(_poster(url, "/update_weights_from_distributed", body, self.timeout_s),
                                        f"SGLang at {url}, bucket {bucket.index}")
            transfers[url] = group.group.broadcast(data, src=0, async_op=True)
        return Delivered(calls, transfers, self.timeout_s, lambda url: self.groups[url].break_off())

    def recover(self, dead: Sequence[str]) -> None:
        """Make the groups usable again after a break: those of the `dead` servers dropped, the broken ones of
        the others rebuilt."""
        for url in [u for u in self.groups if u in dead]:
            group = self.groups.pop(url)
            group.close(reachable=False)
            self._dropped[url] = group
        for group in self.groups.values():
            if group.broken:
                group.rebuild()

    def rejoin(self, url: str, tp_size: int) -> None:
        """Form a new group with a server whose group was dropped (it answers again, perhaps restarted with
        another TP size), under the next generation's name."""
        group = self._dropped.pop(url, None)
        if group is None:  # it left between syncs, its group intact but its ranks gone
            group = self.groups.pop(url)
            group.close(reachable=False)
        group.tp_size, group.generation, group.group = tp_size, group.generation + 1, None
        group.form()
        self.groups[url] = group

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups = {}


class TensorDelivery:
    """Buckets handed over in shared memory to colocated SGLang servers (POST /update_weights_from_tensor)."""

    def __init__(self, urls: Sequence[str], tp_sizes: Sequence[int], timeout_s: float) -> None:
        self.urls, self._tp = list(urls), dict(zip(urls, tp_sizes))
        self.timeout_s = timeout_s

    def deliver(self, bucket: BucketPlan, payload: torch.Tensor, urls: Sequence[str]) -> Delivered:
        """Post the bucket's tensors (views of `payload`, which must stay alive until answered) to `urls`."""
        calls = {}
        for url in urls:
            # One pickle per receiving rank: pickling takes a reference on the shared file that the receiver
            # drops once it opened it; a pickle opened twice would drop one too many and unlink the file.
            serialized = [serialize_named_tensors(bucket, payload) for _ in range(self._tp[url])]
            body = {"serialized_named_tensors": serialized, "load_format": None,
                    "flush_cache": False, "abort_all_requests": False}
            calls[url] = BackgroundCall(_poster(url, "/update_weights_from_tensor", body, self.timeout_s),
                                        f"SGLang at {url}, bucket {bucket.index}")
        return Delivered(calls, {}, self.timeout_s, lambda url: None)

    def recover(self, dead: Sequence[str]) -> None:
        """Nothing to rebuild: each bucket is its own request."""

    def rejoin(self, url: str, tp_size: int) -> None:
        """A server that answers again takes one pickle per rank of its (perhaps new) TP size."""
        self._tp[url] = tp_size

    def close(self) -> None:
        """Nothing held open."""


def _poster(url: str, route: str, body: dict, timeout_s: float) -> Callable[[], object]:
    return lambda: call_sglang(url, route, body=body, timeout_s=timeout_s + ANSWER_GRACE_S)


_SHARING_LOCK = threading.Lock()


@contextlib.contextmanager
def file_system_sharing() -> Iterator[None]:
    """Pickle CPU tensors as named shared-memory files for the duration (the process's strategy is restored)."""
    import torch.multiprocessing as mp

    with _SHARING_LOCK:
        before = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            mp.set_sharing_strategy(before)


def serialize_named_tensors(bucket: BucketPlan, payload: torch.Tensor) -> str:
    """Return the bucket's (name, tensor) list as SGLang deserializes it: ForkingPickler bytes, base64.

    The tensors are views of `payload` (CPU), whose storage moves to shared memory once.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 — registers torch's reductions with ForkingPickler

    if payload.device.type != "cpu":
        raise ValueError("SGLang's colocated path (sglang_load: tensor) takes CPU buckets here; "
                         "CUDA tensors would travel as CUDA IPC handles, which this client does not send")
    named = [(e.name, payload[e.offset: e.offset + e.nbytes].view(e.dtype).view(e.shape)) for e in bucket.entries]
    buffer = io.BytesIO()
    with file_system_sharing():
        ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode()
