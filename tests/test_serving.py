"""GenerationServer: weights change only at a step boundary agreed by every engine rank, and every
token records the version that produced it.

The multi-process run has a trainer rank (one stage source sending a tiny qwen3's
weights, version A on odd versions, B on even ones) and one TP=2 reference engine
on two more ranks, receiving in a background thread through a real WeightReceiver
and broadcast transport. For each in-flight policy the engine first receives the
old version while idle (applies at once), then generates two requests; a test hook
starts the receive of the new version before step SWITCH_AT and waits until it is
staged on that rank, so the switch happens exactly after SWITCH_AT tokens.

Expected tokens come from fresh TP=1 transformers models holding A and B, without
the engine: greedy decoding without a cache (abort, recompute) and, for keep, A's
cache of the prefix extended by B. Exact token equality across TP=1 and TP=2 holds
because every reference step's top-2 logit gap is asserted far above the ~1e-6
float32 reduction-order differences between the two.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from megatron_sync.engines.reference.engine import ReferenceEngine, full_state_from_hf_model
from megatron_sync.engines.serving import GenerationServer
from megatron_sync.core.meta import TensorMeta
from tests.support.dist import free_port, run_distributed
from tests.test_reference_engine import tiny_config
from tests.support.fakes import shard_of

PROMPTS = [[17, 201, 5, 88, 140], [3, 99, 245, 61, 12, 170, 7]]
MAX_NEW, SWITCH_AT = 8, 3
SCENARIOS = {"abort": (1, 2), "recompute": (3, 4), "keep": (5, 6)}  # policy: (old version, new version)
SKEWED = (7, 8)  # recompute again, but engine rank 1's commit arrives after rank 0's has been offered
MIN_GAP = 1e-3  # top-2 logit gap every reference step must exceed

pytestmark = pytest.mark.timeout(150)


def _model(seed: int):
    """Return a TP=1 tiny qwen3 with random weights (scale 0.5: greedy output varies, no repeats)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return model


@pytest.fixture(scope="module")
def models():
    return {"A": _model(0), "B": _model(1)}


class _VersionedStream:
    """A one-stage HFWeightStream yielding full state A for odd versions and B for even ones."""

    def __init__(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        self.states, self.version = states, 0

    is_source, stage, phase_seconds = True, 0, {}

    def metadata(self) -> list[TensorMeta]:
        return [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in self.states["A"].items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.states["A" if self.version % 2 else "B"].items()

    def walk(self, into=None, record=None) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self)  # fresh tensors: the sender copies them into their bucket slots


def _rank_main(rank: int, world_size: int, port: int, states: dict) -> dict:
    from megatron_sync.transports.buckets.receiver import WeightReceiver
    from megatron_sync.transports.buckets.sender import WeightSender
    from megatron_sync.transports.broadcast import BroadcastTransport
    from megatron_sync.session.group import init_transport_group

    engine_group = dist.new_group([1, 2])  # collective: every rank creates it
    group = init_transport_group("127.0.0.1", port, world_size, rank, timeout=40.0, group_name="serving")
    transport = BroadcastTransport(group, num_stages=1)
    try:
        if rank == 0:
            stream = _VersionedStream(states)
            sender = WeightSender.connect(stream, transport, bucket_size_bytes=64 * 1024)
            for version in range(1, SKEWED[1] + 1):
                stream.version = version
                sender.sync(version)
            return {}
        engine = ReferenceEngine(tiny_config("qwen3"), tp_rank=rank - 1, tp_size=2, group=engine_group)
        receiver = WeightReceiver(engine, transport, bucket_size_bytes=64 * 1024)
        out = {policy: _serve(engine, engine_group, receiver, policy, *versions)
               for policy, versions in SCENARIOS.items()}
        out["skewed"] = _serve(engine, engine_group, receiver, "recompute", *SKEWED, skewed=True)
        tokens = torch.tensor([PROMPTS[1]])  # engine holds B (version 8) now
        out["cached"] = engine.generate(tokens, MAX_NEW, use_cache=True)
        out["uncached"] = engine.generate(tokens, MAX_NEW, use_cache=False)
        return out
    finally:
        transport.close()


def _serve(engine, engine_group, receiver, policy: str, old: int, new: int, skewed: bool = False) -> dict:
    """Receive `old` while idle, then generate with `new` committed before step SWITCH_AT.

    skewed: engine rank 1 starts its receive at step SWITCH_AT but goes straight into that boundary's
    agreement (nothing staged there yet), and waits for its commit only before step SWITCH_AT + 2.
    """
    server = GenerationServer(engine, engine_group=engine_group, inflight_policy=policy, commit_timeout_s=30.0)
    receiver.commit = server.commit
    server.run_in_background(receiver.receive, old).result(timeout=60)
    version_after_idle_commit = engine.version
    switch: list = []

    lagging = skewed and engine.tp_rank == 1

    def before_step(step: int) -> None:
        if step == SWITCH_AT:
            switch.append(server.run_in_background(receiver.receive, new))
        if step == SWITCH_AT + (2 if lagging else 0):
            server.wait_for_commit(new, timeout=30.0)  # staged here before this boundary's agreement

    responses = server.generate(PROMPTS, MAX_NEW, before_step=before_step)
    switch[0].result(timeout=60)
    server.close()
    return dict(responses=[dataclasses.asdict(r) | {"off_policy_kv": r.off_policy_kv} for r in responses],
                commit_log=server.commit_log, version_after_idle_commit=version_after_idle_commit,
                final_version=engine.version)


@pytest.fixture(scope="module")
def served(models):
    states = {k: full_state_from_hf_model(m) for k, m in models.items()}
    ranks = run_distributed(_rank_main, 3, free_port(), states, timeout=120)
    return ranks[1:]


# ---- independent TP=1 references ----


def _greedy(model, sequence: list[int], n: int, cache=None) -> list[int]:
    """Return n greedy tokens after `sequence` (after `cache`, fed incrementally, when given); check margins."""
    tokens = []
    with torch.no_grad():
        for _ in range(n):
            if cache is None:
                logits = model(input_ids=torch.tensor([sequence + tokens]), use_cache=False).logits[0, -1]
            else:
                step_input = (sequence + tokens)[-1:]
                out = model(input_ids=torch.tensor([step_input]), past_key_values=cache, use_cache=True)
                logits, cache = out.logits[0, -1], out.past_key_values
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > MIN_GAP, "near-tie: choose other seeds or prompts"
            tokens.append(int(logits.argmax()))
    return tokens


def _keep_reference(models, prompt: list[int], prefix: list[int], n: int) -> list[int]:
    """B decoding over A's KV cache of prompt + prefix[:-1] (what "keep" computes), with transformers alone."""
    with torch.no_grad():
        cache = models["A"](input_ids=torch.tensor([prompt + prefix[:-1]]), use_cache=True).past_key_values
    return _greedy(models["B"], prompt + prefix, n, cache=cache)


# ---- tests ----


@pytest.mark.multiproc
def test_both_engine_ranks_return_identical_responses(served):
    rank1, rank2 = served
    for scenario in [*SCENARIOS, "skewed"]:
        assert rank1[scenario] == rank2[scenario], scenario


@pytest.mark.multiproc
def test_a_version_staged_on_one_rank_only_waits_for_the_same_boundary_everywhere(served, models):
    """Rank 0 offers at step SWITCH_AT, rank 1 only later: both switch at one later boundary."""
    old, new = SKEWED
    got = served[0]["skewed"]
    assert got["commit_log"] == served[1]["skewed"]["commit_log"]
    (first, (version, step)) = got["commit_log"]
    assert first == (old, None) and version == new and SWITCH_AT <= step <= SWITCH_AT + 2
    for prompt, r in zip(PROMPTS, got["responses"]):
        prefix = _greedy(models["A"], prompt, step)
        assert r["tokens"] == prefix + _greedy(models["B"], prompt + prefix, MAX_NEW - step)
        assert r["weight_versions"] == [(old, 0, step), (new, step, MAX_NEW)]


@pytest.mark.multiproc
def test_idle_commit_applies_at_once_and_switch_lands_on_the_hooked_boundary(served):
    for policy, (old, new) in SCENARIOS.items():
        got = served[0][policy]
        assert got["version_after_idle_commit"] == old, policy
        assert got["commit_log"] == [(old, None), (new, SWITCH_AT)], policy
        assert got["final_version"] == new, policy


@pytest.mark.multiproc
def test_abort_ends_requests_at_the_boundary_with_old_tokens(served, models):
    old, _ = SCENARIOS["abort"]
    for prompt, r in zip(PROMPTS, served[0]["abort"]["responses"]):
        assert r["tokens"] == _greedy(models["A"], prompt, SWITCH_AT)
        assert r["finish_reason"] == "aborted"
        assert r["weight_versions"] == [(old, 0, SWITCH_AT)]
        assert r["kv_versions"] == [(old, 0, len(prompt) + SWITCH_AT - 1)]
        assert not r["off_policy_kv"]


@pytest.mark.multiproc
def test_recompute_continues_as_new_weights_from_prompt_and_prefix(served, models):
    old, new = SCENARIOS["recompute"]
    for prompt, r in zip(PROMPTS, served[0]["recompute"]["responses"]):
        prefix = _greedy(models["A"], prompt, SWITCH_AT)
        assert r["tokens"] == prefix + _greedy(models["B"], prompt + prefix, MAX_NEW - SWITCH_AT)
        assert r["finish_reason"] == "length"
        assert r["weight_versions"] == [(old, 0, SWITCH_AT), (new, SWITCH_AT, MAX_NEW)]
        assert r["kv_versions"] == [(new, 0, len(prompt) + MAX_NEW - 1)]  # the whole cache recomputed
        assert not r["off_policy_kv"]


@pytest.mark.multiproc
def test_keep_decodes_new_weights_over_old_cache_and_records_it(served, models):
    old, new = SCENARIOS["keep"]
    recomputed = served[0]["recompute"]["responses"]
    for prompt, r, rec in zip(PROMPTS, served[0]["keep"]["responses"], recomputed):
        prefix = _greedy(models["A"], prompt, SWITCH_AT)
        assert r["tokens"] == prefix + _keep_reference(models, prompt, prefix, MAX_NEW - SWITCH_AT)
        assert r["weight_versions"] == [(old, 0, SWITCH_AT), (new, SWITCH_AT, MAX_NEW)]
        boundary = len(prompt) + SWITCH_AT - 1  # last old token is cached by the first new step
        assert r["kv_versions"] == [(old, 0, boundary), (new, boundary, len(prompt) + MAX_NEW - 1)]
        assert r["off_policy_kv"]
    # The scenario has power: off-policy KV changes the continuation of at least one request.
    assert any(k["tokens"] != c["tokens"] for k, c in zip(served[0]["keep"]["responses"], recomputed))


@pytest.mark.multiproc
def test_tp2_cached_greedy_equals_uncached(served):
    for rank_out in served:
        assert torch.equal(rank_out["cached"], rank_out["uncached"])


# ---- single process (TP=1, no group) ----


def _engine_with(models, key: str, version: int) -> tuple[ReferenceEngine, dict]:
    engine = ReferenceEngine(tiny_config("qwen3"), tp_rank=0, tp_size=1)
    full = full_state_from_hf_model(models[key])
    engine.load_shards({n: shard_of(engine, n, t) for n, t in full.items()}, version)
    return engine, full


def test_cached_greedy_equals_uncached_and_transformers(models):
    engine, _ = _engine_with(models, "A", 1)
    tokens = torch.tensor(PROMPTS[:1])
    cached = engine.generate(tokens, MAX_NEW)
    assert torch.equal(cached, engine.generate(tokens, MAX_NEW, use_cache=False))
    assert cached[0, len(PROMPTS[0]):].tolist() == _greedy(models["A"], PROMPTS[0], MAX_NEW)


def test_commit_not_taken_in_time_is_withdrawn_and_generation_stays_on_old_version(models):
    engine, _ = _engine_with(models, "A", 1)
    full_b = full_state_from_hf_model(models["B"])
    server = GenerationServer(engine, engine_group=None, inflight_policy="keep", commit_timeout_s=0.2)
    outcome: list = []

    def late_commit() -> None:
        try:
            server.commit({n: shard_of(engine, n, t).clone() for n, t in full_b.items()}, 2)
            outcome.append("applied")
        except TimeoutError as e:
            outcome.append(str(e))

    def before_step(step: int) -> None:
        if step == 1:  # a boundary that never comes in time: this step stalls past the timeout
            thread = threading.Thread(target=late_commit)
            thread.start()
            thread.join(timeout=5.0)

    (response,) = server.generate(PROMPTS[:1], 4, before_step=before_step)
    assert "withdrawn" in outcome[0] and "keeps version 1" in outcome[0]
    assert engine.version == 1 and server.commit_log == []
    assert response.weight_versions == [(1, 0, 4)]
    assert response.tokens == _greedy(models["A"], PROMPTS[0], 4)


def test_wait_lets_requests_in_flight_finish_on_the_old_version_then_applies(models):
    """Policy "wait": a version staged mid-generation goes live only when the requests finished."""
    engine, _ = _engine_with(models, "A", 1)
    full_b = full_state_from_hf_model(models["B"])
    server = GenerationServer(engine, engine_group=None, inflight_policy="wait", commit_timeout_s=30.0)
    committing: list = []

    def before_step(step: int) -> None:
        if step == SWITCH_AT:
            shards = {n: shard_of(engine, n, t).clone() for n, t in full_b.items()}
            committing.append(threading.Thread(target=server.commit, args=(shards, 2)))
            committing[0].start()
            server.wait_for_commit(2, timeout=10.0)  # staged before this boundary

    responses = server.generate(PROMPTS, MAX_NEW, before_step=before_step)
    committing[0].join(timeout=10.0)
    assert not committing[0].is_alive() and engine.version == 2
    assert server.commit_log == [(2, None)]  # applied after generation, not at a step boundary
    for prompt, r in zip(PROMPTS, responses):
        assert r.tokens == _greedy(models["A"], prompt, MAX_NEW) and r.finish_reason == "length"
        assert r.weight_versions == [(1, 0, MAX_NEW)] and not r.off_policy_kv
    (after,) = server.generate(PROMPTS[:1], 4)
    assert after.tokens == _greedy(models["B"], PROMPTS[0], 4) and after.weight_versions == [(2, 0, 4)]


def test_bad_policy_names_the_choices(models):
    engine = ReferenceEngine(tiny_config("qwen3"), tp_rank=0, tp_size=1)
    with pytest.raises(ValueError, match=r"inflight_policy='drain'.*\['abort', 'wait', 'recompute', 'keep'\]"):
        GenerationServer(engine, engine_group=None, inflight_policy="drain")
