"""`transport: auto`: the transport and bucket size the scale model predicts fastest for a job's layouts.

The trainer decides, once, at start-up (`TrainerWeightSync`): from its parallel layout, the engines'
size (`num_inference_ranks`, `engine_tp_size`), the model's HF config, the declared hardware profile
(`weight_sync.hardware_profile`) and whether the engines share its GPUs (colocated), it plans every
candidate on metadata, predicts each, and takes the fastest (ties: the smaller bucket). It hosts the
sync session with the resolved transport and bucket size; an inference job whose `transport` is `auto`
adopts them from the session's host (`adopt_host_choice`), so both jobs always agree. After every sync
the trainer logs the measured time beside the prediction (`Choice.measured`).

Candidates are the transports that meet at the sync session and can run this job: broadcast; p2p unless
the engines are SGLang servers (SGLang's update API does not expose its ranks' memory); ipc when the
engines are colocated with the trainer on one host (the built ipc hands buckets over through that
host's shared memory). disk_delta meets through files, so the session cannot tell its engines; it is
predicted by the report but not chosen here. `python -m megatron_sync.scale auto` prints the same
choice for a job YAML or for layouts given as flags.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from megatron_sync.core.grid import Grid
from megatron_sync.settings.config import parse_engine
from megatron_sync.settings.sections import resolved
from megatron_sync.scale.hardware import HardwareProfile, profile_named, profile_names
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.plans import ScalePlanner, ipc_refusal
from megatron_sync.scale.timing import SyncOptions, missing_rates, predict

log = logging.getLogger("megatron_sync")
BUCKET_CHOICES_MB = (64.0, 256.0, 1024.0)
CANDIDATES = ("broadcast", "p2p", "ipc", "disk_delta")
AUTO = "auto"


@dataclass(frozen=True)
class Candidate:
    """One (transport, bucket size) the model predicted, or why it was left out."""

    transport: str
    bucket_size_mb: float
    seconds: Optional[float]
    bound: str  # the phase that sets its time, or why it cannot run this job


@dataclass(frozen=True)
class Choice:
    """The resolved transport and bucket size, the prediction behind them, why, and every candidate."""

    transport: str
    bucket_size_mb: float
    predicted_s: float
    bound: str
    profile: str
    candidates: tuple[Candidate, ...]

    @property
    def reason(self) -> str:
        """Return why this candidate won: its prediction against the best of every other transport."""
        others = [c for c in self.candidates if c.seconds is not None and c.transport != self.transport]
        if not others:
            return f"the only transport that can run this job ({self.bound})"
        runner = min(others, key=lambda c: c.seconds)
        return (f"fastest predicted: {self.predicted_s:.3f} s against {runner.transport}'s {runner.seconds:.3f} s "
                f"({runner.seconds / self.predicted_s:.1f}x); bound by {self.bound}")

    def describe(self) -> str:
        rows = "; ".join(f"{c.transport}@{c.bucket_size_mb:g}MiB " + (f"{c.seconds:.3f}s ({c.bound})" if c.seconds
                         is not None else f"not a candidate: {c.bound}") for c in self.candidates)
        return (f"transport auto -> {self.transport}, bucket {self.bucket_size_mb:g} MiB: predicted "
                f"{self.predicted_s:.3f} s on profile {self.profile!r}, {self.reason} [{rows}]")

    def measured(self, version: int, seconds: float) -> str:
        """Return the line logged after a sync: the measured time beside the prediction, and their ratio."""
        return (f"version {version}: synced in {seconds:.3f} s measured; the scale model predicted "
                f"{self.predicted_s:.3f} s (measured / predicted = {seconds / self.predicted_s:.2f}; transport auto: "
                f"{self.transport}, {self.bucket_size_mb:g} MiB buckets, profile {self.profile})")

    def to_wire(self) -> dict:
        return {"transport": self.transport, "bucket_size_mb": self.bucket_size_mb, "predicted_s": self.predicted_s,
                "bound": self.bound, "profile": self.profile,
                "candidates": [[c.transport, c.bucket_size_mb, c.seconds, c.bound] for c in self.candidates]}

    @classmethod
    def from_wire(cls, wire: dict) -> "Choice":
        return cls(wire["transport"], wire["bucket_size_mb"], wire["predicted_s"], wire["bound"], wire["profile"],
                   tuple(Candidate(*c) for c in wire["candidates"]))


def exclusions(*, sglang_engines: bool, trainer: TrainerLayout | None = None,
               fleet: FleetLayout | None = None) -> dict[str, str]:
    """Return transport -> why it cannot run a job with these properties."""
    out = {"disk_delta": "its engines meet through files, so the sync session cannot announce the choice"}
    if sglang_engines:
        out["p2p"] = "the engines are SGLang servers, whose update API does not expose their ranks' memory"
        out["ipc"] = "the engines are SGLang servers, which do not read megatron-sync's shared segments"
    elif trainer is None or fleet is None:
        out["ipc"] = "the layouts are unknown"
    elif ipc_refusal(trainer, fleet):
        out["ipc"] = ipc_refusal(trainer, fleet)
    return out


def choose(planner: ScalePlanner, profile: HardwareProfile, *, excluded: dict[str, str],
           bucket_choices_mb: Sequence[float] = BUCKET_CHOICES_MB, options: SyncOptions = SyncOptions(),
           p2p: dict | None = None) -> Choice:
    """Return the fastest predicted (transport, bucket size) among the candidates (ties: the smaller bucket,
    then the earlier of `CANDIDATES`), with every candidate's prediction; `p2p` holds the P2P schedule's
    settings (window_bytes, arena_bytes, forward)."""
    candidates = []
    for transport in CANDIDATES:
        missing = missing_rates(transport, profile, planner.trainer.tp, options)
        if transport in excluded or missing:
            why = excluded.get(transport) or f"profile {profile.name!r} lacks the measured rates {missing}"
            candidates.append(Candidate(transport, 0.0, None, why))
            continue
        extra = (p2p or {}) if transport == "p2p" else {}
        for mb in bucket_choices_mb:
            prediction = predict(planner.plan(transport, bucket_bytes=int(mb * 2**20), **extra), profile, options)
            candidates.append(Candidate(transport, mb, prediction.seconds, prediction.bound))
    ranked = [c for c in candidates if c.seconds is not None]
    if not ranked:
        raise ValueError(f"transport auto: no transport can run this job on profile {profile.name!r}: "
                         + "; ".join(f"{c.transport}: {c.bound}" for c in candidates))
    best = min(ranked, key=lambda c: (round(c.seconds, 9), c.bucket_size_mb, CANDIDATES.index(c.transport)))
    return Choice(best.transport, best.bucket_size_mb, best.seconds, best.bound, profile.name, tuple(candidates))


def trainer_layout_of(grid: Grid, gpus_per_node: int) -> TrainerLayout:
    """Return the scale model's trainer layout of `grid` (a live job's `ParallelLayout` is one) on nodes of
    `gpus_per_node` GPUs."""
    return TrainerLayout(**Grid.sizes(grid), gpus_per_node=gpus_per_node)


def fleet_layout_of(config: Any, gpus_per_node: int, *, colocated: bool = False) -> FleetLayout:
    """Return the engines' layout from the weight_sync settings (driven engines split the vocabulary)."""
    return FleetLayout(engines=config.num_engines, tp=config.engine_tp_size, vocab_parallel=bool(config.engines),
                       colocated=colocated, gpus_per_node=gpus_per_node)


def p2p_settings(config: Any) -> dict:
    """Return the P2P schedule's settings of `config` (defaults where this version has none)."""
    mib = 2**20
    return {"window_bytes": int(getattr(config, "p2p_window_mb", 0.0) * mib),
            "arena_bytes": int(getattr(config, "p2p_arena_mb", 0.0) * mib),
            "forward": bool(getattr(config, "p2p_forward", True))}


def resolve(config: Any, layout: Any, family: str, hf_config: Any, *, colocated: bool = False) -> Choice:
    """Return the choice for a trainer with `layout` (a ParallelLayout) and `config` (WeightSyncConfig with
    transport auto); `colocated`: the engines run on the trainer's GPUs (a job with a memory handoff).
    ValueError names a missing or unknown hardware profile and the fix."""
    if not config.hardware_profile:
        raise ValueError("transport 'auto' needs weight_sync.hardware_profile (the node type the jobs run on), "
                         f"e.g. hardware_profile: h100; known: {profile_names()}")
    profile = profile_named(config.hardware_profile)
    gpus = int(profile.gpus_per_node.value)
    trainer, fleet = trainer_layout_of(layout, gpus), fleet_layout_of(config, gpus, colocated=colocated)
    planner = ScalePlanner(family, hf_config, trainer, fleet, dtype=config.dtype, draft=config.draft == "sync")
    sglang = any(parse_engine(entry)[0] == "sglang" for entry in config.engines)
    options = SyncOptions(checksum=config.checksum != "none", pause_resume=bool(config.engines),
                          p2p_backend=getattr(config, "p2p_backend", "nixl"),
                          staging_sets=getattr(config, "staging_sets", "auto"))
    return choose(planner, profile, excluded=exclusions(sglang_engines=sglang, trainer=trainer, fleet=fleet),
                  options=options, p2p=p2p_settings(config))


def adopt_host_choice(config: Any, host_expects: dict) -> Any:
    """Return `config` (an inference job's, transport auto) with the transport and bucket size the trainer
    hosting the session resolved; ValueError if the host did not say."""
    transport, bucket = host_expects.get("transport"), host_expects.get("bucket_size_mb")
    if transport in (None, AUTO) or not isinstance(bucket, (int, float)):
        raise ValueError(f"transport auto: the trainer's session did not announce a resolved transport and bucket "
                         f"size (it presented transport={transport!r}, bucket_size_mb={bucket!r}); run both jobs "
                         "with this version of megatron-sync")
    return resolved(config, transport=transport, bucket_size_mb=float(bucket))


def check_settings(config: Any) -> None:
    """Refuse a `hardware_profile` the scale model does not know, naming the known ones (called when the
    settings are made, through `megatron_sync.settings.registry`). A missing profile is refused where the
    choice is made (`resolve`, on the trainer): the inference job adopts the trainer's choice without one."""
    if config.hardware_profile is None:
        return
    if config.hardware_profile not in profile_names():
        raise ValueError(f"hardware_profile={config.hardware_profile!r} is not valid; use one of "
                         f"{list(profile_names())}")
