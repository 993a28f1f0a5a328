"""A model family the project does not ship, added in one place, syncs end to end.

The family is registered right here (one `register_family` call at import, so
every spawned job that imports this module knows it): Mistral's HF layout is
Llama's under another `model_type`. Nothing else changes: the tiny Megatron
model, the trainer's conversion, the plan, and the reference engine's
sharding all read the family's tables. A trainer at TP=2 syncs two versions
(one optimizer step apart) to one engine of TP=2; every engine shard equals
the engine's slice of the tensor the trainer sent, bit for bit, and the
engine's logits equal Megatron's.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.fakes import shard_of

import megatron_sync.convert
from megatron_sync.convert import Family

MISTRAL = Family(
    name="mistral",
    rules=megatron_sync.convert.FAMILIES["llama"].rules,
    hf_tensors=megatron_sync.convert.FAMILIES["llama"].hf_tensors,
    skip=megatron_sync.convert.FAMILIES["llama"].skip,
    hf_model_types=("mistral",),
)
megatron_sync.convert.register_family(MISTRAL)

LOGITS_ATOL = 1e-4  # float32, different kernels and reduction order; observed ~2e-6


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_registered_family_syncs_end_to_end():
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from tests.support.jobs import run_pair
    from tests.support.models import ModelSpec, hf_config

    case = {"spec": {"family": "mistral"}, "layout": {"tp": 2}, "imports": [__name__], "versions": 2}
    trainer, engines = run_pair(case)
    sent = trainer[0]["sent"]
    assert len(sent) == 2 and any(not torch.equal(sent[0][n], sent[1][n]) for n in sent[0])
    assert "model.layers.0.self_attn.q_proj.weight" in sent[0]
    config = hf_config(ModelSpec("mistral"))
    assert config.model_type == "mistral"
    for tp_rank, engine in enumerate(engines):
        slicer = ReferenceEngine(config, tp_rank=tp_rank, tp_size=2)
        assert [h["version"] for h in engine["held"]] == [1, 2]
        for version, held in enumerate(engine["held"]):
            assert set(held["shards"]) == set(sent[version])
            for name, shard in held["shards"].items():
                assert torch.equal(shard, shard_of(slicer, name, sent[version][name])), (version, name)
            diff = (held["logits"] - trainer[0]["logits"][version]).abs().max().item()
            assert diff < LOGITS_ATOL, (version, diff)
