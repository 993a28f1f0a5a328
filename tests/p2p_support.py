"""Test support for the P2P path: tiny plans, seeded tensors, staging checks, two jobs side by side."""

from __future__ import annotations

import torch

import re
from typing import Callable, Sequence

from megatron_sync.layout.rank import ParamSpec, Placement, RankLayout
from megatron_sync.layout.regions import VOCAB_BLOCKS, VOCAB_WHOLE, Sharding, TensorSpec
from megatron_sync.layout.roles import RoleLayout

Engine = Callable[[list[TensorSpec], int], list[RankLayout]]  # (specs, kv heads) -> one layout per rank

# A test stand-in for an engine that fuses tensors into one param (vLLM's qkv_proj, gate_up_proj, experts'
# w13/w2): the real vLLM layout is recorded from vLLM's loaders (tests/test_vllm_layout.py); these rules
# only give the planner params that several HF tensors land in.
FUSE_RULES = (
    (r"(?P<p>.*\.self_attn)\.[qkv]_proj\.(?P<w>weight|bias)", "{p}.qkv_proj.{w}"),
    (r"(?P<p>.*\.mlp(?:\.shared_experts)?)\.(?:gate|up)_proj\.weight", "{p}.gate_up_proj.weight"),
    (r"(?P<p>.*\.mlp\.experts)\.\d+\.(?:gate|up)_proj\.weight", "{p}.w13_weight"),
    (r"(?P<p>.*\.mlp\.experts)\.\d+\.down_proj\.weight", "{p}.w2_weight"),
)


def fused(layout: RankLayout, rules=FUSE_RULES) -> RankLayout:
    """Return `layout` with the params whose names fullmatch one of `rules` stacked on dim 0, in layout
    order, into one param named by the rule's template."""
    key_of = {}
    for param in layout.params:
        for pattern, template in rules:
            m = re.fullmatch(pattern, param.name)
            if m:
                key_of[param.name] = template.format(**m.groupdict())
                break
    groups: dict[str, list[ParamSpec]] = {}
    for param in layout.params:
        groups.setdefault(key_of.get(param.name, param.name), []).append(param)
    params, shift = [], {}
    for key, members in groups.items():
        rows, at = 0, 0
        for m in members:
            shift[m.name] = (key, at)
            rows += m.shape[0] if m.shape else 1
            at += m.nbytes
        params.append(ParamSpec(key, (rows, *members[0].shape[1:]), members[0].dtype))
    placements = tuple(Placement(p.name, p.source, shift[p.param][0], shift[p.param][1] + p.offset, p.nbytes)
                       for p in layout.placements)
    return RankLayout(tuple(params), placements)


def ref(tp: int) -> Engine:
    """The reference engine's layout at `tp` (vocabulary whole on every rank)."""
    return lambda specs, kv: [RoleLayout(Sharding(tp, kv, VOCAB_WHOLE)).rank_layout(specs, r) for r in range(tp)]


def fusing(tp: int, *, expert_parallel: bool = False) -> Engine:
    """A vLLM-shaped layout at `tp`: vocabulary in padded blocks, projections fused, experts by EP if asked."""
    def make(specs, kv):
        engine = RoleLayout(Sharding(tp, kv, VOCAB_BLOCKS), expert_parallel=expert_parallel)
        return [fused(engine.rank_layout(specs, r)) for r in range(tp)]
    return make


def seeded_full(spec: TensorSpec) -> torch.Tensor:
    """Return a full tensor for `spec` whose values depend only on its name."""
    import zlib

    gen = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()))
    return torch.randn(spec.shape, generator=gen).to(spec.dtype)


SENTINEL = 0xA5


def misplaced(layout: RankLayout, staging: torch.Tensor, specs: Sequence[TensorSpec]) -> list[str]:
    """Return the HF names whose regions in `staging` differ from their seeded full tensors."""
    by_name = {s.name: s for s in specs}
    return sorted({p.name for p in layout.placements
                   if not torch.equal(layout.destination(staging, p).cpu(), p.source.of(seeded_full(by_name[p.name])))})


def untouched_outside_placements(layout, staging: torch.Tensor) -> bool:
    """True when every staging byte outside the layout's placements still holds SENTINEL."""
    offsets = layout.param_offsets
    mask = torch.ones(staging.numel(), dtype=torch.bool)
    for p in layout.placements:
        at = offsets[p.param] + p.offset
        mask[at:at + p.nbytes] = False
    return bool((staging[mask] == SENTINEL).all())


def run_side_by_side(jobs, timeout: float) -> list[list]:
    """Run several `run_distributed` jobs at once (e.g. a trainer job and an inference job); return their results.

    `jobs` are (fn, world_size, args) triples; each job gets its own default process group.
    The first job to fail raises once every job has stopped (each is bounded by `timeout`).
    """
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.dist import run_distributed

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run_distributed, fn, world, *args, timeout=timeout) for fn, world, args in jobs]
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error
    return [f.result() for f in futures]


def trainer_grid(tp=1, dp=1, pp=1, ep=1, etp=1):
    """Return the trainer ranks of a Megatron-like grid: dense tp-dp-pp, expert etp-ep-edp-pp."""
    from megatron_sync.core.grid import TrainerRank

    per_stage = tp * dp
    assert per_stage % (ep * etp) == 0
    ranks = []
    for rank in range(per_stage * pp):
        pp_rank, local = divmod(rank, per_stage)
        dp_rank, tp_rank = divmod(local, tp)
        edp_rank, rest = divmod(local, ep * etp)
        ep_rank, etp_rank = divmod(rest, etp)
        ranks.append(TrainerRank(rank, pp=pp_rank, tp=tp_rank, dp=dp_rank, ep=ep_rank, etp=etp_rank, edp=edp_rank))
    return ranks


def units_of_specs(specs: Sequence[TensorSpec], *, pp: int = 1, ep: int = 1, tp: int = 1, etp: int = 1):
    """Return one source unit per HF tensor: layers spread over `pp` stages, routed experts over `ep` owners,
    gathered over TP (dense) or ETP (experts) when those are > 1."""
    from megatron_sync.transports.p2p.holders import SourceUnit

    layers = 1 + max((int(m.group(1)) for s in specs if (m := re.search(r"layers\.(\d+)\.", s.name))), default=0)
    experts = 1 + max((s.expert for s in specs if s.expert is not None), default=0)
    units = []
    for s in specs:
        m = re.search(r"layers\.(\d+)\.", s.name)
        stage = int(m.group(1)) * pp // layers if m else (pp - 1 if "lm_head" in s.name or s.name == "model.norm.weight" else 0)
        owner = None if s.expert is None else s.expert * ep // experts
        gather = ("etp" if etp > 1 else None) if owner is not None else ("tp" if tp > 1 and len(s.shape) > 1 else None)
        units.append(SourceUnit(f"u:{s.name}", stage, ((s.name, s.nbytes),), owner, gather))
    return sorted(units, key=lambda u: u.stage)


def schedule_of(family: str, engines: Sequence[Engine], grid: dict, *, kv: int = 2, units: dict | None = None,
                **options):
    """Return (specs, schedule) for a tiny model of `family`, engine layout factories and a trainer grid."""
    from megatron_sync.convert import get_converter
    from megatron_sync.transports.p2p.build import build_schedule
    from megatron_sync.transports.p2p.schedule import InferenceRank, ScheduleOptions
    from tests.support import models

    cfg = models.hf_config(models.ModelSpec(family=family, num_kv_heads=kv))
    specs = get_converter(family, cfg).tensor_specs()
    receivers = tuple(InferenceRank(e, r, layout) for e, make in enumerate(engines)
                      for r, layout in enumerate(make(specs, kv)))
    ranks = trainer_grid(**grid)
    unit_kw = {k: grid[k] for k in ("pp", "ep", "tp", "etp") if k in grid}
    return specs, build_schedule(units_of_specs(specs, **{**unit_kw, **(units or {})}), ranks, specs, receivers,
                                 ScheduleOptions(**options))
