"""Both sides' parallel layouts as explicit data, read from Megatron once at the edge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """This trainer rank's place in Megatron's TP/CP/DP/PP and EP/ETP/EDP grids, with its groups.

    Built once by `from_megatron()` (or `single()` for one process) and passed
    as an argument to everything that gathers; nothing else reads Megatron's
    globals. Groups are `None` where the axis has size 1.
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    edp: int = 1
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
        for axis in ("tp", "cp", "dp", "pp", "vpp", "ep", "etp", "edp"):
            size, rank = getattr(self, axis), getattr(self, f"{axis}_rank", 0)
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"parallel layout: {axis} rank {rank} is outside size {size}")

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
        return cls(
            tp=tp,
            cp=ps.get_context_parallel_world_size(),
            dp=ps.get_data_parallel_world_size(),
            pp=pp,
            vpp=vpp,
            ep=ep,
            etp=etp,
            edp=ps.get_expert_data_parallel_world_size(),
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
