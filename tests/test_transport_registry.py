"""A transport registered from outside the library drives a full sync through the unchanged drivers.

`StoreTransport` below is a toy: it moves every bucket, the metadata and the
agreement rounds through a plain TCPStore (no collectives at all). Registered
here under the name "store" (at import, so every spawned job that imports this
module has it), it is picked by `weight_sync.transport: store` and the
trainer and inference drivers, the sender and the receiver run unchanged: the
engine's shards equal what the trainer sent, bit for bit.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import pytest
import torch

from megatron_sync.core.meta import TensorMeta
from megatron_sync.transports import register_transport, transport_names
from megatron_sync.transports.base import BucketHeader, PendingBucket
from megatron_sync.transports.buckets.transport import PlanBucketTransport
from megatron_sync.session.control import StoreControlChannel
from megatron_sync.session.board import Board, store_board
from tests.support.fakes import shard_of


class _Done:
    """A send that completed when it was issued (the store holds the bytes)."""

    done_at = None

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _StoreReceive(PendingBucket):
    """A bucket receive that fetches the posted bytes when waited on."""

    def __init__(self, board: Board, key: str, out: torch.Tensor) -> None:
        self.board, self.key, self.out = board, key, out
        self.header: Optional[BucketHeader] = None

    def wait(self) -> tuple[BucketHeader, torch.Tensor]:
        if self.header is None:
            raw = self.board.fetch(self.key)
            head, payload = raw[: raw.index(b"\n")], raw[raw.index(b"\n") + 1:]
            self.out[: len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            self.header = BucketHeader(*json.loads(head))
        return self.header, self.out

    def is_completed(self) -> bool:
        return self.header is not None


class StoreTransport(PlanBucketTransport):
    """Toy transport: buckets, metadata and agreement through the rendezvous store."""

    name = "store"

    def __init__(self, config, session, rank: int, num_stages: int) -> None:
        world = num_stages + config.num_inference_ranks
        # The drivers hand every transport the sync session both jobs were admitted to; its store is this
        # toy's whole medium (keys under the session's id, so no other session's ranks can meet them).
        self.board = store_board(session.store, prefix=f"toy/{session.id}/", rank=rank, timeout_s=config.timeout_s)
        self.rank, self.world_size, self.num_stages = rank, world, num_stages
        self.control = StoreControlChannel(self.board)
        self._gathers = 0
        self._receives: dict[int, int] = {}

    @classmethod
    def connect_trainer(cls, config, layout, *, session) -> "StoreTransport":
        return cls(config, session, layout.pp_rank, layout.pp)

    @classmethod
    def connect_inference(cls, config, *, num_trainer_stages: int, inference_rank: int,
                          session) -> "StoreTransport":
        return cls(config, session, num_trainer_stages + inference_rank, num_trainer_stages)

    @property
    def inference_ranks(self) -> range:
        return range(self.num_stages, self.world_size)

    def all_gather_json(self, obj: Any) -> list[Any]:
        self._gathers += 1
        self.board.post(f"gather/{self._gathers}/{self.rank}", json.dumps(obj).encode())
        return [json.loads(self.board.fetch(f"gather/{self._gathers}/{r}")) for r in range(self.world_size)]

    def exchange_metadata(self, stage_metas: Optional[list[TensorMeta]]) -> list[list[TensorMeta]]:
        if stage_metas is not None:
            self.board.post(f"meta/{self.rank}", json.dumps([list(m.to_wire()) for m in stage_metas]).encode())
        return [[TensorMeta.from_wire((n, tuple(s), d)) for n, s, d in json.loads(self.board.fetch(f"meta/{stage}"))]
                for stage in range(self.num_stages)]

    def send_bucket(self, bucket, data: torch.Tensor, seal) -> _Done:
        header = seal()
        head = json.dumps([header.version, header.index, header.nbytes, header.checksum]).encode()
        self.board.post(f"bucket/{header.version}/{bucket.index}", head + b"\n" + data.numpy().tobytes())
        return _Done()

    def recv_bucket(self, bucket, out: torch.Tensor) -> PendingBucket:
        # Every receiver takes every bucket of every version in order, so it counts versions itself.
        version = self._receives[bucket.index] = self._receives.get(bucket.index, 0) + 1
        return _StoreReceive(self.board, f"bucket/{version}/{bucket.index}", out[: bucket.nbytes])

    def close(self) -> None:
        self.board.close()


register_transport("store", StoreTransport)


def test_the_registry_lists_the_new_name_and_refuses_unknown_ones():
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.transports import get_transport

    assert "store" in transport_names() and get_transport("store") is StoreTransport
    with pytest.raises(ValueError, match=r"transport='pigeon' is not valid; use one of \['broadcast', .*'store'"):
        WeightSyncConfig(transport="pigeon")
    with pytest.raises(TypeError, match="needs a Transport subclass"):
        register_transport("bad", dict)
    with pytest.raises(ValueError, match="transport 'broadcast' is registered already .* under another name"):
        register_transport("broadcast", StoreTransport)  # a name is never silently taken over
    register_transport("store", StoreTransport)  # the same class again (a module imported twice) is no change


def test_the_public_api_is_listed_documented_and_importable():
    import megatron_sync

    for name in megatron_sync.__all__:
        assert getattr(megatron_sync, name).__doc__, name
        assert name in megatron_sync.__doc__, f"{name} is not in the package's docstring"
    with pytest.raises(AttributeError, match="the public API is"):
        megatron_sync.StagingSets  # noqa: B018 — internal: not part of the API


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_toy_transport_drives_a_full_sync_through_the_drivers():
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from tests.support.jobs import run_pair
    from tests.support.models import ModelSpec, hf_config

    case = {"spec": {"family": "qwen3"}, "imports": [__name__], "versions": 2,
            "weight_sync": {"transport": "store", "bucket_size_mb": 0.05}}
    trainer, engines = run_pair(case)
    sent = trainer[0]["sent"]
    for tp_rank, engine in enumerate(engines):
        slicer = ReferenceEngine(hf_config(ModelSpec("qwen3")), tp_rank=tp_rank, tp_size=2)
        assert [h["version"] for h in engine["held"]] == [1, 2]
        for version, held in enumerate(engine["held"]):
            for name, shard in held["shards"].items():
                assert torch.equal(shard, shard_of(slicer, name, sent[version][name])), (version, name)
