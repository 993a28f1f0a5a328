"""A trainer job and an inference job run side by side through the library's drivers, for tests.

`run_pair(case)` starts both as separate spawned gloo jobs that meet only at the
weight-sync rendezvous, like the real launched jobs: the trainer builds a tiny
Megatron model (`case["spec"]` under `case["layout"]`), syncs `case["versions"]`
versions through `TrainerWeightSync` with a training step between them, and
returns what it sent; the engines (`ReferenceEngine` via `megatron_sync.serve.join`)
serve through `InferenceWeightSync` until "stop" and return their shards and
logits per version. `case["imports"]` names modules each process imports
first (a test that registers its own family or transport). `case["quantization_config"]`
goes into both jobs' HF config (the trainer quantizes, the engine dequantizes);
with `case["record_unquantized"]` the trainer also returns, per version, the
same gather and conversion without quantization (the reference quantizers' input).
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from tests.support.dist import free_port, run_distributed

EVAL_TOKENS = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(7))


def sync_config(case: dict):
    """Return the WeightSyncConfig both jobs of `case` use."""
    from megatron_sync.config import WeightSyncConfig

    return WeightSyncConfig.from_dict({
        "family": case["spec"]["family"], "master_port": case["port"], "timeout_s": case.get("timeout_s", 60.0),
        "num_inference_ranks": case["engines"] * case["engine_tp"], "engine_tp_size": case["engine_tp"],
        "bucket_size_mb": case.get("bucket_size_mb", 0.25), "dtype": "float32", "backend": "gloo",
        **case.get("weight_sync", {}),
    })


def _setup(case: dict) -> None:
    for module in case.get("imports", ()):
        importlib.import_module(module)


def case_hf_config(case: dict):
    """Return the HF config both jobs of `case` use: the tiny model's, with the case's quantization_config."""
    from tests.support import models

    config = models.hf_config(models.ModelSpec(**case["spec"]))
    if case.get("quantization_config") is not None:
        config.quantization_config = case["quantization_config"]
    return config


def _unquantized_hf_tensors(chunks: list, layout, case: dict) -> dict[str, torch.Tensor]:
    """Return the HF tensors of the chunks' current weights, gathered and converted like a sync but not
    quantized (collective over the trainer job; the stage source gets them)."""
    from converters import get_converter
    from megatron_sync.meta import dtype_from_name
    from megatron_sync.stream import MegatronWeightStream

    config = sync_config(case)
    converter = get_converter(config.family, {**case_hf_config(case).to_dict(), "quantization_config": None},
                              dtype=dtype_from_name(config.dtype))
    return {name: t.clone() for name, t in MegatronWeightStream(chunks, layout, converter)}


def trainer_job(rank: int, world_size: int, case: dict) -> dict[str, Any]:
    """Train and sync; return {"sent": [{name: tensor} per version] (leader), "logits": [...]}."""
    _setup(case)
    from megatron_sync.callback import WeightSyncCallback
    from megatron_sync.parallel import ParallelLayout
    from tests.support import models
    from tests.support.dist import init_megatron
    from tests.support.train import make_optimizer, train_step, wrap_in_ddp

    init_megatron(**case["layout"], seed=3)
    spec = models.ModelSpec(**case["spec"])
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=3), spec)
    layout = ParallelLayout.from_megatron()
    ddp = wrap_in_ddp(chunks)
    optimizer = make_optimizer(ddp, lr=1e-3)
    sent, logits, unquantized = [], [], []
    with WeightSyncCallback.from_config(sync_config(case), ddp, hf_config=case_hf_config(case),
                                        layout=layout) as callback:
        for version in range(1, case["versions"] + 1):
            if version > 1:
                tokens = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(version))
                train_step(ddp, optimizer, tokens, layout)
            callback.syncer.sync()
            logits.append(models.megatron_logits(chunks, EVAL_TOKENS))
            if case.get("record_unquantized"):
                unquantized.append(_unquantized_hf_tensors(chunks, layout, case))
            sender = callback.syncer.sender
            if callback.syncer.is_leader:
                sent.append({e.name: sender.replica.view(e.name).clone()
                             for b in sender.replica.buckets for e in b.entries})
    return {"sent": sent, "logits": logits, "unquantized": unquantized}


def engine_job(rank: int, world_size: int, case: dict) -> dict[str, Any]:
    """Serve syncs until "stop"; return per committed version this rank's shards and the engine's logits."""
    _setup(case)
    from megatron_sync.serve import join
    from megatron_sync.sync import InferenceWeightSync

    config = sync_config(case)
    me = join(config, case_hf_config(case))
    isync = InferenceWeightSync(config, me.engine, num_trainer_stages=case["layout"].get("pp", 1),
                                inference_rank=me.rank, engine_group=me.group)
    held = []
    try:
        while isync.handle(isync.next_control(timeout_s=case.get("timeout_s", 60.0) * 2), {}):
            held.append({"version": me.engine.version, "shards": me.engine.snapshot(),
                         "logits": me.engine.logits(EVAL_TOKENS)})
    finally:
        isync.close()
    return {"held": held}


def run_pair(case: dict, timeout: float = 240.0, *, trainer: Callable = trainer_job,
             engine: Callable = engine_job) -> tuple[list, list]:
    """Run the trainer job and the inference job of `case` concurrently; return both jobs' per-rank results.

    `trainer` / `engine` replace the job functions (module-level, with the same signatures).
    """
    case = {"port": free_port(), "engines": 1, "engine_tp": 2, "layout": {}, "versions": 2, **case}
    trainer_world = _world(case["layout"])
    with ThreadPoolExecutor(max_workers=2) as pool:
        trainers = pool.submit(run_distributed, trainer, trainer_world, case, timeout=timeout)
        engines = pool.submit(run_distributed, engine, case["engines"] * case["engine_tp"], case, timeout=timeout)
        return trainers.result(), engines.result()


def _world(layout: dict) -> int:
    """The trainer world size of a layout: tp * pp * dp (dp 1), at least ep * etp * pp."""
    tp, pp, ep = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)
    etp = layout.get("etp") or tp
    return max(tp * pp, ep * etp * pp)
