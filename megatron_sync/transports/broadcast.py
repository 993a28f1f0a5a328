"""Broadcast transport: each bucket is a payload broadcast then a header broadcast from its stage.

Stage s's source is transport rank s and the root of its buckets' broadcasts;
every other rank of the group (other stage sources included) takes part. The
header (with the checksum) follows the payload, so the sender computes the
checksum while the payload is on the wire. With gloo the payload is the host
replica buffer itself; with NCCL it is the sender's device bucket (the replica
fills its host copy from it on a side stream), and a host payload is copied to
a device buffer first (two, used alternately). Receivers get device bytes on
NCCL. Both broadcasts are issued asynchronously so callers overlap them with work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from megatron_sync.core.meta import TensorMeta
from megatron_sync.plan.buckets import BucketPlan
from megatron_sync.transports.base import BucketHeader, PendingBucket
from megatron_sync.transports.buckets.transport import PlanBucketTransport
from megatron_sync.session.control import StoreControlChannel
from megatron_sync.session.group import PendingOp, TransportGroup, transport_group_over

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.session.session import SyncSession

GROUP_NAME = "megatron_sync"


def connect_group(config: "WeightSyncConfig", session: Optional["SyncSession"], world_size: int,
                  rank: int) -> TransportGroup:
    """Return the transport group of `world_size` ranks over the session's store, as `rank`."""
    if session is None:
        raise ValueError("the broadcast transport meets at the drivers' sync session: pass session= "
                         "(TrainerWeightSync / InferenceWeightSync do)")
    backend = config.resolved_backend(torch.cuda.is_available())
    return transport_group_over(session, world_size, rank, backend=backend, timeout=config.timeout_s,
                                group_name=GROUP_NAME)


class BroadcastTransport(PlanBucketTransport):
    """Transport over one TransportGroup whose first `num_stages` ranks are the stage sources."""

    name = "broadcast"

    @classmethod
    def connect_trainer(cls, config: "WeightSyncConfig", layout: "ParallelLayout", *,
                        session: Optional["SyncSession"] = None) -> "BroadcastTransport":
        world = layout.pp + config.num_inference_ranks
        return cls(connect_group(config, session, world, rank=layout.pp_rank), layout.pp)

    @classmethod
    def connect_inference(cls, config: "WeightSyncConfig", *, num_trainer_stages: int,
                          inference_rank: int, session: Optional["SyncSession"] = None) -> "BroadcastTransport":
        world = num_trainer_stages + config.num_inference_ranks
        return cls(connect_group(config, session, world, rank=num_trainer_stages + inference_rank),
                   num_trainer_stages)

    def __init__(self, group: TransportGroup, num_stages: int) -> None:
        if not 0 < num_stages < group.world_size:
            raise ValueError(
                f"num_stages={num_stages} must be in [1, world_size={group.world_size}): the group "
                "holds the stage sources and at least one inference rank"
            )
        self.group = group
        self.rank, self.world_size, self.num_stages = group.rank, group.world_size, num_stages
        self._device = group.device
        self.control = StoreControlChannel(group.control_board())
        self._device_send: list[torch.Tensor] = []
        self._send_count = 0

    @property
    def device(self) -> torch.device:
        return self._device

    def exchange_metadata(self, stage_metas: Optional[list[TensorMeta]]) -> list[list[TensorMeta]]:
        """Return all stages' metadata; stage s's source broadcasts its list, in stage order."""
        result = []
        for stage in range(self.num_stages):
            mine = [list(m.to_wire()) for m in stage_metas] if stage == self.rank else None
            wire = self.group.broadcast_json(mine, src=stage)
            result.append([TensorMeta.from_wire((n, tuple(s), d)) for n, s, d in wire])
        return result

    def send_bucket(self, bucket: BucketPlan, data: torch.Tensor, seal: Callable[[], BucketHeader]) -> "_BroadcastSend":
        """Start broadcasting `bucket`'s payload, then `seal()`'s header; the handle covers both."""
        assert bucket.stage == self.rank, (bucket.stage, self.rank)
        payload = data if data.device == self.device else self._device_payload(data)
        payload_pending = self.group.broadcast(payload, src=self.rank, async_op=True)
        header_t = seal().to_tensor(self.device)  # the checksum is computed while the payload travels
        header_pending = self.group.broadcast(header_t, src=self.rank, async_op=True)
        return _BroadcastSend(payload_pending, header_pending, header_t)

    def _device_payload(self, data: torch.Tensor) -> torch.Tensor:
        # Two device buffers used alternately: the sender waits for bucket k
        # before issuing k+1, so k+2 never overwrites a buffer still on the wire.
        need = data.numel()
        slot = self._send_count % 2
        self._send_count += 1
        if len(self._device_send) <= slot:
            self._device_send.append(self.alloc(need))
        if self._device_send[slot].numel() < need:
            self._device_send[slot] = self.alloc(need)
        out = self._device_send[slot][:need]
        out.copy_(data, non_blocking=True)
        return out

    def recv_bucket(self, bucket: BucketPlan, out: torch.Tensor) -> PendingBucket:
        """Start receiving `bucket` from its stage source into `out[:bucket.nbytes]`."""
        header_t = torch.zeros(4, dtype=torch.int64, device=self.device)
        payload = out[: bucket.nbytes]
        payload_pending = self.group.broadcast(payload, src=bucket.stage, async_op=True)
        header_pending = self.group.broadcast(header_t, src=bucket.stage, async_op=True)
        return _BroadcastReceive(header_pending, header_t, payload_pending, payload)

    def all_gather_json(self, obj: Any) -> list[Any]:
        return self.group.all_gather_json(obj)

    def stop_transfers(self) -> None:
        self.group.close_backend()

    def close(self) -> None:
        self._device_send.clear()
        self.group.close()


class _BroadcastSend:
    """The two broadcasts (payload, header) of one sent bucket."""

    def __init__(self, payload: PendingOp, header: PendingOp, header_t: torch.Tensor) -> None:
        self._payload, self._header, self._header_t = payload, header, header_t  # keep the header alive

    @property
    def done_at(self) -> Optional[float]:
        """perf_counter() when both broadcasts had finished (None while either runs)."""
        ends = (self._payload.done_at, self._header.done_at)
        return None if None in ends else max(ends)

    def wait(self) -> None:
        self._payload.wait()
        self._header.wait()

    def is_completed(self) -> bool:
        return self._payload.is_completed() and self._header.is_completed()


class _BroadcastReceive(PendingBucket):
    """The two broadcasts (header, payload) of one bucket."""

    def __init__(self, header_pending: PendingOp, header: torch.Tensor, payload_pending: PendingOp,
                 payload: torch.Tensor) -> None:
        self._parts = (header_pending, header, payload_pending, payload)

    def wait(self) -> tuple[BucketHeader, torch.Tensor]:
        header_pending, header, payload_pending, payload = self._parts
        header_pending.wait()
        payload_pending.wait()
        return BucketHeader.from_tensor(header), payload

    def is_completed(self) -> bool:
        return self._parts[0].is_completed() and self._parts[2].is_completed()

    @property
    def done_at(self) -> Optional[float]:
        """perf_counter() when the payload and header had both arrived (None before)."""
        ends = (self._parts[0].done_at, self._parts[2].done_at)
        return None if None in ends else max(ends)
