"""Inference job: reference engines (transformers on CPU, their own TP) that receive every sync.

Run under torchrun (one process per inference rank), e.g.
    torchrun --nproc-per-node 2 -m megatron_sync.launch.inference --config configs/demo_qwen3_moe_ep2.yaml
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from megatron_sync.launch.job import JobConfig, job_arg_parser, run_under_torchrun
from megatron_sync.meta import dtype_from_name
from megatron_sync.sync import InferenceWeightSync


def engine_groups(world_size: int, tp: int):
    """Create one process group per engine (collective: every rank creates all); return this rank's."""
    mine = None
    for first in range(0, world_size, tp):
        ranks = list(range(first, first + tp))
        group = dist.new_group(ranks)  # also for tp=1: the engine's step agreement is per engine
        if dist.get_rank() in ranks:
            mine = group
    return mine


class _Terminated(BaseException):
    """SIGTERM from torchrun (another rank of this job died)."""


def _raise_terminated(signum, frame):
    raise _Terminated()


class _DiesMidSync:
    """Fault injection for tests: the wrapped engine's process exits while staging `version`."""

    def __init__(self, engine, version: int):
        self._engine, self._version, self._seen = engine, version, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def shard_of(self, name, full):
        if self._engine.version == self._version - 1:
            self._seen += 1
            if self._seen > 3:  # a few tensors into the sync
                print(f"[inference] fault injection: exiting while receiving version {self._version}", flush=True)
                os._exit(17)
        return self._engine.shard_of(name, full)


def run(job: JobConfig, fault: argparse.Namespace) -> int:
    from megatron_sync.engines.reference import ReferenceEngine
    from megatron_sync.engines.serving import GenerationServer
    from megatron_sync.testing.models import hf_config

    ws = job.weight_sync
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != ws.num_inference_ranks:
        raise ValueError(
            f"the inference job has {world} ranks but weight_sync.num_inference_ranks={ws.num_inference_ranks}; "
            "launch as many inference processes as the config says"
        )
    tp = ws.engine_tp_size
    group = engine_groups(world, tp)
    engine_index, tp_rank = divmod(rank, tp)
    engine = ReferenceEngine(
        hf_config(job.model_spec()), tp_rank=tp_rank, tp_size=tp, group=group, dtype=dtype_from_name(ws.dtype)
    )
    if fault.test_exit_during_version and rank == fault.test_exit_rank:
        engine = _DiesMidSync(engine, fault.test_exit_during_version)
    # Commits go through the generation server, so a version switches only at a step boundary
    # agreed by the engine's ranks, with weight_sync.inflight_policy for requests in flight.
    server = GenerationServer(engine, engine_group=group, inflight_policy=ws.inflight_policy,
                              commit_timeout_s=ws.timeout_s)
    isync = InferenceWeightSync(ws, engine, num_trainer_stages=job.trainer.pp, inference_rank=rank,
                                engine_group=group, commit=server.commit)

    def verify(message: dict) -> None:
        version = message["version"]
        if engine.version != version:
            raise RuntimeError(f"engine {engine_index} is on version {engine.version}, expected {version}")
        logits = engine.logits(torch.tensor(message["tokens"]))
        if tp_rank == 0:
            buffer = io.BytesIO()
            torch.save(logits, buffer)
            isync.transport.group.post(f"logits/{version}/{engine_index}", buffer.getvalue())
        if job.verify.dump_dir:
            folder = os.path.join(job.verify.dump_dir, f"v{version}")
            os.makedirs(folder, exist_ok=True)
            torch.save({"version": engine.version, "shards": engine.state_shards()},
                       os.path.join(folder, f"engine{engine_index}_rank{tp_rank}.pt"))

    # torchrun stops the other ranks of a job with SIGTERM when one rank dies; turn that into an
    # exception so a surviving rank still reports (and, for tests, dumps) the version it holds.
    signal.signal(signal.SIGTERM, _raise_terminated)
    def rollout(message: dict) -> None:
        """Generate while the trainer's next sync arrives; the switch obeys inflight_policy."""
        receiving: list[Future] = []

        def take_in_the_next_sync(step: int) -> None:
            switch = job.verify.rollout_switch_step
            if step == switch:  # a step boundary mid-generation: the trainer's next sync starts now
                sync = isync.next_control()
                assert sync["op"] == "sync", f"expected the next sync during a rollout, got {sync}"
                receiving.append(background.submit(isync.apply, sync["version"]))
            elif step == switch + 1:  # make the switch land at a known boundary
                server.wait_for_commit(engine.version + 1, timeout=ws.timeout_s)

        responses = server.generate(message["prompts"], message["max_new_tokens"], before_step=take_in_the_next_sync)
        for future in receiving:
            future.result(timeout=ws.timeout_s)
        if tp_rank == 0:
            report = [{"tokens": r.tokens, "finish_reason": r.finish_reason, "weight_versions": r.weight_versions,
                       "kv_versions": r.kv_versions, "off_policy_kv": r.off_policy_kv} for r in responses]
            isync.transport.group.post(f"rollout/{message['version']}/{engine_index}", json.dumps(report).encode())

    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-receive")
    try:
        isync.serve({"verify": verify, "rollout": rollout})
    except (Exception, _Terminated) as e:
        print(f"[inference rank {rank}] sync failed ({type(e).__name__}); the engine stays on version "
              f"{engine.version}", flush=True)
        if job.verify.dump_dir:
            torch.save({"version": engine.version, "shards": engine.state_shards()},
                       os.path.join(job.verify.dump_dir, f"survivor_engine{engine_index}_rank{tp_rank}.pt"))
        raise
    finally:
        background.shutdown(wait=False)
        isync.close()
    print(f"[inference rank {rank}] stopped on version {engine.version}", flush=True)
    return 0


def main(argv=None) -> int:
    parser = job_arg_parser("megatron-sync inference job (run under torchrun)")
    faults = parser.add_argument_group("fault injection (tests)")
    faults.add_argument("--test-exit-during-version", type=int, default=0,
                        help="make one inference rank exit while it receives this version")
    faults.add_argument("--test-exit-rank", type=int, default=1, help="the inference rank that exits")
    args = parser.parse_args(argv)
    return run_under_torchrun("inference", args, lambda job: run(job, args))


if __name__ == "__main__":
    sys.exit(main())
