"""Multi-token-prediction (MTP) draft layers: synced with the main weights, in the same version, exactly.

Megatron's MTP block (`mtp.layers.{d}`, on the last pipeline stage) becomes the checkpoint's draft
layer `model.layers.{num_hidden_layers + d}` (megatron_sync.convert/mtp.py). Checked here:

- the draft's next-token logits, computed by the reference engine from the converted tensors
  (its own MTP forward, `engines/draft.py`), equal Megatron's own MTP forward on the same tokens,
  for trainer layouts TP=2, EP=2 and PP=2 (the draft on the last stage); a negative control (the
  two halves of eh_proj swapped, i.e. embedding and hidden state in the wrong order) moves them by
  orders of magnitude more than the tolerance;
- end to end through the drivers: a trainer syncs two versions (a training step apart, which moves
  the MTP block too) to a reference engine of TP=2; every engine shard, draft included, equals the
  engine's slice of what the trainer sent, and the engine's draft logits equal the trainer's;
- a sync that fails on a draft tensor (its conversion raises in the second sync, after the main
  layers' buckets went out) leaves the engine on the previous version, target and draft alike;
- `weight_sync.draft: skip` leaves the MTP block out by name, on both sides.

Tolerance: float32 on both sides, different kernels and reduction orders (as tests/test_hf_logits.py);
observed max |diff| about 4e-6 on logits of magnitude up to ~5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import megatron_sync.convert
from megatron_sync.convert.families.glm4_moe import GLM4_MOE
from megatron_sync.convert.layout import rename
from megatron_sync.convert.families.mtp import MTP
from tests.support.dist import run_distributed
from tests.support.fakes import shard_of

ATOL = 5e-5
SEED = 3
SPECS = {
    "glm4_moe": dict(family="glm4_moe", partial_rotary_factor=0.5, mtp_layers=2),
    "deepseek_v3": dict(family="deepseek_v3", mtp_layers=1),
}

# -- a family whose draft conversion fails in the second sync of a process (registered at import, so every
#    spawned job that imports this module knows it) ------------------------------------------------------

_DRAFT_CONVERSIONS = [0]


def _eh_proj_failing_in_the_second_sync(tensor, cfg):
    if tensor.device.type != "meta":  # start-up checks convert metadata only
        _DRAFT_CONVERSIONS[0] += 1
        if _DRAFT_CONVERSIONS[0] == 2:
            raise RuntimeError("injected failure converting the draft's eh_proj")
    return rename(tensor, cfg)


FAULTY_DRAFT = dataclasses.replace(
    GLM4_MOE, name="glm4_moe_faulty_draft", hf_model_types=("glm4_moe",),
    rules=tuple(dataclasses.replace(r, transform=_eh_proj_failing_in_the_second_sync)
                if r.megatron == MTP + "eh_proj.weight" else r for r in GLM4_MOE.rules),
)
megatron_sync.convert.register_family(FAULTY_DRAFT)


# -- the draft's logits against Megatron's MTP head ------------------------------------------------------

def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def _megatron_and_converted(rank, world_size, layout_kw, spec_kw):
    """Worker: Megatron's main and draft logits (every rank) and the converted tensors (stage sources)."""
    from megatron_sync.convert import get_converter
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.stream import MegatronWeightStream
    from tests.support import models
    from tests.support.dist import init_megatron

    init_megatron(**layout_kw)
    spec = models.ModelSpec(**spec_kw)
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=SEED), spec)
    tokens = _tokens(spec.vocab_size)
    main, draft = models.megatron_logits(chunks, tokens), models.megatron_draft_logits(chunks, tokens)
    converter = get_converter(spec.family, models.hf_config(spec), dtype=torch.float32)
    stream = MegatronWeightStream(chunks, ParallelLayout.from_megatron(), converter)
    tensors = {name: t.clone() for name, t in stream}
    return {"main": main, "draft": draft, "tensors": tensors}


def _engine_logits(spec_kw: dict, tensors: dict, tokens: torch.Tensor):
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from tests.support import models

    engine = ReferenceEngine(models.hf_config(models.ModelSpec(**spec_kw)), tp_rank=0, tp_size=1)
    engine.load_shards(engine.rank_layout().params_from(tensors), version=1)
    return engine.logits(tokens), engine.draft_logits(tokens)


LAYOUTS = [
    pytest.param(1, {}, id="single-rank"),
    pytest.param(2, dict(tp=2), id="tp2"),
    pytest.param(2, dict(ep=2), id="ep2"),
    pytest.param(2, dict(pp=2), id="pp2"),
]


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", SPECS)
@pytest.mark.parametrize("world_size,layout_kw", LAYOUTS)
def test_draft_logits_from_the_synced_tensors_equal_megatrons_mtp_head(case, world_size, layout_kw):
    spec_kw = SPECS[case]
    per_rank = run_distributed(_megatron_and_converted, world_size, layout_kw, spec_kw, timeout=300)
    tensors: dict[str, torch.Tensor] = {}
    for out in per_rank:  # PP: each stage source sends its own stage's tensors (the draft: the last)
        assert not set(out["tensors"]) & set(tensors)
        tensors.update(out["tensors"])
    megatron = per_rank[0]
    tokens = _tokens(spec_kw.get("vocab_size", 250))
    main, draft = _engine_logits(spec_kw, tensors, tokens)
    assert draft.shape == megatron["draft"].shape == (spec_kw["mtp_layers"], 2, 16, 250)
    main_diff = (main - megatron["main"]).abs().max().item()
    draft_diff = (draft - megatron["draft"]).abs().max().item()
    print(f"{case} {layout_kw}: max |engine - Megatron| main {main_diff:.3g}, draft {draft_diff:.3g}")
    assert main_diff <= ATOL and draft_diff <= ATOL
    if world_size == 1:  # negative control: embedding and hidden state fed to eh_proj in the wrong order
        from tests.support.models import ModelSpec

        name = f"model.layers.{ModelSpec(**spec_kw).num_layers}.eh_proj.weight"  # the first draft layer
        e, h = tensors[name].chunk(2, dim=1)
        _, swapped = _engine_logits(spec_kw, {**tensors, name: torch.cat([h, e], dim=1)}, tokens)
        moved = (swapped - megatron["draft"]).abs().max().item()
        assert moved > 100 * ATOL, f"swapping eh_proj's halves moved the draft logits only {moved:.3g}"


# -- end to end through the drivers ---------------------------------------------------------------------

def _slicer(spec_kw: dict, tp_rank: int, tp_size: int):
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from tests.support.models import ModelSpec, hf_config

    return ReferenceEngine(hf_config(ModelSpec(**spec_kw)), tp_rank=tp_rank, tp_size=tp_size)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_target_and_draft_sync_together_to_an_engine_of_tp2():
    from tests.support.jobs import run_pair

    spec_kw = dict(family="glm4_moe", partial_rotary_factor=0.5, mtp_layers=1)
    case = {"spec": spec_kw, "layout": {"ep": 2}, "engine_tp": 2, "versions": 2, "draft_logits": True}
    trainers, engines = run_pair(case, timeout=360)
    trainer = trainers[0]
    sent = trainer["sent"]
    draft = {n for n in sent[0] if n.startswith("model.layers.4.")}
    assert "model.layers.4.eh_proj.weight" in draft and "model.layers.4.mlp.experts.7.down_proj.weight" in draft
    changed = [n for n in draft if not torch.equal(sent[0][n], sent[1][n])]
    assert "model.layers.4.eh_proj.weight" in changed, "the training step did not move the MTP block"
    for tp_rank, engine in enumerate(engines):
        slicer = _slicer(spec_kw, tp_rank, 2)
        assert [h["version"] for h in engine["held"]] == [1, 2]
        for version, held in enumerate(engine["held"]):
            assert set(held["shards"]) == set(sent[version])
            for name, shard in held["shards"].items():
                assert torch.equal(shard, shard_of(slicer, name, sent[version][name])), (version, name)
            main_diff = (held["logits"] - trainer["logits"][version]).abs().max().item()
            draft_diff = (held["draft_logits"] - trainer["draft_logits"][version]).abs().max().item()
            assert main_diff < ATOL and draft_diff < ATOL, (version, main_diff, draft_diff)


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_a_sync_failing_on_the_draft_leaves_target_and_draft_on_the_previous_version():
    from tests.support.jobs import run_pair

    spec_kw = dict(family="glm4_moe_faulty_draft", partial_rotary_factor=0.5, mtp_layers=1)
    case = {"spec": spec_kw, "layout": {}, "engine_tp": 2, "versions": 3, "draft_logits": True,
            "imports": [__name__], "record_failures": True, "bucket_size_mb": 0.02}
    trainers, engines = run_pair(case, timeout=360)
    [trainer] = trainers
    [failure] = trainer["failures"]
    assert failure["step"] == 2 and failure["aborted"], failure["text"][-3000:]
    assert "injected failure converting the draft's eh_proj" in failure["text"]
    assert len(trainer["sent"]) == 2  # version 1, then version 2 at step 3
    order = list(trainer["sent"][0])  # the order tensors travel in: the draft's eh_proj after the main layers
    assert order.index("model.layers.4.eh_proj.weight") > order.index("model.layers.3.mlp.experts.7.down_proj.weight")
    for tp_rank, engine in enumerate(engines):
        assert engine["failure"] is None, engine["failure"]
        assert [h["version"] for h in engine["held"]] == [1, 1, 2]
        before, aborted = engine["held"][0], engine["held"][1]
        changed = [n for n in before["shards"] if not torch.equal(aborted["shards"][n], before["shards"][n])]
        assert not changed, f"engine rank {tp_rank} changed {changed[:5]} in the failed sync"
        assert torch.equal(aborted["draft_logits"], before["draft_logits"])
        # the next sync goes through, draft included
        slicer = _slicer({**spec_kw, "family": "glm4_moe"}, tp_rank, 2)
        after = engine["held"][2]
        assert all(torch.equal(s, shard_of(slicer, n, trainer["sent"][1][n])) for n, s in after["shards"].items())
        assert (after["draft_logits"] - trainer["draft_logits"][1]).abs().max().item() < ATOL


# -- the explicit setting ---------------------------------------------------------------------------------

def test_draft_skip_leaves_the_mtp_block_out_on_both_sides():
    from megatron_sync.settings.config import WeightSyncConfig
    from megatron_sync.drivers.sync import build_converter
    from tests.support.models import ModelSpec, hf_config

    config = hf_config(ModelSpec(**SPECS["glm4_moe"]))
    sending = build_converter(WeightSyncConfig(family="glm4_moe"), config)
    skipping = build_converter(WeightSyncConfig(family="glm4_moe", draft="skip"), config)
    assert sending.draft_layers == 2 and skipping.draft_layers == 0
    assert skipping.is_skipped("mtp.layers.1.transformer_layer.self_attention.linear_qkv.weight")
    engine = _slicer({**SPECS["glm4_moe"]}, 0, 1)
    assert {m.name for m in engine.expected_tensors()} == set(sending.expected_hf_tensors())
    from megatron_sync.engines.reference.engine import ReferenceEngine
    without = ReferenceEngine(config, tp_rank=0, tp_size=1, draft=False)
    assert {m.name for m in without.expected_tensors()} == set(skipping.expected_hf_tensors())
    with pytest.raises(ValueError, match="holds no draft layers"):
        without.draft_logits(_tokens(250))
    with pytest.raises(ValueError, match="draft='none' is not valid"):
        WeightSyncConfig(draft="none")
