"""The trainer's parallel grid, once: its sizes and rank order (`Grid`), one rank's coordinates
(`TrainerRank`), and this process's place in it with its groups (`ParallelLayout`, read from Megatron once
at the edge). The scale model's `TrainerLayout` is a `Grid` placed on nodes; the P2P schedule's holders are
`TrainerRank`s; `ParallelLayout` is a `Grid` (its sizes, validated once) with this rank's coordinates and
groups, and its `.grid` the `Grid` the scale model plans with."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch.distributed as dist

AXES = ("pp", "tp", "cp", "dp", "ep", "etp", "edp")
"""A rank's coordinates, in wire order."""


def positive(owner: str, **values: int) -> None:
    """Raise ValueError naming `owner`.name for any value that is not an integer >= 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class TrainerRank:
    """One trainer rank: its global rank and its coordinates in Megatron's dense and expert grids."""

    rank: int
    pp: int = 0
    tp: int = 0
    cp: int = 0
    dp: int = 0
    ep: int = 0
    etp: int = 0
    edp: int = 0

    @classmethod
    def of(cls, layout: "ParallelLayout", rank: int) -> "TrainerRank":
        """Return the coordinates of global rank `rank` whose parallel layout is `layout`."""
        return cls(rank, **{axis: getattr(layout, f"{axis}_rank") for axis in AXES})

    def to_wire(self) -> list[int]:
        """Return a JSON-able form: [rank, pp, tp, cp, dp, ep, etp, edp]."""
        return [self.rank, *(getattr(self, axis) for axis in AXES)]

    @classmethod
    def from_wire(cls, wire: Sequence[int]) -> "TrainerRank":
        """Return the rank `to_wire` encoded."""
        return cls(*wire)


@dataclass(frozen=True, kw_only=True)
class Grid:
    """Megatron's TP/CP/DP/PP (+VPP) grid and its EP/ETP expert grid: the sizes, and every rank's coordinates
    in Megatron's default rank order (tensor-parallel fastest: tp, cp, dp, pp for dense weights; etp, ep, edp
    within a pipeline stage for experts).

    Within a pipeline stage the expert grid spans the same tp*cp*dp ranks as the dense grid, so ep*etp must
    divide it (edp is the rest), as megatron-core requires. `first_layers` / `last_layers` (0: an even split)
    are Megatron's --decoder-first/last-pipeline-num-layers: the first / last stage holds that many decoder
    layers and the other stages split the rest evenly (without VPP).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    first_layers: int = 0
    last_layers: int = 0

    def __post_init__(self) -> None:
        positive("trainer", tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, vpp=self.vpp, ep=self.ep, etp=self.etp)
        if self.stage_ranks % (self.ep * self.etp):
            raise ValueError(f"trainer: ep*etp={self.ep * self.etp} must divide tp*cp*dp={self.stage_ranks} "
                             "(the expert grid spans a pipeline stage's ranks); change ep, etp or dp")
        if (self.first_layers or self.last_layers) and (self.vpp > 1 or self.pp < 2):
            raise ValueError("trainer: first_layers / last_layers need pp >= 2 and no vpp (as megatron-core)")

    def sizes(self) -> dict[str, int]:
        """Return the grid's fields by name (to build another kind of grid of the same shape)."""
        return {f.name: getattr(self, f.name) for f in fields(Grid)}

    def stage_layers(self, num_layers: int) -> list[int]:
        """Return each decoder layer's stage under `first_layers` / `last_layers` (see the class doc);
        ValueError when the other stages cannot split the rest evenly."""
        ends = [n for n in (self.first_layers, self.last_layers) if n]
        middle = self.pp - len(ends)
        rest = num_layers - sum(ends)
        if rest < 0 or (middle and rest % middle) or (not middle and rest):
            raise ValueError(f"trainer: {num_layers} layers minus first_layers={self.first_layers} and "
                             f"last_layers={self.last_layers} do not split evenly over the other {middle} stages")
        counts = [rest // middle if middle else 0] * self.pp
        if self.first_layers:
            counts[0] = self.first_layers
        if self.last_layers:
            counts[-1] = self.last_layers
        return [stage for stage, n in enumerate(counts) for _ in range(n)]

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

    def describe_axes(self) -> str:
        """Return the axes above 1 and the uneven stages, e.g. "TP=8 PP=8 CP=4 EP=32" ("" for one rank)."""
        parts = [f"{a.upper()}={getattr(self, a)}" for a in ("tp", "pp", "vpp", "cp", "ep", "etp", "dp")
                 if getattr(self, a) > 1]
        parts += [f"{name} stage {n} layers" for name, n in (("first", self.first_layers), ("last", self.last_layers))
                  if n]
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class ParallelLayout(Grid):
    """This trainer rank's place in Megatron's grid (`Grid`: the sizes, validated there once) with its
    coordinates and its groups.

    Built once by `from_megatron()` (or `single()` for one process) and passed
    as an argument to everything that gathers; nothing else reads Megatron's
    globals. Groups are `None` where the axis has size 1.
    """

    tp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0
    tp_group: Any = None
    pp_group: Any = None
    ep_group: Any = None
    etp_group: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for axis in AXES:
            size, rank = getattr(self, axis), getattr(self, f"{axis}_rank")
            if not 0 <= rank < size:
                raise ValueError(f"parallel layout: {axis} rank {rank} is outside size {size}")

    @classmethod
    def at(cls, grid: Grid, **coordinates: Any) -> "ParallelLayout":
        """Return the place in `grid` (its sizes) given by `coordinates` (pp_rank=..., groups)."""
        return cls(**Grid.sizes(grid), **coordinates)

    @property
    def grid(self) -> Grid:
        """Return the grid this rank belongs to (sizes only: the scale model plans with it)."""
        return Grid(**self.sizes())

    @classmethod
    def single(cls) -> "ParallelLayout":
        """Return the layout of a single process that holds the whole model."""
        return cls()

    @classmethod
    def from_megatron(cls) -> "ParallelLayout":
        """Read Megatron's initialized `parallel_state` into a layout (call once, at the edge)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron parallel_state is not initialized; call "
                "parallel_state.initialize_model_parallel(...) before building the weight sync"
            )
        vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1

        def group_if(size: int, getter):
            return getter() if size > 1 else None

        tp = ps.get_tensor_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        ep = ps.get_expert_model_parallel_world_size()
        etp = ps.get_expert_tensor_parallel_world_size()
        layout = cls(
            tp=tp,
            cp=ps.get_context_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            pp=pp,
            vpp=vpp,
            ep=ep,
            etp=etp,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            edp_rank=ps.get_expert_data_parallel_rank(),
            tp_group=group_if(tp, ps.get_tensor_model_parallel_group),
            pp_group=group_if(pp, ps.get_pipeline_model_parallel_group),
            ep_group=group_if(ep, ps.get_expert_model_parallel_group),
            etp_group=group_if(etp, ps.get_expert_tensor_parallel_group),
        )
        if layout.edp != ps.get_expert_data_parallel_world_size():
            raise RuntimeError(f"megatron's expert data-parallel size {ps.get_expert_data_parallel_world_size()} "
                               f"is not tp*cp*dp/(ep*etp) = {layout.edp}: an expert grid this library does not know")
        return layout

    @property
    def gathers_dense(self) -> bool:
        """True when this rank takes part in gathering dense (TP-sharded) tensors.

        Only the first data-parallel (and context-parallel) replica gathers:
        every other replica holds identical copies.
        """
        return self.dp_rank == 0 and self.cp_rank == 0

    @property
    def gathers_experts(self) -> bool:
        """True when this rank takes part in gathering routed experts (first expert-DP replica)."""
        return self.edp_rank == 0

    @property
    def is_stage_source(self) -> bool:
        """True on the pipeline stage's first rank, the one that receives full tensors."""
        return (
            self.tp_rank == 0 and self.cp_rank == 0 and self.dp_rank == 0
            and self.ep_rank == 0 and self.etp_rank == 0 and self.edp_rank == 0
        )


def group_rank0_global(group: Any) -> int:
    """Return the global rank of `group`'s first member (the gather destination)."""
    return dist.get_global_rank(group, 0)
