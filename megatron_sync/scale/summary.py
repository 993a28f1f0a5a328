"""What a plan says at full scale, per endpoint: the scale model's summaries of the project's plans."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_sync.scale.layouts import FleetLayout, TrainerLayout


@dataclass
class Endpoint:
    """What one rank moves in one sync: bytes, HF tensors (or ranges), transfer units, the largest piece."""

    rank: int
    node: int
    bytes: int = 0
    tensors: int = 0
    messages: int = 0  # buckets (broadcast), messages (P2P), chunks (disk-delta)
    largest: int = 0
    peers: int = 0  # distinct ranks on the other side


@dataclass
class Traffic:
    """One trainer rank's gather traffic (bytes in the gather dtype), split by whether it crosses nodes."""

    in_intra: int = 0
    in_inter: int = 0
    out_intra: int = 0
    out_inter: int = 0
    converted: int = 0  # HF bytes this rank converts (what it holds in its replica)
    units: int = 0  # gather units (collectives or messages) it takes part in
    merged: int = 0  # bytes of full tensors this rank assembles from several shards (a copy each)


@dataclass
class PlanSummary:
    """Per-sender and per-receiver totals of one transport's plan, and what computing it cost."""

    transport: str
    trainer: TrainerLayout
    fleet: FleetLayout
    model_bytes: int
    tensors: int
    bucket_bytes: int
    senders: list[Endpoint]
    receivers: list[Endpoint]
    gather: dict[int, Traffic]
    shard_bytes: list[int]  # per inference rank: the bytes of its own shards (what it stages and loads)
    shard_tensors: list[int]
    sender_stage: dict[int, int] = field(default_factory=dict)  # broadcast: sender rank -> its stage
    extra: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    peak_bytes: int | None = None
