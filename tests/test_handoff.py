"""The two halves of the memory handoff alone: an engine rank's release / restore around a sync, and a
trainer rank's gradient buffers (Megatron DDP) and optimizer state.

An engine released for training cannot compute; restored for a sync that commits it computes with the
new version; restored for a sync that fails, or without a sync, it computes with the version it held,
bit for bit (copied back from the receiver's live copy). A trainer that releases and restores its
memory between two steps trains exactly like one that does not.
"""

from __future__ import annotations

import pytest
import torch

from megatron_sync.engines.handoff import EngineHandoff, TrainerMemory
from tests.support.dist import run_distributed
from tests.support.models import ModelSpec
from tests.support.real_engines import hf_checkpoint, tiny_hf_config

SPEC = ModelSpec("qwen3")

TOKENS = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(3))


def _engine_with(version_shards: dict, version: int):
    from megatron_sync.engines.reference.engine import ReferenceEngine

    engine = ReferenceEngine(tiny_hf_config(SPEC), tp_rank=0, tp_size=1)
    engine.load_shards({k: v.clone() for k, v in version_shards.items()}, version)
    return engine


def _versions() -> list[dict]:
    return [hf_checkpoint(SPEC, seed) for seed in (1, 2)]


def test_a_released_engine_cannot_compute_and_a_committed_sync_brings_the_new_version():
    v1, v2 = _versions()
    engine = _engine_with(v1, 1)
    handoff = EngineHandoff(engine, rank=3, live_shards=lambda v: v1 if v == 1 else None)
    rows = []
    released = handoff.release(handoff=1)
    assert released.role == "engine-handoff" and released.rank == 3
    assert released.bytes == sum(p.nbytes for p in engine.model.parameters()) > 0
    with pytest.raises(RuntimeError, match="not allocated|out of bounds for storage of size 0"):
        engine.logits(TOKENS)
    with handoff.around_sync(2, report=rows.append):
        engine.load_shards({k: v.clone() for k, v in v2.items()}, 2)  # what a committed sync does
    assert torch.equal(engine.logits(TOKENS), _engine_with(v2, 2).logits(TOKENS))
    assert rows[0].bytes == released.bytes and rows[0].phases["restore"] > 0


@pytest.mark.parametrize("how", ["failed-sync", "no-sync"])
def test_an_engine_restored_without_a_committed_version_computes_with_the_one_it_held(how):
    v1, _ = _versions()
    engine = _engine_with(v1, 1)
    before = engine.logits(TOKENS)
    handoff = EngineHandoff(engine, rank=1, live_shards=lambda v: v1 if v == 1 else None)
    handoff.release(handoff=1)
    if how == "no-sync":
        row = handoff.restore()
    else:
        rows = []
        with pytest.raises(RuntimeError, match="bucket 3 was corrupt"):
            with handoff.around_sync(2, report=rows.append):
                raise RuntimeError("bucket 3 was corrupt")  # the sync of version 2 aborted
        (row,) = rows
    assert engine.version == 1 and row.phases["restore"] > 0
    assert torch.equal(engine.logits(TOKENS), before)


def test_an_engine_is_not_released_before_it_holds_a_synced_version():
    v1, _ = _versions()
    engine = _engine_with(v1, 0)  # its checkpoint: the receiver keeps no copy of it
    with pytest.raises(ValueError, match="holds no copy of version 0 .* release the engines only after a sync"):
        EngineHandoff(engine, rank=1, live_shards=lambda v: None).release(handoff=1)
    assert torch.isfinite(engine.logits(TOKENS)).all()


def _train_twice(rank: int, world_size: int, with_handoff: bool) -> dict:
    from tests.support import models
    from tests.support.dist import init_megatron
    from megatron_sync.core.grid import ParallelLayout
    from tests.support.train import make_optimizer, train_step, wrap_in_ddp

    init_megatron(seed=5)
    spec = models.ModelSpec("qwen3")
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=5), spec)
    ddp = wrap_in_ddp(chunks)
    optimizer = make_optimizer(ddp)
    memory = TrainerMemory(ddp, optimizer, rank=rank)
    layout = ParallelLayout.from_megatron()
    rows = []
    for step in range(3):
        tokens = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(step))
        rows.append(memory.restore(step).to_json())
        train_step(ddp, optimizer, tokens, layout)
        if with_handoff:
            rows.append(memory.release(step).to_json())
            rows.append({"grad_storage": sum(b.grad_data.untyped_storage().nbytes() for b in ddp[0].buffers)})
    return {"weights": {n: p.detach().clone() for n, p in ddp[0].named_parameters()}, "rows": rows}


@pytest.mark.multiproc
def test_a_trainer_that_hands_its_memory_over_between_steps_trains_exactly_like_one_that_does_not():
    import json

    plain = run_distributed(_train_twice, 1, False)[0]
    handed = run_distributed(_train_twice, 1, True)[0]
    for name, weight in plain["weights"].items():
        assert torch.equal(weight, handed["weights"][name]), name
    released = [json.loads(r) for r in handed["rows"][1::3]]
    grads = [r["grad_storage"] for r in handed["rows"][2::3]]
    restored = [json.loads(r) for r in handed["rows"][3::3]]
    assert grads == [0, 0, 0]  # nothing of the gradient buffers is held while the engines generate
    assert all(r["role"] == "trainer-handoff" and r["bytes"] > 0 for r in released)
    assert all(r["held_bytes"] > 0 for r in released)  # CPU: Adam's state has nowhere else to go
    assert [r["bytes"] for r in restored] == [r["bytes"] for r in released[:2]]
