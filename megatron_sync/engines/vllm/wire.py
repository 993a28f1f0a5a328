"""What the trainer sends through vLLM's weight-transfer routes for backend "megatron_sync".

One home for the wire format, imported by both sides (no vLLM import):
`JoinInfo` is the `init_info` of POST /init_weight_transfer_engine and
`UpdateInfo` the `update_info` of POST /update_weights. vLLM hands the dicts to
`parse_init_info` / `parse_update_info`, which call these constructors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.engines.base import Rendezvous

BACKEND = "megatron_sync"
"""The name vLLM is started with: --weight-transfer-config '{"backend": "megatron_sync"}'."""


@dataclass(frozen=True, kw_only=True)
class JoinInfo:
    """How an engine's workers join the transport group (init_info of /init_weight_transfer_engine)."""

    weight_sync: dict[str, Any]
    """The trainer's WeightSyncConfig fields, backend resolved (validated again on the worker)."""
    num_trainer_stages: int
    """How many trainer stage sources the transport group holds."""
    first_inference_rank: int
    """Inference rank of the engine's worker 0; worker w joins as inference rank first_inference_rank + w."""
    job_id: str = ""
    """The job the workers present at the rendezvous (a fleet's engine: new at every join)."""

    def __post_init__(self) -> None:
        for name in ("num_trainer_stages", "first_inference_rank"):
            value, minimum = getattr(self, name), 1 if name == "num_trainer_stages" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        self.config()  # every setting checked here, so a bad request fails at /init_weight_transfer_engine

    @classmethod
    def of(cls, rendezvous: Rendezvous) -> "JoinInfo":
        """Return the join info of the engine that `rendezvous` places."""
        settings = dataclasses.asdict(rendezvous.config)
        settings["metrics_path"] = None  # a trainer-side path; workers report metrics over the control channel
        settings["engines"] = []  # the trainer drives the engines; workers drive nothing
        return cls(weight_sync=settings, num_trainer_stages=rendezvous.num_trainer_stages,
                   first_inference_rank=rendezvous.first_inference_rank, job_id=rendezvous.job_id)

    def config(self) -> WeightSyncConfig:
        """Return the settings as a validated WeightSyncConfig."""
        return WeightSyncConfig.from_dict(self.weight_sync)

    def to_json(self) -> dict[str, Any]:
        """Return the init_info dict for POST /init_weight_transfer_engine."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class UpdateInfo:
    """The update_info of POST /update_weights: the version the trainer is about to stream."""

    version: int

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"version must be an integer >= 1, got {self.version!r}")

    def to_json(self) -> dict[str, Any]:
        """Return the update_info dict for POST /update_weights."""
        return {"version": self.version}
