"""Tests of the test-support layer: tiny CPU models, reference weights, the gloo runner."""

import threading

import pytest
import torch

from tests.support.dist import (
    RemoteProcessError,
    init_megatron,
    run_distributed,
    teardown_megatron,
)
from megatron_sync.convert import BUILTIN_FAMILIES as FAMILIES
from tests.support.models import (
    ModelSpec,
    hf_config,
    padded_vocab_size,
    reference_weights,
)
from tests.support.timing import bounded

# Sharded logits differ from single-rank ones only by float32 summation order;
# observed max abs difference is ~3e-6 on logits of std ~1.
LOGITS_ATOL = 1e-4
SEQ = 12


def _tokens(spec):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, spec.vocab_size, (2, SEQ), generator=gen)


def _logits_per_case(rank, world_size, cases):
    """Worker: for each (family, layout), build, load seed-0 weights, return logits."""
    from tests.support.models import build_model_chunks, load_reference_weights, megatron_logits

    out = {}
    for family, layout in cases:
        init_megatron(**layout)
        try:
            spec = ModelSpec(family)
            chunks = build_model_chunks(spec)
            load_reference_weights(chunks, reference_weights(spec, 0), spec)
            out[(family, tuple(sorted(layout.items())))] = megatron_logits(chunks, _tokens(spec))
        finally:
            teardown_megatron()
    return out


def _load_errors(rank, world_size, family):
    """Worker: loading with a missing or an extra-but-unused tensor must raise."""
    from tests.support.models import build_model_chunks, load_reference_weights

    init_megatron()
    spec = ModelSpec(family)
    chunks = build_model_chunks(spec)
    full = reference_weights(spec, 0)
    missing = dict(full)
    del missing["decoder.layers.1.pre_mlp_layernorm.weight"]
    errors = []
    for bad, kind in ((missing, KeyError), ({**full, "decoder.layers.2.extra.weight": full["decoder.final_layernorm.weight"]}, ValueError)):
        try:
            load_reference_weights(chunks, bad, spec)
            errors.append(None)
        except kind as exc:
            errors.append(str(exc))
    embedding = chunks[0].embedding.word_embeddings.weight
    load_reference_weights(chunks, full, spec)
    padding_is_zero = bool((embedding[spec.vocab_size:] == 0).all())
    teardown_megatron()
    return errors, padding_is_zero


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    torch.distributed.barrier()  # rank 0 would wait here forever


def _hang(rank, world_size):
    threading.Event().wait()  # hangs on purpose, until run_distributed kills this worker


# ---------------------------------------------------------------- pure


def test_padded_vocab_is_multiple_of_128_tp():
    spec = ModelSpec("llama")
    assert padded_vocab_size(spec, 1) == 256
    assert padded_vocab_size(spec, 2) == 256
    assert padded_vocab_size(spec, 3) == 384


def test_reference_weights_deterministic_and_seed_dependent():
    spec = ModelSpec("deepseek_v3")
    a, b, c = reference_weights(spec, 1), reference_weights(spec, 1), reference_weights(spec, 2)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["output_layer.weight"], c["output_layer.weight"])
    assert a["embedding.word_embeddings.weight"].shape == (spec.vocab_size, spec.hidden_size)
    bias = a["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.abs().min() > 0
    assert "decoder.layers.0.mlp.router.weight" not in a  # first_k_dense_replace=1
    assert f"decoder.layers.3.mlp.experts.local_experts.{spec.num_experts - 1}.linear_fc2.weight" in a


def test_tied_embeddings_have_no_output_layer():
    assert "output_layer.weight" not in reference_weights(ModelSpec("qwen3", tie_word_embeddings=True), 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_config_matches_spec(family):
    spec = ModelSpec(family)
    cfg = hf_config(spec)
    assert cfg.vocab_size == spec.vocab_size
    assert cfg.num_hidden_layers == spec.num_layers
    assert cfg.rms_norm_eps == spec.rms_norm_eps
    assert cfg.rope_parameters["rope_theta"] == spec.rope_theta
    if family == "deepseek_v3":
        assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (1, 1, 1.0)
        assert cfg.first_k_dense_replace == spec.first_k_dense_replace
    elif family == "qwen3_moe":
        assert cfg.norm_topk_prob and cfg.num_experts == spec.num_experts
    if family != "deepseek_v3":
        assert getattr(cfg, "head_dim", spec.head_dim) == spec.head_dim


# ---------------------------------------------------------------- processes


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_sharded_logits_equal_single_rank():
    single = run_distributed(_logits_per_case, 1, [(f, {}) for f in FAMILIES], timeout=100)[0]
    for logits in single.values():
        assert logits.shape == (2, SEQ, 250)
        assert torch.isfinite(logits).all() and logits.std() > 0.1
    expert_biases = {"gpt_oss": {"etp": 1}}  # megatron-core 0.16.1: expert biases only at expert TP 1
    cases = [(f, {"tp": 2, **expert_biases.get(f, {})}) for f in FAMILIES]
    cases += [(f, {"ep": 2}) for f in ("qwen3_moe", "deepseek_v3")]
    cases += [("qwen3_moe", {"tp": 2, "etp": 1})]
    per_rank = run_distributed(_logits_per_case, 2, cases, timeout=100)
    for (family, layout), logits in per_rank[0].items():
        reference = single[(family, ())]
        torch.testing.assert_close(logits, reference, atol=LOGITS_ATOL, rtol=0, msg=f"{family} {layout}")
        assert torch.equal(logits, per_rank[1][(family, layout)])


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_load_reference_weights_rejects_missing_and_unused():
    (missing_err, unused_err), padding_is_zero = run_distributed(_load_errors, 1, "qwen3_moe", timeout=50)[0]
    assert missing_err is not None and "pre_mlp_layernorm" in missing_err
    assert unused_err is not None and "decoder.layers.2.extra.weight" in unused_err
    assert padding_is_zero


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_run_distributed_propagates_remote_traceback():
    with pytest.raises(RemoteProcessError, match="boom from rank one") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=50)
    assert info.value.rank == 1
    assert "_fail_on_rank_one" in str(info.value) and "ValueError" in str(info.value)


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_run_distributed_times_out_and_kills_workers():
    with bounded(30, "run_distributed giving up on hung workers after its 8 s and killing them"):
        with pytest.raises(TimeoutError):
            run_distributed(_hang, 2, timeout=8)


def _pipeline_layout(rank, world_size, cases):
    """Worker: build and load PP/VPP chunks; return (pre, post, layer numbers) per chunk."""
    from tests.support.models import build_model_chunks, load_reference_weights

    out = []
    for family, layout, tie in cases:
        init_megatron(**layout)
        try:
            spec = ModelSpec(family, tie_word_embeddings=tie)
            chunks = build_model_chunks(spec)
            load_reference_weights(chunks, reference_weights(spec, 0), spec)
            out.append([(c.pre_process, c.post_process, [l.layer_number for l in c.decoder.layers])
                        for c in chunks])
        finally:
            teardown_megatron()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_pipeline_chunks_build_and_load():
    cases = [("deepseek_v3", {"pp": 2, "vpp": 2}, True), ("qwen3_moe", {"pp": 2}, False)]
    rank0, rank1 = run_distributed(_pipeline_layout, 2, cases, timeout=80)
    # VPP=2 over PP=2 interleaves layers: rank 0 holds 1 and 3, rank 1 holds 2 and 4.
    assert rank0[0] == [(True, False, [1]), (False, False, [3])]
    assert rank1[0] == [(False, False, [2]), (False, True, [4])]
    assert rank0[1] == [(True, False, [1, 2])]
    assert rank1[1] == [(False, True, [3, 4])]


def _pipeline_logits(rank, world_size, layout, family):
    from tests.support.models import build_model_chunks, load_reference_weights, megatron_logits

    init_megatron(**layout)
    spec = ModelSpec(family)
    chunks = build_model_chunks(spec, vpp=layout.get("vpp"))
    load_reference_weights(chunks, reference_weights(spec, 3), spec)
    return megatron_logits(chunks, torch.arange(24).reshape(2, 12) % spec.vocab_size)


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_pipeline_forward_matches_single_rank():
    # Hidden states hop stage to stage (chunk 0 of every stage, then chunk 1): same math, same order.
    [reference] = run_distributed(_pipeline_logits, 1, {}, "qwen3_moe", timeout=100)
    for logits in run_distributed(_pipeline_logits, 4, {"pp": 2, "vpp": 2}, "qwen3_moe", timeout=120):
        assert torch.equal(logits, reference)
