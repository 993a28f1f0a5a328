"""Small fakes for the streaming core's tests: a seeded HF stream and a TP-sharding engine."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from megatron_sync.layout.rank import RankLayout
from megatron_sync.layout.regions import Shard, Sharding, TensorSpec
from megatron_sync.layout.roles import RoleLayout
from megatron_sync.layout.staging import HeldShards
from megatron_sync.core.meta import TensorMeta
from examples.tiny.faults import FaultyLayout  # noqa: F401 — the demo's fault hook, used here too

bf16, f32, i64 = torch.bfloat16, torch.float32, torch.int64

# Two pipeline stages of a tiny DeepSeek-like model, in stream order. Mixed
# dtypes exercise the alignment rule; q_a/kv_a exercise keep-together.
STAGES: list[list[TensorMeta]] = [
    [
        TensorMeta("model.embed_tokens.weight", (64, 16), bf16),
        TensorMeta("model.layers.0.input_layernorm.weight", (15,), bf16),
        TensorMeta("model.layers.0.self_attn.q_a_proj.weight", (24, 16), bf16),
        TensorMeta("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (20, 16), bf16),
        TensorMeta("model.layers.0.mlp.gate_proj.weight", (32, 16), f32),
        TensorMeta("model.layers.0.mlp.tokens_seen", (3,), i64),
    ],
    [
        TensorMeta("model.layers.1.self_attn.q_a_proj.weight", (24, 16), bf16),
        TensorMeta("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", (20, 16), bf16),
        TensorMeta("model.layers.1.mlp.down_proj.weight", (16, 32), f32),
        TensorMeta("model.norm.weight", (16,), f32),
        TensorMeta("lm_head.weight", (64, 16), bf16),
    ],
]


def make_tensor(meta: TensorMeta, version: int) -> torch.Tensor:
    """Return a deterministic tensor for (name, version): every version changes every tensor."""
    g = torch.Generator().manual_seed(zlib.crc32(meta.name.encode()) * 1000 + version)
    if meta.dtype.is_floating_point:
        return torch.randn(meta.shape, generator=g).to(meta.dtype)
    return torch.randint(-(2**40), 2**40, meta.shape, generator=g, dtype=meta.dtype)


class FakeStream:
    """HFWeightStream of one stage, yielding seeded tensors for the version set by `set_version`."""

    def __init__(self, stage: int, metas: list[TensorMeta], *,
                 fail_at: Optional[tuple[int, str]] = None) -> None:
        """fail_at=(version, name): raise while producing `name` for that version."""
        self._stage, self._metas, self.version, self._fail_at = stage, metas, 0, fail_at

    @property
    def is_source(self) -> bool:
        return True

    @property
    def stage(self) -> int:
        return self._stage

    def metadata(self) -> list[TensorMeta]:
        return list(self._metas)

    @property
    def phase_seconds(self) -> dict[str, float]:
        return {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.walk()

    def walk(self, into=None, record=None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the seeded tensors; where `into` offers a slot, the tensor is written there and the slot yielded."""
        for meta in self._metas:
            if (self.version, meta.name) == self._fail_at:
                raise RuntimeError(f"fake conversion failure at {meta.name}")
            tensor = make_tensor(meta, self.version)
            slot = into(meta.name) if into is not None else None
            if slot is not None:
                slot.copy_(tensor)
                tensor = slot
            yield meta.name, tensor


def wire_corruption(stream: FakeStream, corrupt: tuple):
    """Return a sender hook (`WeightSender(corrupt_wire=...)`) that hands over a copy of bucket `corrupt[1]` of
    version `corrupt[0]` with one flipped byte (the checksum covers the real bytes, as if the wire or the
    shared memory had flipped it)."""
    def flip(index: int, data: torch.Tensor):
        if [stream.version, index] != list(corrupt):
            return None
        flipped = data.clone()
        flipped[flipped.numel() // 2] ^= 0xFF
        return flipped
    return flip


def fake_specs(metas: list[TensorMeta], tp_size: int) -> list[TensorSpec]:
    """The fake engine's roles: dim 0 split over its ranks when divisible, else replicated."""
    return [TensorSpec(m.name, m.shape, m.dtype,
                       Shard.COLUMN if m.shape and m.shape[0] % tp_size == 0 else Shard.REPLICATED)
            for m in metas]


def shard_rule(meta: TensorMeta, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Return the fake engine's shard of `full` (the layout's region: dim 0 split when divisible)."""
    return Sharding(tp_size).rank_region(fake_specs([meta], tp_size)[0], tp_rank).of(full)


def _exit_after(count: int) -> Callable[[int], None]:
    def hook(n: int) -> None:
        if n > count:
            os._exit(17)
    return hook


class FakeEngine:
    """EngineAdapter sharding by `shard_rule`; optionally dies (os._exit) after N tensors were staged
    or fails its load of one version."""

    def __init__(self, expected: list[TensorMeta], tp_rank: int, tp_size: int,
                 *, die_after_shards: Optional[int] = None, fail_load_at: Optional[int] = None) -> None:
        self._expected, self.tp_rank, self.tp_size = expected, tp_rank, tp_size
        self._fail_load_at = fail_load_at
        self._version = 0
        self.weights: dict[str, torch.Tensor] = {}
        layout = RoleLayout(Sharding(tp_size)).rank_layout(fake_specs(expected, tp_size), tp_rank)
        self._layout = layout if die_after_shards is None else FaultyLayout.wrap(layout, _exit_after(die_after_shards))

    def expected_tensors(self) -> list[TensorMeta]:
        return list(self._expected)

    def rank_layout(self) -> RankLayout:
        return self._layout

    def load_shards(self, shards: dict[str, torch.Tensor], version: int) -> None:
        assert set(shards) == {m.name for m in self._expected}
        if version == self._fail_load_at:
            raise RuntimeError(f"fake load failure at version {version}")
        # a receiver's held set may be kept by reference; any other mapping is copied (the receiver may reuse it)
        self.weights = dict(shards) if isinstance(shards, HeldShards) else {n: t.clone() for n, t in shards.items()}
        self._version = version

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.weights.items()}

    @property
    def version(self) -> int:
        return self._version


def shard_of(engine, name: str, full: torch.Tensor) -> torch.Tensor:
    """Return `engine`'s param of HF tensor `name`, cut from the full tensor through its rank layout
    (the reference engine and the fake store each tensor's region as its own param)."""
    (placement,) = engine.rank_layout().by_name[name]
    return placement.source.of(full.contiguous())
