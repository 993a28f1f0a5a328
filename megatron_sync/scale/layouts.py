"""The two sides of a sync at full scale, as plain data: the trainer's parallel layout, the engine fleet, and
where the fleet's GPUs are.

Neither needs a process: `TrainerLayout` is the trainer's grid (`core.grid.Grid`: every rank's
coordinates in Megatron's default rank order) and the node each rank runs on; `FleetLayout` says how many
engines of how many ranks receive, how each engine splits its tensors (`EngineLayout`: vLLM's / SGLang's
TP with expert parallelism, or data-parallel attention with experts spread over every rank), and whether
the engines share the trainer's GPUs (colocated) or follow them on GPUs of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_sync.layout.rank import RankLayout, one_param_per_tensor
from megatron_sync.layout.regions import VOCAB_BLOCKS, VOCAB_WHOLE, Region, Sharding, TensorSpec, expert_range
from megatron_sync.core.grid import Grid, positive


@dataclass(frozen=True, kw_only=True)
class TrainerLayout(Grid):
    """The trainer's grid (`core.grid.Grid`: sizes, rank order, uneven stages) on nodes of `gpus_per_node`
    GPUs."""

    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("trainer", gpus_per_node=self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def describe(self) -> str:
        return f"{self.describe_axes() or 'single rank'}, {self.world} GPUs on {self.nodes} nodes"


class EngineLayout:
    """How one engine of `dp * tp` ranks holds every HF tensor.

    Dense tensors (attention, shared experts, norms, embeddings) are split by role over `tp` ranks
    (`Sharding`) and, with `dp` > 1, replicated on each of the `dp` data-parallel attention groups of
    `tp` consecutive ranks (vLLM's `--data-parallel-size` with `--enable-expert-parallel`). Routed
    experts are whole on one rank each, spread over all `dp * tp` ranks, with `expert_parallel`
    (`expert_range`), or split by role over `tp` without it.
    """

    def __init__(self, sharding: Sharding, *, dp: int = 1, expert_parallel: bool = False):
        if dp > 1 and not expert_parallel:
            raise ValueError(f"an engine with dp={dp} attention groups and no expert parallelism is {dp} "
                             "replicas: describe it as more engines (engines=...) or add ep")
        self.sharding, self.dp, self.expert_parallel = sharding, dp, expert_parallel

    @property
    def ranks(self) -> int:
        return self.dp * self.sharding.tp_size

    def region(self, spec: TensorSpec, rank: int, num_experts: int = 0) -> Optional[Region]:
        """Return the region of `spec` rank `rank` holds (None: another rank's expert)."""
        if self.expert_parallel and spec.expert is not None:
            held = expert_range(num_experts, rank, self.ranks)
            return Region.whole(spec.shape) if spec.expert in held else None
        return self.sharding.rank_region(spec, rank % self.sharding.tp_size)

    def rank_layout(self, specs: Sequence[TensorSpec], rank: int) -> RankLayout:
        """Return rank `rank`'s layout: each HF tensor's region stored under its own name."""
        num_experts = 1 + max((s.expert for s in specs if s.expert is not None), default=-1)
        return one_param_per_tensor(specs, lambda spec: self.region(spec, rank, num_experts))


@dataclass(frozen=True, kw_only=True)
class FleetLayout:
    """`engines` identical engines of `dp * tp` ranks each on nodes of `gpus_per_node` GPUs.

    `expert_parallel`: routed experts are whole on one rank each (vLLM / SGLang with EP), spread over
    the engine's `dp * tp` ranks, instead of a TP slice of every expert. `dp`: data-parallel attention
    groups per engine (needs `expert_parallel`). `vocab_parallel`: embeddings and lm_head are split by
    rows (vLLM, SGLang) instead of whole on every rank (the reference engine). `colocated`: engine rank
    r runs on trainer GPU r (the engines take turns with the trainer on its GPUs); otherwise the engines'
    GPUs follow the trainer's, inference rank r on GPU `trainer.world + r` of one numbering of nodes.
    """

    engines: int = 1
    tp: int = 1
    dp: int = 1
    expert_parallel: bool = False
    vocab_parallel: bool = True
    colocated: bool = False
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        positive("fleet", engines=self.engines, tp=self.tp, dp=self.dp, gpus_per_node=self.gpus_per_node)
        if self.dp > 1 and not self.expert_parallel:
            raise ValueError(f"fleet: dp={self.dp} attention groups without ep are {self.dp} replicas; "
                             "use engines= for replicas, or add ep for data-parallel attention with expert parallelism")

    @property
    def engine_ranks(self) -> int:
        """Ranks of one engine (dp * tp)."""
        return self.dp * self.tp

    @property
    def ranks(self) -> int:
        return self.engines * self.engine_ranks

    def engine_layout(self, num_kv_heads: int) -> EngineLayout:
        """Return how each engine holds the tensors (vocabulary in padded blocks unless kept whole)."""
        vocab = VOCAB_BLOCKS if self.vocab_parallel else VOCAB_WHOLE
        return EngineLayout(Sharding(self.tp, num_kv_heads=num_kv_heads, vocab=vocab), dp=self.dp,
                            expert_parallel=self.expert_parallel)

    def first_gpu(self, trainer: TrainerLayout) -> int:
        """Return the GPU (in one numbering of every node's GPUs) of inference rank 0."""
        if self.colocated and self.ranks > trainer.world:
            raise ValueError(f"colocated engines run on the trainer's GPUs: {self.ranks} inference ranks do not "
                             f"fit on {trainer.world} trainer GPUs; use fewer engines or separate nodes")
        return 0 if self.colocated else trainer.world

    def node_of(self, rank: int, trainer: TrainerLayout) -> int:
        """Return the node inference rank `rank` runs on (the trainer's nodes are 0 .. trainer.nodes - 1)."""
        return (self.first_gpu(trainer) + rank) // self.gpus_per_node

    def nodes(self, trainer: TrainerLayout) -> int:
        """Return how many nodes the fleet's GPUs span."""
        first = self.first_gpu(trainer)
        return (first + self.ranks - 1) // self.gpus_per_node - first // self.gpus_per_node + 1

    def shares_nodes(self, trainer: TrainerLayout) -> bool:
        """True when some inference rank runs on a node that also runs trainer ranks."""
        return self.node_of(0, trainer) < trainer.nodes

    def describe(self, trainer: TrainerLayout | None = None) -> str:
        how = (f" DP={self.dp}" if self.dp > 1 else "") + (" EP" if self.expert_parallel else "") + \
              ("" if self.vocab_parallel else " (whole vocab)")
        where = " colocated on the trainer's GPUs" if self.colocated else ""
        nodes = self.nodes(trainer) if trainer else math.ceil(self.ranks / self.gpus_per_node)
        return f"{self.engines} x TP={self.tp}{how}, {self.ranks} GPUs on {nodes} nodes{where}"
