"""The halves of a sync for transports that move the plan's buckets: the generic sender and receiver.

A bucket transport (broadcast, a test's toy) subclasses `PlanBucketTransport`
and implements only the byte-moving methods of `BucketTransport`; the
`WeightSender` / `WeightReceiver` pair does the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_sync.layout.staging import copies_shards, resolve_staging_sets
from megatron_sync.transports.buckets.receiver import WeightReceiver
from megatron_sync.transports.buckets.sender import WeightSender
from megatron_sync.transports.base import BucketTransport, Commit, Receiver, Sender, Transport

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.engines.base import EngineAdapter
    from megatron_sync.plan.buckets import KeepTogether
    from megatron_sync.trainer.stream import HFWeightStream


class PlanBucketTransport(BucketTransport):
    """A bucket transport whose sender and receiver are the generic `WeightSender` / `WeightReceiver`.

    Its transport ranks are the stage sources first (rank s: stage s), then the inference ranks.
    """

    @property
    def inference_ranks(self) -> range:
        return range(self.num_stages, self.world_size)

    @property
    def is_source(self) -> bool:
        """True on a stage source (transport ranks 0..num_stages - 1)."""
        return self.rank < self.num_stages

    @classmethod
    def make_sender(cls, transport: Optional[Transport], stream: "HFWeightStream",
                    config: "WeightSyncConfig", keep_together: "KeepTogether") -> Sender:
        return WeightSender.connect(stream, transport, bucket_size_bytes=config.bucket_size_bytes,
                                    keep_together=keep_together, metrics_path=config.metrics_path,
                                    checksum=config.checksum)

    def make_receiver(self, engine: "EngineAdapter", config: "WeightSyncConfig", keep_together: "KeepTogether",
                      commit: Optional[Commit] = None) -> Receiver:
        return WeightReceiver(engine, self, bucket_size_bytes=config.bucket_size_bytes,
                              keep_together=keep_together, metrics_path=config.metrics_path, commit=commit,
                              checksum=config.checksum, verify_every=config.verify_every,
                              staging_sets=resolve_staging_sets(config.staging_sets, copies=copies_shards(engine)))
