"""Megatron's parallel state for one process of a tiny CPU job: initialise (with the CPU shims) and tear down."""

from __future__ import annotations


def init_megatron(tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, etp: int | None = None,
                  seed: int = 1234, timeout_minutes: int = 30) -> None:
    """Initialize Megatron's parallel_state, the CPU shims and all seeds inside a gloo worker."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    from examples.tiny.cpu_shim import apply_cpu_shims

    apply_cpu_shims()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def teardown_megatron() -> None:
    """Undo ``init_megatron`` so another layout can be initialized in the same process."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
