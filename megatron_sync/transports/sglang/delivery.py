"""How one bucket reaches every SGLang server: over the update group, or in shared memory on the same host.

- `GroupDelivery` ("distributed"): POST /update_weights_from_distributed
  (names, dtypes, shapes, `load_format: flattened_bucket`) to every server on
  a thread, and one broadcast of the bucket's bytes from rank 0. Both are
  watched together: a server that answers with a refusal (or stops answering)
  while the broadcast waits for its ranks ends the trainer's end of the group
  at once, so the sync fails within the HTTP answer's time, not the group's
  timeout; the group is then rebuilt before anything else moves on it.
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
from typing import Callable, Iterator, Optional, Sequence

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
    """One bucket on its way to every server; `wait` returns the refusals (URL -> message), {} when all took it."""

    def __init__(self, calls: dict[str, BackgroundCall], transfer: Optional[object], timeout_s: float,
                 on_refusal: Callable[[], None]) -> None:
        self._calls, self._transfer, self._timeout_s = calls, transfer, timeout_s
        self._on_refusal = on_refusal
        self.refusals: Optional[dict[str, str]] = None

    def is_completed(self) -> bool:
        return all(c.done() for c in self._calls.values()) and (
            self._transfer is None or self._transfer.is_completed())

    @property
    def done_at(self) -> Optional[float]:
        return getattr(self._transfer, "done_at", None)

    def wait(self) -> dict[str, str]:
        """Wait for every answer and the bytes, together; a refusal while the bytes wait ends the transfer."""
        if self.refusals is not None:
            return self.refusals
        poll(lambda: self.is_completed() or self._refused(), within=self._timeout_s + ANSWER_GRACE_S,
             what="SGLang's answers for a bucket", max_pause_s=0.02,
             timeout=lambda waited: TimeoutError(f"no answer for a bucket within {waited:.3g}s"))
        refusals = {}
        for url, call in self._calls.items():
            try:
                call.wait(self._timeout_s + ANSWER_GRACE_S)
            except (EngineHTTPError, TimeoutError) as e:
                refusals[url] = str(e)
        if self._transfer is not None and refusals and not self._transfer.is_completed():
            # The refusing server's ranks will never take part, and gloo cannot cancel the broadcast (neither
            # shutdown nor abort ends a pending one): leave it to its timeout and never use the group again.
            self._on_refusal()
        elif self._transfer is not None:
            try:
                self._transfer.wait()
            except RuntimeError as e:  # PeerFailureError: the group broke (a server died mid-bucket)
                self._on_refusal()
                refusals.setdefault("update group", str(e))
        self.refusals = refusals
        return refusals

    def _refused(self) -> bool:
        return any(c.failed() for c in self._calls.values())


class GroupDelivery:
    """Buckets to SGLang's update group: announced over HTTP, broadcast from rank 0."""

    def __init__(self, group: UpdateGroup, timeout_s: float) -> None:
        self.group, self.timeout_s = group, timeout_s

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.group.members]

    def deliver(self, bucket: BucketPlan, payload: torch.Tensor, urls: Sequence[str]) -> Delivered:
        """Announce `bucket` to the servers at `urls` and broadcast `payload` (its bytes) to the group."""
        body = requests.update_weights_from_distributed(bucket, group_name=self.group.name)
        calls = {url: BackgroundCall(_poster(url, "/update_weights_from_distributed", body, self.timeout_s),
                                     f"SGLang at {url}, bucket {bucket.index}") for url in urls}
        device = self.group.group.device
        transfer = self.group.group.broadcast(payload if payload.device == device else payload.to(device), src=0,
                                              async_op=True)
        return Delivered(calls, transfer, self.timeout_s, self.group.break_off)

    def recover(self, alive: Sequence[str]) -> None:
        """Make the group usable again after a break: rebuilt with the servers still answering."""
        if self.group.broken or [m.url for m in self.group.members] != list(alive):
            self.group.rebuild(alive)

    def close(self) -> None:
        self.group.close()


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
        return Delivered(calls, None, self.timeout_s, lambda: None)

    def recover(self, alive: Sequence[str]) -> None:
        """Nothing to rebuild: each bucket is its own request."""

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
