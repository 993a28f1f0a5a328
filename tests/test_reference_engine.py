"""The reference engine at TP=2 equals a TP=1 transformers model, and shards exactly.

Tolerance of the logits comparison (float32): the engine computes the same
operations on the same values; only the order of reductions differs (a
row-parallel projection sums two partial dot products of half length, then
all-reduces them; the engine's experts run the eager loop where the TP=1 model
uses grouped_mm). Each such regrouping moves a float32 result by a few ulps,
so logits of magnitude ~1-10 agree to ~1e-6; rtol=atol=1e-5 leaves a margin
without hiding a wrong shard, which moves logits by O(1). MoE routing takes
a discrete top-k of router scores computed from those hidden states; with
random weights a near-tie that a 1e-6 change could flip does not occur for
these seeds.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_sync.convert import BUILTIN_FAMILIES, Shard, UnknownFamilyError
from megatron_sync.engines.reference.engine import ReferenceEngine, full_state_from_hf_model
from megatron_sync.layout.regions import kv_head_range
from tests.support.fakes import shard_of
from megatron_sync.engines.base import EngineAdapter
from tests.support.dist import run_distributed
from tests.support.models import NOT_ON_REFERENCE_ENGINE

TP = 2
VOCAB = 250
FAMILY_NAMES = ["qwen3", "qwen3_moe", "llama", "qwen2", "deepseek_v3", "glm4_moe"]
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2)


def tiny_config(family: str):
    """Return a small config of `family` (4 heads / 2 kv heads, 4 experts where MoE)."""
    from transformers import AutoConfig

    gqa = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    kwargs = {
        "qwen3": dict(**gqa, tie_word_embeddings=True),
        "qwen3_moe": dict(
            **gqa, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
        ),
        "llama": dict(**gqa, attention_bias=False, tie_word_embeddings=False),
        "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        "deepseek_v3": dict(
            num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            tie_word_embeddings=False, num_nextn_predict_layers=0,  # transformers' default is 1 draft layer
        ),
        "glm4_moe": dict(
            **gqa, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, moe_intermediate_size=32,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            tie_word_embeddings=False, num_nextn_predict_layers=0,
        ),
    }[family]
    return AutoConfig.for_model(family, **_COMMON, **kwargs)


def reference_model(family: str, seed: int = 0):
    """Return a TP=1 transformers model of `family` with random weights (norms near 1, routers distinct)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = p.dim() == 1 and not name.endswith(".bias")
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if is_norm else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


# ---- multi-process runs (tests.support.dist.run_distributed) ----


def _split_dim(engine, name):
    """Return the dim of `name` this engine splits over its ranks (None: every rank holds all of it)."""
    (placement,) = engine.rank_layout().by_name[name]
    full = next(m.shape for m in engine.expected_tensors() if m.name == name)
    return next((d for d, (got, want) in enumerate(zip(placement.source.sizes, full)) if got != want), None)


def _fleet_rank(rank, world_size, cases, out_dir):
    """Two TP=2 engines (ranks 0-1 and 2-3, each over its own group) load every family; then one
    TP=4 engine over all ranks loads qwen3. Saves logits, generations and live shards."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results = {}
    for family, (full, tokens) in cases.items():
        tp_rank, group = rank % TP, groups[rank // TP]
        engine = ReferenceEngine(tiny_config(family), tp_rank=tp_rank, tp_size=TP, group=group)
        engine.load_shards(engine.rank_layout().params_from(full), version=3)
        results[family] = dict(
            version=engine.version,
            logits=engine.logits(tokens),
            generated=engine.generate(tokens, max_new_tokens=4),
            shards=engine.snapshot(),
            dims={n: _split_dim(engine, n) for n in full},
        )
        # Negative control: row-parallel shards of the other rank, column-parallel ones of this rank.
        other = ReferenceEngine(tiny_config(family), tp_rank=1 - tp_rank, tp_size=TP, group=group)
        engine.load_shards(
            {n: shard_of(other if _split_dim(engine, n) == 1 else engine, n, t) for n, t in full.items()}, version=4
        )
        results[family]["mismatched_logits"] = engine.logits(tokens)
    full, tokens = cases["qwen3"]
    tp4 = ReferenceEngine(tiny_config("qwen3"), tp_rank=rank, tp_size=world_size)
    tp4.load_shards(tp4.rank_layout().params_from(full), version=1)
    results["tp4_qwen3_logits"] = tp4.logits(tokens)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def references():
    out = {}
    for family in FAMILY_NAMES:
        model = reference_model(family)
        tokens = _tokens()
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
            generated = model.generate(
                tokens, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        out[family] = dict(full=full_state_from_hf_model(model), tokens=tokens, logits=logits, generated=generated)
    return out


@pytest.fixture(scope="module")
def fleet_results(references, tmp_path_factory):
    """Per rank (4 ranks: two TP=2 engines, then one TP=4 engine), what `_fleet_rank` saved."""
    out_dir = str(tmp_path_factory.mktemp("fleet"))
    cases = {f: (r["full"], r["tokens"]) for f, r in references.items()}
    run_distributed(_fleet_rank, 2 * TP, cases, out_dir, timeout=240)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2 * TP)]


# ---- multi-process tests ----


@pytest.mark.multiproc
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tp2_logits_equal_transformers(family, references, fleet_results):
    ref = references[family]
    for rank, results in enumerate(fleet_results):  # both engines of the fleet
        got = results[family]
        assert got["version"] == 3
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        assert torch.equal(got["generated"], ref["generated"]), f"rank {rank}"
    # Ranks of one engine agree bit for bit (they route MoE tokens identically).
    assert torch.equal(fleet_results[0][family]["logits"], fleet_results[1][family]["logits"])
    # The comparison has power: mismatched shards move the logits by O(1), not 1e-5.
    assert (fleet_results[0][family]["mismatched_logits"] - ref["logits"]).abs().max() > 0.1


@pytest.mark.multiproc
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tp2_snapshot_shards_reassemble_bitwise(family, references, fleet_results):
    full = references[family]["full"]
    tp2_results = fleet_results[:TP]  # the first engine
    assert set(tp2_results[0][family]["shards"]) == set(full)
    for name, tensor in full.items():
        dim = tp2_results[0][family]["dims"][name]
        pieces = [results[family]["shards"][name] for results in tp2_results]
        if dim is None:
            assert all(torch.equal(p, tensor) for p in pieces), name
        else:
            assert torch.equal(torch.cat(pieces, dim=dim), tensor), name


@pytest.mark.multiproc
def test_tp4_replicates_kv_heads_and_matches_transformers(references, fleet_results):
    """TP=4 over 2 key/value heads: each head lives on two ranks, attention still exact."""
    for rank, results in enumerate(fleet_results):
        torch.testing.assert_close(
            results["tp4_qwen3_logits"], references["qwen3"]["logits"], rtol=1e-5, atol=1e-5, msg=f"rank {rank}"
        )


# ---- pure tests (one process, no group) ----


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_expected_tensors_are_the_checkpoint(family, references):
    engine = ReferenceEngine(tiny_config(family), tp_rank=0, tp_size=TP)
    assert isinstance(engine, EngineAdapter)
    full = references[family]["full"]
    expected = {m.name: m for m in engine.expected_tensors()}
    assert set(expected) == set(full)
    for name, tensor in full.items():
        assert expected[name].shape == tuple(tensor.shape) and expected[name].dtype == tensor.dtype, name


def test_checkpoint_names_per_expert_and_untied_lm_head():
    moe = {m.name for m in ReferenceEngine(tiny_config("qwen3_moe"), tp_rank=0, tp_size=1).expected_tensors()}
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in moe
    assert not any("gate_up_proj" in n for n in moe)
    assert "lm_head.weight" in moe
    dense = {m.name for m in ReferenceEngine(tiny_config("qwen3"), tp_rank=0, tp_size=1).expected_tensors()}
    assert "lm_head.weight" not in dense  # tied to embed_tokens


def test_the_layout_slices_by_role():
    cfg = tiny_config("qwen3_moe")
    engines = [ReferenceEngine(cfg, tp_rank=r, tp_size=TP) for r in range(TP)]
    cases = {
        "model.layers.0.self_attn.q_proj.weight": (Shard.COLUMN, 0),
        "model.layers.0.self_attn.k_proj.weight": (Shard.KV_HEADS, 0),
        "model.layers.0.self_attn.o_proj.weight": (Shard.ROW, 1),
        "model.layers.1.mlp.experts.2.up_proj.weight": (Shard.COLUMN, 0),
        "model.layers.1.mlp.experts.2.down_proj.weight": (Shard.ROW, 1),
        "model.layers.1.mlp.gate.weight": (Shard.REPLICATED, None),
        "model.embed_tokens.weight": (Shard.VOCAB, None),  # this engine keeps the vocabulary whole
    }
    metas = {m.name: m for m in engines[0].expected_tensors()}
    for name, (role, dim) in cases.items():
        full = torch.arange(metas[name].numel, dtype=torch.float32).reshape(metas[name].shape)
        shards = [shard_of(e, name, full) for e in engines]
        assert engines[0].converter.shard_role(name) is role, name  # the family's row says so
        assert all(_split_dim(e, name) == dim for e in engines), name
        if dim is None:
            assert all(s is full or torch.equal(s, full) for s in shards)
        else:
            assert torch.equal(torch.cat(shards, dim), full), name
            assert tuple(shards[0].shape) == engines[0].local_shape(name)


def test_kv_heads_replicate_when_tp_exceeds_them():
    full = torch.arange(2 * 3).reshape(2 * 3, 1)  # 2 heads of dim 3
    shards = [full.narrow(0, *kv_head_range(6, 2, r, 4)) for r in range(4)]
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]


def test_errors_name_the_tensor_and_the_fix():
    engine = ReferenceEngine(tiny_config("qwen3"), tp_rank=0, tp_size=TP)
    with pytest.raises(ValueError, match=r"model.layers.9.self_attn.q_proj.weight.*not a tensor"):
        engine.local_shape("model.layers.9.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match=r"not a tensor"):
        engine.local_shape("model.layers.0.self_attn.q_proj.bias")  # qwen3 has no qkv bias
    shards = {m.name: torch.zeros(engine.local_shape(m.name)) for m in engine.expected_tensors()}
    dropped = shards.pop("model.norm.weight")
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        engine.load_shards(shards, version=1)
    shards["model.norm.weight"] = dropped
    shards["model.layers.0.mlp.gate.weight"] = torch.zeros(4, 64)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.mlp.gate.weight'\]"):
        engine.load_shards(shards, version=1)
    del shards["model.layers.0.mlp.gate.weight"]
    shards["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 96)
    with pytest.raises(ValueError, match=r"down_proj.weight: shard \(64, 96\) torch.float32 != this rank's \(64, 48\)"):
        engine.load_shards(shards, version=1)
    assert engine.version == 0  # nothing applied


def test_unsupported_family_and_bad_tp():
    from transformers import AutoConfig

    with pytest.raises(UnknownFamilyError, match="no model family converts HF model_type 'gpt2'"):
        ReferenceEngine(AutoConfig.for_model("gpt2"), tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match="num_attention_heads=4 does not divide"):
        ReferenceEngine(tiny_config("qwen3"), tp_rank=0, tp_size=3)
    assert set(FAMILY_NAMES) == set(BUILTIN_FAMILIES) - set(NOT_ON_REFERENCE_ENGINE)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_held_shards_are_run_on_in_place_and_never_written(family):
    """A receiver's staging set (`HeldShards`) becomes the live weights without a copy wherever the engine's
    memory is laid out as the set is (all of tied qwen3; qwen3_moe but its fused experts, which are copied),
    computes exactly as a copied load does, and is never written by the engine: a later load by copy gives
    those weights memory of their own, and releasing memory leaves the set alone."""
    from megatron_sync.layout.staging import StagingSets

    engine, copied = (ReferenceEngine(tiny_config(family), tp_rank=0, tp_size=1) for _ in range(2))
    sets = StagingSets(engine.rank_layout(), lambda n: torch.empty(n, dtype=torch.uint8))
    staged, generator = sets.begin(), torch.Generator().manual_seed(0)
    for t in staged.values():
        t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))
    copied.load_shards({name: t.clone() for name, t in staged.items()}, 1)
    engine.load_shards(staged, 1)
    tokens = torch.tensor([[3, 5, 7, 9, 11]])
    assert torch.equal(engine.logits(tokens), copied.logits(tokens))

    live = engine.loaded_params()
    in_set = [n for n, t in live.items() if sets.memory.data_ptr() <= t.data_ptr() < sets.memory.data_ptr()
              + sets.nbytes]
    fused = [n for n in staged if ".experts." in n]
    assert sorted(in_set) == sorted(n for n in staged if n not in fused)
    assert engine.runs_in_place() == sum(staged[n].nbytes for n in in_set) > 0
    if family == "qwen3":  # tied: the output layer follows the embedding onto the set
        assert engine.model.lm_head.weight.data_ptr() == staged["model.embed_tokens.weight"].data_ptr()
    released = engine.release_memory()
    assert released == sum(t.nbytes for n, t in staged.items() if n in fused)  # only the engine's own memory
    engine.restore_memory()

    before = sets.memory.clone()
    engine.load_shards({name: torch.zeros_like(t) for name, t in staged.items()}, 2)
    assert torch.equal(sets.memory, before) and engine.runs_in_place() == 0
    assert all(torch.count_nonzero(t) == 0 for t in engine.loaded_params().values())
