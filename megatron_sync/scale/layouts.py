"""The two sides of a sync at full scale, as plain data: the trainer's parallel layout and the engine fleet.

Neither needs a process: `TrainerLayout` lists every trainer rank's coordinates in Megatron's dense and
expert grids (Megatron's default rank order, tensor-parallel fastest: tp, cp, dp, pp for dense weights;
etp, ep, edp within a pipeline stage for experts) and the node it runs on; `FleetLayout` says how many
engines of how many ranks receive, and how each engine splits routed experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_sync.transports.p2p.assign import TrainerRank


def _positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TrainerLayout:
    """Megatron's TP/CP/DP/PP (+VPP) grid and its EP/ETP expert grid, on nodes of `gpus_per_node` GPUs.

    Within a pipeline stage the expert grid spans the same tp*cp*dp ranks as the dense grid, so
    ep*etp must divide it (edp is the rest), as megatron-core requires.
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        _positive("trainer", tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, vpp=self.vpp, ep=self.ep,
                  etp=self.etp, gpus_per_node=self.gpus_per_node)
        if self.stage_ranks % (self.ep * self.etp):
            raise ValueError(f"trainer: ep*etp={self.ep * self.etp} must divide tp*cp*dp={self.stage_ranks} "
                             "(the expert grid spans a pipeline stage's ranks); change ep, etp or dp")

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage (tp * cp * dp)."""
        return self.tp * self.cp * self.dp

    @property
    def world(self) -> int:
        return self.stage_ranks * self.pp

    @property
    def edp(self) -> int:
        return self.stage_ranks // (self.ep * self.etp)

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def rank_of(self, rank: int) -> TrainerRank:
        """Return the coordinates of global rank `rank`."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        local = rank % self.stage_ranks  # the expert grid within the stage: etp fastest, then ep, then edp
        etp, ep, edp = local % self.etp, (local // self.etp) % self.ep, local // (self.etp * self.ep)
        return TrainerRank(rank, pp=pp, tp=tp, cp=cp, dp=dp, ep=ep, etp=etp, edp=edp)

    def ranks(self) -> list[TrainerRank]:
        """Return every trainer rank's coordinates, by global rank."""
        return [self.rank_of(r) for r in range(self.world)]

    def stage_source(self, stage: int) -> int:
        """Return the global rank that gathers stage `stage` for the bucket transports (its first rank)."""
        return stage * self.stage_ranks

    def describe(self) -> str:
        parts = [f"{a.upper()}={getattr(self, a)}" for a in ("tp", "pp", "vpp", "cp", "ep", "etp", "dp")
                 if getattr(self, a) > 1]
        return f"{' '.join(parts) or 'single rank'}, {self.world} GPUs on {self.nodes} nodes"


@dataclass(frozen=True, kw_only=True)
class FleetLayout:
    """`engines` identical engines of `tp` ranks each on nodes of `gpus_per_node` GPUs.

    `expert_parallel`: each rank holds whole routed experts (vLLM / SGLang with EP = TP) instead of
    a TP slice of every expert. `vocab_parallel`: embeddings and lm_head are split by rows (vLLM,
    SGLang) instead of whole on every rank (the reference engine).
    """

    engines: int = 1
    tp: int = 1
    expert_parallel: bool = False
    vocab_parallel: bool = True
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        _positive("fleet", engines=self.engines, tp=self.tp, gpus_per_node=self.gpus_per_node)

    @property
    def ranks(self) -> int:
        return self.engines * self.tp

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def describe(self) -> str:
        how = (" EP" if self.expert_parallel else "") + ("" if self.vocab_parallel else " (whole vocab)")
        return f"{self.engines} x TP={self.tp}{how}, {self.ranks} GPUs on {self.nodes} nodes"
