"""The P2P transport through the unchanged drivers (`TrainerWeightSync` / `InferenceWeightSync`).

A Megatron trainer job and a separately launched reference-engine job meet at the rendezvous
with `transport: p2p`; every trainer rank joins and sends its own share. Checked on both byte
movers (torch.distributed over gloo, Mooncake over TCP):

- every engine shard of version 1 equals, bit for bit, the single-rank conversion of the same
  seeded weights sliced the engine's way; version 2 (after a training step) equals the
  trainer ranks' shares put together, sliced the same way; the engine's logits equal the
  trainer's Megatron forward;
- the bytes each inference rank received, measured at the transport and reported in its
  SyncMetrics, equal its shard bytes (ratio 1.00), and what the trainer ranks sent adds up
  to the same; each trainer rank's replica holds exactly its assigned share, no rank a whole
  stage, and every HF tensor is held by exactly one rank;
- failure: a sender that fails (but lives) aborts the version on every rank and the next sync
  goes ahead; a sender killed mid-transfer gives every surviving rank a clear error within
  timeout_s, and the engines keep the previous version's exact shards.

Most layout combinations (TP=2, EP=2, TP=2+EP=2, PP=2 into TP=1, TP=2 with replicated KV heads,
two engines) run in tests/test_p2p_end_to_end.py, which drives the P2P pieces directly.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_sync.transports import register_transport
from megatron_sync.transports.p2p.transport import P2PTransport
from tests.support.fakes import shard_of

LOGITS_ATOL = {"float32": 1e-4, "bfloat16": 0.25}
"""Engine against trainer logits: float32, different kernels and reduction order; bf16 weights, two forwards
that round differently (0.08 seen; the shards are compared bit for bit before)."""
SEED = 3  # tests.support.jobs.trainer_job's reference weights
KILLED_RANK = 1
KILL_EXIT_CODE = 17


class _FaultyP2P(P2PTransport):
    """P2P whose trainer rank 1 fails to convert in its second sync, then dies on its second write of the fourth."""

    name = "p2p_faulty"

    @classmethod
    def make_sender(cls, transport, stream, config, keep_together):
        sender = super().make_sender(transport, stream, config, keep_together)
        if transport.rank == KILLED_RANK:
            walk, syncs = sender._tensors, [0]

            def faulty_walk():
                syncs[0] += 1
                for k, item in enumerate(walk()):
                    if syncs[0] == 2 and k == 1:
                        raise RuntimeError("injected conversion failure on trainer rank 1")
                    yield item

            sender._tensors = faulty_walk
            assert len(sender.schedule.sender_messages(transport.rank)) >= 2, "rank 1 must write two messages"
            sender.writer.mover = _DieOnWrite(sender.writer.mover, syncs, sync=4, nth=2)
        return sender


class _DieOnWrite:
    """A byte mover that ends its process on its `nth` write of sync `sync` (`syncs[0]` counts them)."""

    def __init__(self, mover, syncs: list, *, sync: int, nth: int) -> None:
        self._mover, self._syncs, self._sync, self._nth = mover, syncs, sync, nth
        self._writes = 0

    def __getattr__(self, name):
        return getattr(self._mover, name)

    def write(self, target, memory, spans):
        if self._syncs[0] == self._sync:
            self._writes += 1
            if self._writes == self._nth:
                os._exit(KILL_EXIT_CODE)
        return self._mover.write(target, memory, spans)


register_transport("p2p_faulty", _FaultyP2P)  # at import: every spawned job imports this module


def _case(backend: str, **case) -> dict:
    case.setdefault("weight_sync", {})
    case["weight_sync"] = {"transport": "p2p", "p2p_backend": backend, "p2p_local_hostname": "127.0.0.1",
                           "bucket_size_mb": 0.02, "gather_budget_mb": 0.05, **case["weight_sync"]}
    return case


def _reference_shards(case: dict, tp_rank: int) -> dict[str, torch.Tensor]:
    """Return the engine's shards of a single-rank conversion of the trainer's seeded weights."""
    from megatron_sync.convert import get_converter
    from tests.support import models

    spec = models.ModelSpec(**case["spec"])
    dtype = getattr(torch, case["weight_sync"].get("dtype", "float32"))
    converter = get_converter(spec.family, models.hf_config(spec), dtype=dtype)
    full = {}
    for name, tensor in models.reference_weights(spec, seed=SEED).items():
        full.update(converter.convert(name, tensor))
    slicer = _slicer(case, tp_rank)
    return {name: shard_of(slicer, name, t) for name, t in full.items()}


def _slicer(case: dict, tp_rank: int):
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from tests.support.models import ModelSpec, hf_config

    return ReferenceEngine(hf_config(ModelSpec(**case["spec"])), tp_rank=tp_rank, tp_size=case["engine_tp"])


def _shard_bytes(shards: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in shards.values())


UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}  # NIXL over real sockets on loopback

CASES = [
    # One staging set (an engine that copies): the engine copies every version, its set takes the next one. The
    # trainer holds its weights in bf16 (Megatron's --bf16): gathered and sent as they are, nothing cast.
    pytest.param("nixl", dict(spec={"family": "qwen3", "params_dtype": "bfloat16"}, layout={"tp": 2}, engine_tp=1,
                              versions=2, env=UCX_TCP, weight_sync={"staging_sets": 1, "dtype": "bfloat16"}),
                 id="bf16-tp2-into-tp1-one-staging-set-nixl"),
    pytest.param("torch", dict(spec={"family": "qwen3_moe", "num_kv_heads": 1}, layout={"ep": 2}, engine_tp=2,
                               versions=2), id="ep2-into-tp2-replicated-kv-torch"),
    # One version: a CPU training step of MoE under TP>1 needs sequence parallelism (TE norms).
    pytest.param("mooncake", dict(spec={"family": "qwen3_moe"}, layout={"tp": 2, "ep": 2}, engines=2, engine_tp=1,
                                  versions=1), id="tp2-ep2-into-two-chained-engines-mooncake"),
    pytest.param("nixl", dict(spec={"family": "llama", "num_kv_heads": 1}, layout={"pp": 2}, engines=3, engine_tp=2,
                              versions=2, env=UCX_TCP), id="pp2-into-three-chained-engines-replicated-kv-nixl"),
    # Registered memory smaller than a shard: the arena and the window are reused round by round.
    pytest.param("nixl", dict(spec={"family": "qwen3_moe"}, layout={"ep": 2}, engine_tp=2, versions=2, env=UCX_TCP,
                              weight_sync={"p2p_arena_mb": 0.03, "p2p_window_mb": 0.05}),
                 id="ep2-bounded-arena-and-window-nixl"),
]


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.parametrize("backend,case", CASES)
def test_p2p_syncs_exact_shards_and_only_shard_bytes_through_the_drivers(backend, case):
    if backend == "mooncake":
        import mooncake.engine  # noqa: F401 — a requirement (requirements-cpu.txt): missing is a failure
    from tests.support.jobs import run_pair

    case = _case(backend, **case, receiver_metrics=True)
    versions = list(range(1, case["versions"] + 1))
    trainers, engines = run_pair(case, timeout=360)

    # What was sent: the tensors of each trainer rank's pieces, together the whole checkpoint (a large tensor
    # is spread over several holders, each of which converted the same full tensor).
    sent = [{} for _ in versions]
    for t in trainers:
        for version, share in enumerate(t["sent"]):
            for name, tensor in share.items():
                assert name not in sent[version] or torch.equal(sent[version][name], tensor), name
                sent[version][name] = tensor
    reference = [_reference_shards(case, r) for r in range(case["engine_tp"])]
    assert set(sent[0]) == set(reference[0])
    if len(versions) > 1:
        assert any(not torch.equal(sent[0][n], sent[1][n]) for n in sent[0]), "the training step changed nothing"

    shard_bytes = []
    for rank, engine in enumerate(engines):
        tp_rank = rank % case["engine_tp"]
        slicer = _slicer(case, tp_rank)
        assert [h["version"] for h in engine["held"]] == versions
        v1 = engine["held"][0]["shards"]
        assert set(v1) == set(reference[tp_rank])
        wrong = [n for n in v1 if not torch.equal(v1[n], reference[tp_rank][n])]
        assert not wrong, f"inference rank {rank}, version 1: {wrong[:5]}"
        for version, held in zip(versions[1:], engine["held"][1:]):
            wrong = [n for n, shard in held["shards"].items() if not torch.equal(shard, shard_of(slicer, n, sent[version - 1][n]))]
            assert not wrong, f"inference rank {rank}, version {version}: {wrong[:5]}"
        for version, held in enumerate(engine["held"]):
            diff = (held["logits"] - trainers[0]["logits"][version]).abs().max().item()
            assert diff < LOGITS_ATOL[case["spec"].get("params_dtype", "float32")], (rank, version, diff)
        shard_bytes.append(_shard_bytes(v1))
        # The engine computes on the staging set each version arrived in (the logits above), not on a copy: all
        # of a dense model; of a MoE model all but the experts, which transformers keeps fused in memory. With
        # one staging set it copies everything: the set takes the next version.
        in_place = [held["in_place"] for held in engine["held"]]
        dense = "moe" not in case["spec"]["family"]
        if case["weight_sync"].get("staging_sets") == 1:
            assert in_place == [0] * len(versions), (rank, in_place)
        else:
            assert all(b == shard_bytes[-1] if dense else 0 < b < shard_bytes[-1] for b in in_place), (rank, in_place)

    # Bytes at the transport: each inference rank got exactly its shards; senders sent the sum.
    for version, reports in enumerate(trainers[0]["received"], start=1):
        received = {m["rank"]: m["bytes"] for m in map(json.loads, reports)}
        ratios = {r: received[len(trainers) + r] / shard_bytes[r] for r in range(len(engines))}
        assert all(ratio == 1.0 for ratio in ratios.values()), (version, ratios)
        sent_bytes = sum(json.loads(t["metrics"][version - 1])["bytes"] for t in trainers)
        # The model once: identical engines are chained, and rows several ranks of an engine hold (norms, KV
        # heads repeated) come once and are relayed inside it (the ratios above: every rank got all its bytes),
        # into bounded windows too.
        egress = trainers[0]["share"]["egress"]
        model = sum(t.numel() * t.element_size() for t in sent[version - 1].values())
        one_engine = sum(shard_bytes) // case.get("engines", 1)
        assert sent_bytes == egress == (model if case["engine_tp"] > 1 else one_engine), (version, sent_bytes, egress)
        assert model < one_engine or case["engine_tp"] == 1
        # Every phase P2P runs is measured (gather, convert and checksum on the senders; checksum on receivers).
        for t in trainers:
            phases = json.loads(t["metrics"][version - 1])["phases_s"]
            assert all(phases[p] > 0 for p in ("gather", "convert", "checksum", "transfer", "commit")), phases
        assert all(json.loads(m)["phases_s"]["checksum"] > 0 for m in reports), reports
    if "p2p_window_mb" in case["weight_sync"]:  # the window holds two rounds at once; a version takes more
        assert trainers[0]["share"]["slots"] == 2 and trainers[0]["share"]["rounds"] > 2, trainers[0]["share"]
    # The schedule: every trainer rank writes a part, none everything, the busiest about the mean.
    scheduled = [t["share"]["scheduled"] for t in trainers]
    assert sum(scheduled) == trainers[0]["share"]["egress"] and all(0 < b < sum(scheduled) for b in scheduled)
    for t in trainers:  # gathered bytes alive at once: the gather budget plus the largest tensor, at most
        assert t["share"]["gather_peak"] <= t["share"]["gather_budget"] + t["share"]["largest"], t["share"]
    # A unit's shards reach only the ranks that write its pieces (counted at torch.distributed), not every
    # member of the group as an all-gather would bring them.
    wanted = [t["share"]["gather_scheduled"] for t in trainers]
    assert [t["share"]["gathered"] for t in trainers] == [want * len(versions) for want, _ in wanted], wanted
    if any(every for _, every in wanted):
        assert sum(want for want, _ in wanted) < sum(every for _, every in wanted), wanted
    print(f"\n[{case['layout']} -> {case.get('engines', 1)} engine(s) TP={case['engine_tp']}, {backend}] "
          f"bytes written per trainer rank {scheduled} (busiest {trainers[0]['share']['busiest_over_mean']:.3f} x "
          f"the mean); received per inference rank {[json.loads(m)['bytes'] for m in trainers[0]['received'][0]]}"
          f" = shard bytes {shard_bytes}")


@pytest.mark.multiproc
@pytest.mark.timeout(420)
@pytest.mark.parametrize("staging_sets", [2, 1])
def test_a_failed_sender_aborts_everywhere_then_a_killed_one_leaves_engines_on_the_previous_version(staging_sets):
    from tests.support.jobs import run_pair

    timeout_s = 10.0
    # every failure is named in time: the survivor within timeout_s + 10 s of its sync's start, each engine
    # rank within timeout_s + 5 s of the sync message (scaled for load; a later one fails the rank)
    case = _case("torch", spec={"family": "qwen3_moe", "num_kv_heads": 1}, layout={"ep": 2}, engine_tp=2,
                 versions=4, imports=[__name__], record_failures=True, timeout_s=timeout_s,
                 fails_within_s={"trainer": timeout_s + 10, "engine": timeout_s + 5},
                 weight_sync={"transport": "p2p_faulty", "staging_sets": staging_sets})
    trainers, engines = run_pair(case, timeout=360, outcomes=True)

    assert trainers[KILLED_RANK] == ("exited", KILL_EXIT_CODE), trainers[KILLED_RANK]
    status, survivor = trainers[0]
    assert status == "ok", survivor
    aborted, dead = survivor["failures"]
    # Step 2: rank 1 failed to convert; every rank agreed to abort; step 3 synced the same version number.
    assert aborted["step"] == 2 and aborted["aborted"], aborted
    assert "injected conversion failure on trainer rank 1" in aborted["text"]
    assert len(survivor["metrics"]) == 2  # versions 1 and 2 (at step 3) went through
    # Step 4 (version 3): rank 1 died mid-transfer; the survivor names the dead peer (in time: fails_within_s).
    assert dead["step"] == 4 and not dead["aborted"] and "PeerFailureError" in dead["text"], dead["text"][-3000:]
    for rank, (status, engine) in engines.items():
        assert status == "ok", engine
        assert [h["version"] for h in engine["held"]] == [1, 1, 2]  # the aborted sync left version 1 live
        failure = engine["failure"]
        assert failure is not None and "PeerFailureError" in failure["text"], (rank, failure)
        assert failure["version"] == 2
        before = engine["held"][-1]["shards"]
        assert set(failure["shards"]) == set(before)
        changed = [n for n in before if not torch.equal(failure["shards"][n], before[n])]
        assert not changed, f"inference rank {rank} changed {changed[:5]} in a failed sync"
    last = [dead["text"].strip().splitlines()[-1]] + [e["failure"]["text"].strip().splitlines()[-1]
                                                     for _, e in engines.values()]
    print(f"\nsurvivor trainer rank 0, then the engine ranks, failed within their bounds (timeout_s={timeout_s:g}):"
          "\n  " + "\n  ".join(line[:300] for line in last))


def test_p2p_settings_are_validated_and_named():
    from megatron_sync.settings.config import P2P_BACKENDS, WeightSyncConfig
    from megatron_sync.transports.p2p.transport import MOVERS

    assert set(MOVERS) == set(P2P_BACKENDS)
    config = WeightSyncConfig(transport="p2p", p2p_backend="mooncake", p2p_protocol="rdma", p2p_device_name="mlx5_0")
    assert (config.p2p_backend, config.p2p_protocol) == ("mooncake", "rdma")
    for bad, words in [({"p2p_backend": "ucx"}, "p2p_backend='ucx' is not valid"),
                       ({"p2p_window_mb": -1}, "p2p_window_mb must be a number of MiB >= 0"),
                       ({"p2p_forward": "yes"}, "p2p_forward must be true or false"),
                       ({"p2p_protocol": "udp"}, "p2p_protocol='udp' is not valid"),
                       ({"p2p_local_hostname": ""}, "p2p_local_hostname must be"),
                       ({"engines": ["sglang=http://h:30000"]}, "SGLang's update API does not expose")]:
        with pytest.raises(ValueError, match=words):
            WeightSyncConfig(transport="p2p", **bad)
    assert WeightSyncConfig(transport="p2p", engines=["vllm=http://h:8000"]).engines == ("vllm=http://h:8000",)
