"""GPU check: weights read after an optimizer step with Megatron's distributed optimizer are fresh.

With `use_distributed_optimizer` + `overlap_param_gather`, `optimizer.step()`
updates only each DP rank's shard; the parameter all-gather normally runs
hidden in the next forward. `ensure_params_gathered` (what the callback calls
before a sync) must make every rank's parameters equal those of the same step
taken with a synchronous all-gather. megatron-core 0.16.1's DDP and optimizer
allocate on CUDA, so this runs only where two GPUs are present.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)


def _step_and_read(rank: int, world_size: int, port: int, overlap: bool, out) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_sync.drivers.callback import ensure_params_gathered
    from tests.support import models

    torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(5)
    spec = models.ModelSpec("qwen3")
    [chunk] = models.build_model_chunks(spec)
    models.load_reference_weights([chunk], models.reference_weights(spec, seed=5), spec)
    chunk.cuda().train()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=overlap, overlap_param_gather=overlap,
    )
    model = DistributedDataParallel(chunk.config, ddp_config, chunk)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, bf16=False), [model]
    )
    tokens = torch.arange(32, device="cuda").reshape(2, 16) % spec.vocab_size
    positions = torch.arange(16, device="cuda").expand(2, 16)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    model(tokens, positions, None, labels=tokens).float().mean().backward()
    model.finish_grad_sync()
    optimizer.step()
    stale = {n: p.detach().cpu().clone() for n, p in chunk.named_parameters()}
    ensure_params_gathered([model])
    fresh = {n: p.detach().cpu().clone() for n, p in chunk.named_parameters()}
    out.put((rank, stale, fresh))
    dist.destroy_process_group()


def _run(overlap: bool) -> dict[int, tuple]:
    import torch.multiprocessing as mp

    from tests.support.dist import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_step_and_read, args=(r, 2, port, overlap, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, stale, fresh = queue.get(timeout=300)
            results[rank] = (stale, fresh)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results


@needs_two_gpus
@pytest.mark.timeout(600)
def test_overlapped_param_gather_is_finished_before_weights_are_read():
    synchronous = _run(overlap=False)
    overlapped = _run(overlap=True)
    for rank in (0, 1):
        _, want = synchronous[rank]
        stale, fresh = overlapped[rank]
        assert all(torch.equal(fresh[n], want[n]) for n in want), f"rank {rank} read stale weights"
    # Without the forced gather, some rank would have read pre-step values for the other rank's shard.
    assert any(not torch.equal(overlapped[r][0][n], synchronous[r][1][n]) for r in (0, 1) for n in synchronous[r][1])
