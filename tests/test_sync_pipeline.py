"""The pipelined sync's pure parts: gather dtypes, staging sets, the timeline, the prefetcher's bound."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_sync.convert import Family, HFTensor, Rule, Shard, get_converter
from megatron_sync.convert.base import Converter
from megatron_sync.core.metrics import PhaseTimer, SyncMetrics, Timeline
from tests.support.models import ModelSpec, hf_config
from tests.support.timing import scaled


def _converter(family: str, dtype: torch.dtype):
    return get_converter(family, hf_config(ModelSpec(family=family)), dtype=dtype)


@pytest.mark.parametrize("family,name,param,target,gathered", [
    # fp32 parameters of rules that only move elements travel in the (narrower) engine dtype ...
    ("qwen3_moe", "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", torch.float32,
     torch.bfloat16, torch.bfloat16),
    ("qwen3", "decoder.layers.1.self_attention.linear_qkv.weight", torch.float32, torch.bfloat16, torch.bfloat16),
    ("qwen3", "embedding.word_embeddings.weight", torch.float32, torch.bfloat16, torch.bfloat16),
    # ... never widened, never narrowed below what the rule keeps (DeepSeek's router stays float32)
    ("qwen3", "decoder.layers.1.self_attention.linear_qkv.weight", torch.bfloat16, torch.float32, torch.bfloat16),
    ("qwen3", "decoder.layers.1.self_attention.linear_qkv.weight", torch.float32, torch.float32, torch.float32),
    ("deepseek_v3", "decoder.layers.1.mlp.router.weight", torch.float32, torch.bfloat16, torch.float32),
])
def test_gather_dtype_is_the_narrowest_that_converts_to_the_same_bits(family, name, param, target, gathered):
    converter = _converter(family, target)
    assert converter.gather_dtype(name, param) == gathered
    if "linear_qkv" in name:  # gathering narrower, then converting, gives the bits of converting the original
        cfg = converter.config
        rows = cfg["num_key_value_heads"] * (cfg["num_attention_heads"] // cfg["num_key_value_heads"] + 2) * cfg["head_dim"]
        full = torch.randn(rows, cfg["hidden_size"], generator=torch.Generator().manual_seed(0)).to(param)
        direct = converter.convert(name, full)
        early = converter.convert(name, full.to(gathered))
        assert [n for n, _ in direct] == [n for n, _ in early]
        for (_, a), (_, b) in zip(direct, early):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_computing_transform_is_gathered_as_it_is():
    def scaled(tensor, cfg):  # computes: casting first would round differently
        return (tensor * 3,)

    family = Family("scaled", rules=(Rule("decoder.final_layernorm.weight", "model.norm.weight", scaled),),
                    hf_tensors=(HFTensor("model.norm.weight", ("hidden_size",), Shard.REPLICATED),))
    converter = Converter(family, hf_config(ModelSpec("qwen3")), dtype=torch.bfloat16)
    assert converter.gather_dtype("decoder.final_layernorm.weight", torch.float32) == torch.float32


def test_timeline_records_phase_events_from_several_threads():
    metrics = SyncMetrics(1, timeline=Timeline())
    inside = threading.Barrier(8, timeout=scaled(30))  # all eight phases are open at once: the events overlap

    def worker(item: int) -> None:
        with PhaseTimer(metrics, "gather", ("gather", item)):
            inside.wait()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(30))
    assert not any(t.is_alive() for t in threads)
    with PhaseTimer(metrics, "checksum", ("checksum", 0)):
        pass
    events = metrics.timeline.events
    gathers = [e for e in events if e[0] == "gather"]
    assert sorted(e[1] for e in gathers) == list(range(8))
    assert all(start <= end for _, _, start, end in events)
    assert max(start for _, _, start, _ in gathers) < min(end for _, _, _, end in gathers)  # concurrent phases
    # the phase holds the time of every thread's event, summed
    assert metrics.phases["gather"] == pytest.approx(sum(end - start for _, _, start, end in gathers), rel=1e-9)
    assert metrics.phases["gather"] > 0
    wire = metrics.timeline.to_wire()["events"]
    assert len(wire) == 9 and abs(wire[0][2] - time.time()) < 60  # epoch seconds: a unit check, not a bound
    with pytest.raises(AssertionError):
        metrics.timeline.add("teleport", 0, 0.0, 1.0)
    assert SyncMetrics(2).timeline is None  # off unless asked for: event() is a no-op
    SyncMetrics(2).event("wire", 0, 0.0, 1.0)
