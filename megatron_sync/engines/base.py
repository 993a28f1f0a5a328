"""What an inference engine exposes to the receiver, and what the trainer may drive around a sync.

An engine rank publishes its layout (`rank_layout()`, `megatron_sync.layout`):
its params, and which region of which full HF checkpoint tensor lands where in
them. Every transport writes through it (a receiver of full tensors copies the
rank's regions, a point-to-point transport writes exactly those bytes) into a
staging set of the rank's params, and calls `load_shards` only once every rank
of the engine holds every param of the new version. Engines never see a
partial version. `snapshot()` lets the receiver undo a load that succeeded
here but failed on another rank, when it holds no copy of the live params.

Engines driven through their own API (vLLM, SGLang) also get an
`EngineClient` on the trainer side: the trainer's leader starts the engine's
workers joining the transport group (`join`, with the `Rendezvous` that
`plan_rendezvous` assigns each engine), and calls its hooks around every sync
(pause and open the engine's update session, start its receive, close the
session and resume).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from megatron_sync.layout.rank import RankLayout
from megatron_sync.core.meta import TensorMeta

if TYPE_CHECKING:
    from megatron_sync.settings.config import WeightSyncConfig


@runtime_checkable
class EngineAdapter(Protocol):
    """What an engine rank implements so the receiver can update it."""

    def expected_tensors(self) -> list[TensorMeta]:
        """Return the full (unsharded) HF tensors this engine (all its ranks together) loads."""

    def rank_layout(self) -> RankLayout:
        """Return this rank's params and where each region of each full HF tensor it needs lands in them."""

    def load_shards(self, shards: Mapping[str, torch.Tensor], version: int) -> None:
        """Make `shards` (one tensor per param of `rank_layout()`, by param name) the live weights, as
        `version`. `HeldShards` (a broadcast, ipc or P2P receiver's staging set) may be computed on in place: the
        receiver leaves them untouched until the engine runs on another version; copy any other mapping. A
        `StagedCopy` (a receiver's only staging set, `staging_sets: 1`) is overwritten by the next version and
        carries the live version's host copy as `.previous`, for an engine that must undo a load part-way."""

    # An engine that copies every version into weights of its own (vLLM) says so with a class attribute
    # `copies_shards = True` (read with `layout.staging.copies_shards`; absent: False): `staging_sets: auto`
    # then stages each version in one set, where a second would only be a rollback source on the device.

    def snapshot(self) -> Optional[Mapping[str, torch.Tensor]]:
        """Return the live params (what `load_shards` takes back to undo a load), or None when this engine
        cannot snapshot (a load that fails elsewhere then leaves this rank ahead)."""

    @property
    def version(self) -> int:
        """The version of the weights in use now (0 before the first sync)."""


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where one driven engine's workers join the transport group, and the settings both sides share."""

    config: "WeightSyncConfig"
    """The trainer's settings, with `backend` resolved to "gloo" or "nccl"."""
    num_trainer_stages: int
    """How many trainer stage sources the transport group holds (they come first)."""
    first_inference_rank: int
    """Inference rank (0-based among all inference ranks) of this engine's worker 0."""
    num_workers: int
    """How many workers (vLLM: TP*PP*DP ranks) this engine contributes; worker w is inference rank
    first_inference_rank + w."""
    job_id: str = ""
    """The job the engine's workers present at the rendezvous. A fleet's engine gets a new one at every join,
    so a restarted engine is admitted as its engine's next generation."""

    def worker_of(self, inference_rank: int) -> Optional[int]:
        """Return the worker index of `inference_rank` in this engine, or None when it is another's."""
        worker = inference_rank - self.first_inference_rank
        return worker if 0 <= worker < self.num_workers else None


def plan_rendezvous(config: "WeightSyncConfig", num_trainer_stages: int, worker_counts: Sequence[int],
                    backend: str) -> list[Rendezvous]:
    """Return each engine's Rendezvous: engines take consecutive inference ranks, in the order given.

    Raises ValueError when the engines' workers do not add up to
    `config.num_inference_ranks` (the trainer would wait for ranks that never come).
    """
    total = sum(worker_counts)
    if total != config.num_inference_ranks:
        raise ValueError(
            f"the engines have {list(worker_counts)} workers ({total} in all) but "
            f"weight_sync.num_inference_ranks={config.num_inference_ranks}; set it to {total}"
        )
    resolved = dataclasses.replace(config, backend=backend)
    if config.fleet:  # each engine its own link: engine id = its index, its workers inference ranks 0..tp-1
        return [fleet_rendezvous(resolved, num_trainer_stages, engine, count)
                for engine, count in enumerate(worker_counts)]
    firsts = [sum(worker_counts[:i]) for i in range(len(worker_counts))]
    return [Rendezvous(config=resolved, num_trainer_stages=num_trainer_stages, first_inference_rank=first,
                       num_workers=count) for first, count in zip(firsts, worker_counts)]


def fleet_rendezvous(config: "WeightSyncConfig", num_trainer_stages: int, engine: int,
                     num_workers: int) -> Rendezvous:
    """Return the Rendezvous of driven engine `engine` of a fleet (`config.backend` resolved), with a new job id.

    Raises ValueError when the engine's workers are not one engine of `engine_tp_size` ranks.
    """
    if num_workers != config.engine_tp_size:
        raise ValueError(f"fleet engine {engine} has {num_workers} workers but weight_sync.engine_tp_size="
                         f"{config.engine_tp_size}: every engine of a fleet is one engine of engine_tp_size ranks")
    return Rendezvous(config=dataclasses.replace(config, engine_id=engine), num_trainer_stages=num_trainer_stages,
                      first_inference_rank=0, num_workers=num_workers, job_id=f"engine{engine}-{uuid.uuid4().hex[:8]}")


class Joining(Protocol):
    """An engine's join of the transport group, under way."""

    def wait(self, timeout_s: float) -> None:
        """Return once the engine's workers joined; raise (naming the engine) if they failed."""


@runtime_checkable
class EngineClient(Protocol):
    """Trainer-side handle of an engine driven over its own API (vLLM, SGLang); only the leader calls it.

    Order: `num_workers` and `join` once (the join runs while the trainer
    connects); per sync `before_sync` -> `begin_transfer` -> (the trainer
    sends) -> `after_sync`; `close` at the end. The engine's workers are
    transport ranks like any inference rank; the trainer learns a sync's
    outcome from the transport's agreement, not from these calls.
    """

    url: str
    """Where the engine's API answers, e.g. "http://10.0.0.7:8000"."""

    def num_workers(self) -> int:
        """Return how many inference ranks this engine's workers occupy (checks the engine can take part)."""

    def join(self, rendezvous: Rendezvous) -> Joining:
        """Start the engine's workers joining the transport group; return at once (raise on a refusal)."""

    def before_sync(self, version: int) -> None:
        """Pause generation as the in-flight policy says and open an update session (nothing moves yet)."""

    def begin_transfer(self, version: int) -> None:
        """Start the engine's receive of `version` in the background (its workers block while buckets arrive)."""

    def after_sync(self, version: int, ok: bool) -> None:
        """Close the session: if `ok`, tag the engine with `version` and reset its caches as the policy
        says; either way resume generation (after a failure the engine serves the previous version)."""

    def describe_rank(self, inference_rank: int) -> Optional[str]:
        """Return e.g. "vLLM worker 1 of http://..." when `inference_rank` is this engine's, else None."""

    def close(self) -> None:
        """Let the engine's workers leave the transport group (the engine keeps serving its weights)."""
