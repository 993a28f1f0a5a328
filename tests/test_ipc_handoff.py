"""The memory handoff of a colocated loop, through the drivers: a Megatron trainer and reference engines take turns.

Each step of the trainer's loop (tests/support/jobs.py with `handoff`): `to_training()` (every engine rank
frees the live weights it holds memory for, then the trainer takes back its gradient buffers; the weights it
computes on in the receiver's staging set are that set, which stays), a training step, and
`after_optimizer_step()` (the trainer frees its gradient buffers, then the sync; each engine rank
allocates its weights again as the sync begins, and the sync fills them). A last turn without a sync
makes the engines reload the version they hold. Checked: a released engine cannot compute (its weights
have no storage), each step's rows say how many bytes changed hands, every synced shard is the trainer's,
bit for bit, and the engines' logits equal the trainer's forward after every sync and after the reload.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_sync.engines.reference.engine import ReferenceEngine
from tests.support.fakes import shard_of
from tests.support.jobs import run_pair
from tests.support.models import ModelSpec, hf_config

pytestmark = pytest.mark.multiproc

LOGITS_ATOL = 1e-4  # fp32 engine against Megatron's forward (observed ~2e-6)


def _rows(raw: list[str]) -> list[dict]:
    return [json.loads(r) for r in raw]


@pytest.mark.timeout(400)
def test_colocated_turns_release_restore_and_sync_exactly():
    case = {"spec": {"family": "qwen3_moe"}, "layout": {"ep": 2}, "versions": 3, "handoff": True,
            "weight_sync": {"transport": "ipc", "bucket_size_mb": 0.05}}
    trainer, engines = run_pair(case, timeout=360)
    leader, other = trainer[0], trainer[1]
    slicers = [ReferenceEngine(hf_config(ModelSpec("qwen3_moe")), tp_rank=r, tp_size=2) for r in range(2)]
    live_bytes = [sum(p.nbytes for p in s.model.parameters()) for s in slicers]

    # the engines: released -> no compute; each sync exact; the last turn reloads version 3
    for tp_rank, engine in enumerate(engines):
        assert [(h["op"], h["version"], h["computes"]) for h in engine["handoffs"]] == [
            ("release", 1, False), ("release", 2, False), ("release", 3, False), ("restore", 3, True)]
        assert [h["version"] for h in engine["held"]] == [1, 2, 3]
        for version, held in enumerate(engine["held"]):
            for name, shard in held["shards"].items():
                assert torch.equal(shard, shard_of(slicers[tp_rank], name, leader["sent"][version][name])), name
            diff = float((held["logits"] - leader["logits"][version]).abs().max())
            assert diff <= LOGITS_ATOL, f"version {version + 1}: engine logits differ by {diff}"

    # the rows: who gave what, each turn
    assert len(leader["handoffs"]) == 3
    for turn, step in enumerate(leader["handoffs"]):
        to_training, to_generation = _rows(step["to_training"]), _rows(step["to_generation"])
        released = [r for r in to_training if r["role"] == "engine-handoff"]
        assert [r["rank"] for r in released] == [1, 2]  # the engines' transport ranks
        # every live weight the engine holds memory for, freed; the rest runs on the receiver's staging set
        own = [live - engine["held"][turn]["in_place"] for live, engine in zip(live_bytes, engines)]
        assert all(engine["held"][turn]["in_place"] > 0 for engine in engines)
        assert [r["bytes"] for r in released] == own, released
        (mine,) = [r for r in to_training if r["role"] == "trainer-handoff"]
        assert mine["bytes"] == (0 if turn == 0 else grads(leader)), mine  # the grads it gave up come back
        (given,) = [r for r in to_generation if r["role"] == "trainer-handoff"]
        assert given["bytes"] == grads(leader) > 0 and given["held_bytes"] > 0, given  # CPU: Adam's state stays
        restored = [r for r in to_generation if r["role"] == "engine-handoff"]
        assert [r["bytes"] for r in restored] == own, restored
        assert all(r["phases_s"]["restore"] > 0 for r in restored)
    assert all(len(_rows(step["to_training"])) == 1 for step in other["handoffs"])  # its own row only


def grads(trainer: dict) -> int:
    """The gradient bytes a trainer rank releases (what its first release row says, every turn alike)."""
    return _rows(trainer["handoffs"][0]["to_generation"])[0]["bytes"]
