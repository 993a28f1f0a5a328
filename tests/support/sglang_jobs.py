"""What the live SGLang tests run inside trainer processes: a Megatron job syncing to SGLang servers, and
faults injected at a chosen bucket of a sync (through `TrainerProcess.call("apply", ...)`).

A fault hook rides on the bucket sender's wire hook (`WeightSender(corrupt_wire=...)`), which sees each
bucket just before it is handed to the transport; the hooks here change no byte, they act on a real
server: close its update session, or kill it.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import torch

from megatron_sync.core.wait import poll
from tests.support.models import ModelSpec
from tests.support.real_engines import HFReference, post, tiny_hf_config
from tests.support.sglang_server import serving_problems


def sglang_job_syncs(rank: int, world: int, spec: ModelSpec, parallel: dict, urls: list[str], values: dict,
                     prompts: list[list[int]], versions: int = 3) -> list[dict]:
    """One rank of a Megatron job (`parallel`: init_megatron's tp/pp) of tiny `spec` that trains and syncs
    `versions` versions to the SGLang servers at `urls` (settings `values`). Rank 0 returns, per version, how
    each server's greedy tokens and reported version differ from transformers' on the sent tensors (gathered
    from every rank) and from the trainer's version, and its first prompt's tokens."""
    import torch.distributed as dist

    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.drivers.sync import TrainerWeightSync
    from megatron_sync.settings.config import WeightSyncConfig
    from tests.support import models
    from tests.support.dist import init_megatron
    from tests.support.train import make_optimizer, train_step, wrap_in_ddp

    init_megatron(seed=1234, **parallel)
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=1234), spec)
    layout = ParallelLayout.from_megatron()
    model = wrap_in_ddp(chunks)
    optimizer = make_optimizer(model, lr=2e-2)
    sync = TrainerWeightSync(WeightSyncConfig.from_dict(values), model, layout=layout, hf_config=tiny_hf_config(spec))
    reports = []
    try:
        for step in range(versions):
            if step:
                tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
                train_step(model, optimizer, tokens, layout)
            started = time.perf_counter()  # sync_s: a figure the tests print, never assert on
            sync.sync()
            seconds = time.perf_counter() - started
            everyone: list = [None] * world
            dist.all_gather_object(everyone, {n: t.clone() for n, t in (sync.sender.sent_tensors() or {}).items()})
            if rank == 0:
                reference = HFReference(spec, {n: t for part in everyone for n, t in part.items()})
                version = str(sync.version)
                reports.append({"version": sync.version, "sync_s": seconds,
                                "problems": {url: serving_problems(url, reference, prompts, version) for url in urls},
                                "tokens": reference.greedy(prompts[0], 8)[0]})
            dist.barrier()
    finally:
        sync.close()
    return reports


def end_session_at_bucket(sync: Any, url: str, index: int) -> None:
    """Before bucket `index` of the next sync goes out, close the server's update session (another client
    would): SGLang refuses that bucket with HTTP 400 and its ranks never join its broadcast."""
    def hook(bucket: int, payload: torch.Tensor) -> None:
        if bucket == index:
            post(url, "/end_weight_update", {})
        return None

    sync.sender._corrupt_wire = hook


def kill_at_bucket(sync: Any, url: str, pgid: int, index: int) -> None:
    """Before bucket `index` of the next sync goes out, SIGKILL the server at `url` (process group `pgid`)
    and wait until its port refuses connections."""
    import os
    import signal

    def gone() -> bool:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
        except urllib.error.URLError as e:
            return isinstance(e.reason, ConnectionRefusedError)
        except OSError:
            return True
        return False

    def hook(bucket: int, payload: torch.Tensor) -> None:
        if bucket == index:
            os.killpg(pgid, signal.SIGKILL)
            poll(gone, within=60, what=f"SGLang at {url} refusing connections after SIGKILL", max_pause_s=0.2)
        return None

    sync.sender._corrupt_wire = hook


def clear_faults(sync: Any) -> None:
    """Remove any fault hook (nothing to do when the trainer is not connected)."""
    if sync is not None:
        sync.sender._corrupt_wire = None


def plan_buckets(sync: Any) -> list[dict]:
    """Return the sender's buckets: index, stage and tensor names (where a fault may strike)."""
    return [{"index": b.index, "stage": b.stage, "names": [e.name for e in b.entries]}
            for b in sync.sender.plan.buckets]
