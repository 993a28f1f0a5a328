"""The layouts people run, against hand counts from the published configs: vLLM's data-parallel attention with
expert parallelism, engines with or without the draft (MTP) layers, uneven pipeline stages; and where the
engines run: colocated ipc only on one host, NVLink inside one node, no prediction below its bound."""

from __future__ import annotations

import functools

import pytest

from megatron_sync.scale.hardware import PROFILES, profile_named
from megatron_sync.scale.layouts import FleetLayout, TrainerLayout
from megatron_sync.scale.phases import broadcast_rate, members_per_node
from megatron_sync.scale.models import model_named
from megatron_sync.scale.plans import ScalePlanner, ipc_refusal
from megatron_sync.scale.timing import input_rate, physical_bound, predict
from tests.support.models import ModelSpec, hf_config

GIB = 1 << 30
MOE = dict(family="qwen3_moe", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
           ffn_hidden_size=512, vocab_size=4096, num_experts=16, moe_ffn_hidden_size=128)


@functools.lru_cache(maxsize=None)
def _qwen3_30b(fleet: FleetLayout, trainer: TrainerLayout = TrainerLayout(tp=2, dp=4, ep=8)) -> ScalePlanner:
    family, config = model_named("qwen3-30b-a3b")
    return ScalePlanner(family, config, trainer, fleet)


@functools.lru_cache(maxsize=None)
def _small(fleet: FleetLayout, trainer: TrainerLayout) -> ScalePlanner:
    return ScalePlanner("qwen3_moe", hf_config(ModelSpec(**MOE)).to_dict(), trainer, fleet)


def test_a_dp_x_ep_engine_holds_what_a_hand_count_of_the_config_gives():
    """Qwen3-30B-A3B in one vLLM engine of DP=4 x TP=2 with EP over its 8 ranks: every rank holds its TP=2
    half of attention, embeddings and lm_head (the same on every DP group) and 128 / 8 = 16 experts a layer."""
    family, c = model_named("qwen3-30b-a3b")
    planner = _qwen3_30b(FleetLayout(engines=1, dp=4, tp=2, expert_parallel=True))
    h, layers, q, kv = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]
    d, inter, experts, vocab = c["head_dim"], c["moe_intermediate_size"], c["num_experts"], c["vocab_size"]
    attention = (q * d * h + 2 * kv * d * h + h * q * d) // 2 + 2 * h + 2 * d + experts * h
    per_layer = attention + (experts // 8) * 3 * inter * h
    expected = 2 * (2 * (vocab // 2) * h + layers * per_layer + h)  # bf16: 2 bytes
    shards, _ = planner.shard_bytes()
    assert shards == [expected] * 8
    regions = [planner.regions.of(i) for i, s in enumerate(planner.specs)]
    expert_ranks = {r for i, s in enumerate(planner.specs) if s.expert is not None and s.expert < 16
                    for r, region in enumerate(regions[i]) if region is not None}
    assert expert_ranks == {0}  # experts 0-15 on rank 0 only, not on every DP group
    q_proj = planner.specs.index(next(s for s in planner.specs if s.name.endswith("0.self_attn.q_proj.weight")))
    assert regions[q_proj][0] == regions[q_proj][2] == regions[q_proj][6] != regions[q_proj][1]


def test_dp_without_expert_parallelism_is_refused_naming_engines():
    with pytest.raises(ValueError, match="use engines= for replicas"):
        FleetLayout(engines=1, dp=4, tp=2)


def test_leaving_the_draft_out_removes_exactly_the_draft_layers_bytes():
    """GLM-4.5-Air's MTP layer is one more MoE layer (its bytes equal the last main layer's) plus enorm,
    hnorm, shared_head.norm (hidden each) and eh_proj (hidden x 2 hidden), in bf16; `--no-mtp` removes
    exactly that from the model, from what the trainer writes (P2P) and from what every rank receives."""
    family, config = model_named("glm-4.5-air")
    trainer, fleet = TrainerLayout(pp=4, dp=8, ep=8), FleetLayout(engines=2, tp=1)
    with_draft = ScalePlanner(family, config, trainer, fleet)
    without = ScalePlanner(family, config, trainer, fleet, draft=False)
    h, last = config["hidden_size"], config["num_hidden_layers"] - 1
    last_layer = sum(s.nbytes for s in without.specs if s.name.startswith(f"model.layers.{last}."))
    draft = last_layer + 2 * (3 * h + 2 * h * h)
    assert with_draft.draft_bytes() == draft and without.draft_bytes() == 0
    assert with_draft.model_bytes - without.model_bytes == draft
    egress = [p.plan("p2p", bucket_bytes=GIB).extra["egress"] for p in (with_draft, without)]
    assert egress[0] - egress[1] == draft
    received = [p.plan("broadcast", bucket_bytes=GIB).receivers[0].bytes for p in (with_draft, without)]
    assert received[0] - received[1] == draft


def test_uneven_first_and_last_stages_follow_megatrons_flags():
    t = TrainerLayout(pp=4, first_layers=3, last_layers=5)
    assert t.stage_layers(16) == [0] * 3 + [1] * 4 + [2] * 4 + [3] * 5
    with pytest.raises(ValueError, match="do not split evenly over the other 2 stages"):
        t.stage_layers(15)


def test_ipc_runs_only_colocated_on_one_host():
    one = TrainerLayout(tp=2, dp=4, ep=8)
    assert ipc_refusal(one, FleetLayout(engines=1, tp=8, colocated=True)) == ""
    assert "GPUs of their own" in ipc_refusal(one, FleetLayout(engines=1, tp=8))
    assert "spans 2 nodes" in ipc_refusal(TrainerLayout(tp=2, dp=8, ep=8), FleetLayout(engines=2, tp=8, colocated=True))
    with pytest.raises(ValueError, match="transport ipc cannot run these layouts"):
        _small(FleetLayout(engines=1, tp=8, expert_parallel=True), one).plan("ipc", bucket_bytes=GIB)


def test_engines_follow_the_trainer_on_its_last_node_or_their_own():
    trainer = TrainerLayout(tp=4)  # 4 GPUs of node 0
    shared = FleetLayout(engines=1, tp=4)  # the other 4 GPUs of node 0
    assert [shared.node_of(r, trainer) for r in range(4)] == [0] * 4 and shared.shares_nodes(trainer)
    apart = FleetLayout(engines=2, tp=8)
    assert apart.node_of(0, TrainerLayout(tp=8, dp=2)) == 2 and not apart.shares_nodes(TrainerLayout(tp=8, dp=2))
    with pytest.raises(ValueError, match="do not fit on 4 trainer GPUs"):
        FleetLayout(engines=2, tp=4, colocated=True).first_gpu(trainer)


def test_a_broadcast_inside_one_node_runs_at_nvlink_not_at_one_nic():
    h100 = profile_named("h100")
    one_node = _small(FleetLayout(engines=1, tp=4), TrainerLayout(tp=2, dp=2, ep=4)).plan("broadcast", bucket_bytes=GIB)
    two_nodes = _small(FleetLayout(engines=1, tp=8), TrainerLayout(tp=2, dp=4, ep=8)).plan("broadcast",
                                                                                           bucket_bytes=GIB)
    assert broadcast_rate(h100, members_per_node(one_node, 0)) == h100.nvlink.value
    assert broadcast_rate(h100, members_per_node(two_nodes, 0)) == h100.nic_per_gpu  # the root alone on its node
    wires = [next(p for p in predict(s, h100).phases if p.name == "wire") for s in (one_node, two_nodes)]
    assert "NVLink inside one node" in wires[0].rate and "NVLink" not in wires[1].rate.split(" from ")[0]
    latency = [s.senders[0].messages * h100.message_s.value * 2 for s in (one_node, two_nodes)]
    assert wires[0].seconds - latency[0] < one_node.model_bytes / h100.nic_per_gpu < wires[1].seconds


LAYOUTS = [
    ("separate", TrainerLayout(tp=2, dp=4, ep=8), FleetLayout(engines=2, tp=8, expert_parallel=True)),
    ("one node", TrainerLayout(tp=2, dp=2, ep=4), FleetLayout(engines=1, tp=4, expert_parallel=True)),
    ("colocated", TrainerLayout(tp=2, dp=4, ep=8), FleetLayout(engines=1, tp=8, colocated=True)),
    ("dp-ep", TrainerLayout(tp=2, dp=4, ep=8), FleetLayout(engines=2, dp=8, tp=1, expert_parallel=True)),
]


@pytest.mark.parametrize("name,trainer,fleet", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_no_prediction_is_below_its_bound(name, trainer, fleet):
    """On every profile, every transport that can run the layouts (ipc only colocated) is predicted at or
    above the bound (`predict` also refuses to return one below it)."""
    planner = _small(fleet, trainer)
    transports = ["broadcast", "p2p", "disk_delta"] + (["ipc"] if not ipc_refusal(trainer, fleet) else [])
    assert ("ipc" in transports) == (name == "colocated")
    for transport in transports:
        summary = planner.plan(transport, bucket_bytes=1 << 20)
        for profile in sorted(PROFILES):
            p = predict(summary, profile_named(profile))
            assert p.seconds >= p.physical_bound > 0, (transport, profile, p.seconds, p.physical_bound)


def test_the_bound_counts_every_link_that_feeds_a_rank():
    h100 = profile_named("h100")
    trainer = TrainerLayout(tp=2, dp=4, ep=8)
    apart = _small(FleetLayout(engines=2, tp=8), trainer).plan("broadcast", bucket_bytes=GIB)
    colocated = _small(FleetLayout(engines=1, tp=8, colocated=True), trainer).plan("broadcast", bucket_bytes=GIB)
    assert input_rate(apart, h100, 0) == h100.nic_per_gpu + h100.nvlink.value  # engines relay inside a node
    assert input_rate(colocated, h100, 0) == h100.nvlink.value + h100.device_copy  # one node: no NIC needed
    shards = apart.shard_bytes
    twice = sum(shards[:8]) - apart.model_bytes
    assert physical_bound(apart, h100) == pytest.approx(max(sum(shards[:8]) - twice, max(shards)) / h100.node_nic)
