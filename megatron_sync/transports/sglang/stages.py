"""The trainer's pipeline stages meet at rank 0: SGLang receives every bucket from update-group rank 0 only.

Stage sources 0..P-1 form a small group of their own over the store rank 0
hosts (under its own prefix). A later stage's source sends each of its
buckets to rank 0, payload then header (version, index, nbytes, checksum:
nbytes -1 when its sender failed before filling it), in plan order; rank 0
receives them after its own stage's buckets and hands them on to SGLang.
The group also carries the stage sources' agreement (their failures and the
engines' refusals rank 0 saw), so every stage fails the same sync together.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_sync.engines.sglang import requests
from megatron_sync.plan.buckets import BucketPlan
from megatron_sync.session.group import PendingOp, TransportGroup
from megatron_sync.transports.base import BucketHeader
from megatron_sync.transports.sglang.group import group_over


def stage_group(store: Any, num_stages: int, stage: int, *, port: int, backend: str,
                timeout_s: float) -> TransportGroup:
    """Return stage `stage`'s place in the stage sources' group (collective over all P stage sources); named
    after the store's `port` like the update group."""
    return group_over(store, f"{requests.GROUP_NAME}.{port}.stages", num_stages, stage, backend=backend,
                      timeout_s=timeout_s)


class SentToLeader:
    """A later stage's bucket on its way to rank 0: payload, then header."""

    def __init__(self, payload: PendingOp, header: PendingOp) -> None:
        self._payload, self._header = payload, header
        self.done_at: Optional[float] = None

    def wait(self) -> None:
        self._payload.wait()
        self._header.wait()
        self.done_at = self._header.done_at

    def is_completed(self) -> bool:
        return self._payload.is_completed() and self._header.is_completed()


def send_to_leader(group: TransportGroup, bucket: BucketPlan, payload: torch.Tensor,
                   header: BucketHeader) -> SentToLeader:
    """Start sending one of this stage's buckets to rank 0 (payload `bucket.nbytes` long)."""
    data = group.send(payload[: bucket.nbytes], 0, tag=2 * bucket.index)
    head = group.send(header.to_tensor(group.device), 0, tag=2 * bucket.index + 1)
    return SentToLeader(data, head)


def receive_from_stage(group: TransportGroup, bucket: BucketPlan, out: torch.Tensor) -> BucketHeader:
    """Receive a later stage's `bucket` into `out` on rank 0; return its header (bounded by the group's timeout)."""
    header = torch.empty(4, dtype=torch.int64, device=group.device)
    group.recv(out[: bucket.nbytes], bucket.stage, tag=2 * bucket.index).wait()
    group.recv(header, bucket.stage, tag=2 * bucket.index + 1).wait()
    return BucketHeader.from_tensor(header)
