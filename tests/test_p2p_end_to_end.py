"""P2P end to end: tiny Megatron models under TP / EP / TP+EP / PP into engines laid out differently.

A trainer job (real megatron-core on gloo) builds the distributed replica: each rank gathers
and converts only its assigned tensors. An inference job of reference-layout receivers
(one or two engines; KV heads replicated where the engine's TP exceeds them) gets the plan
inputs over the rendezvous store, and both sides agree on the plan digest. Each backend
(torch.distributed on gloo, Mooncake over TCP) then moves one version. The test checks,
against a single-rank conversion of the same weights cut through the reference engine's layout:
every receiver's shards bit for bit; bytes received at the transport == shard bytes; each
trainer rank's replica == its assigned share, and below its stage's total.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.dist import free_port
from tests.p2p_support import SENTINEL, receivers_of, ref, run_side_by_side, untouched_outside_placements
from tests.support.fakes import shard_of

BACKENDS = ("torch", "mooncake")
BUCKET = 16 * 1024
GATHER_BUDGET = 4096
SEED = 7


def _fleet(case, specs):
    return receivers_of([ref(tp) for tp in case["engines"]], specs, case["kv"])


def _mover(backend, group, trainers, receivers):
    from megatron_sync.transports.p2p.old_movers import MooncakeMover, TorchP2PMover

    if backend == "mooncake":
        return MooncakeMover(group.board, protocol="tcp", timeout_s=group.timeout_s)
    peers = {("sender", s): s for s in range(trainers)}
    peers.update({("receiver", i): trainers + i for i in range(receivers)})
    return TorchP2PMover(group, peers)


def _open(rank, world, port):
    from megatron_sync.session.group import init_transport_group

    return init_transport_group("127.0.0.1", port, world, rank, timeout=120, group_name="p2p_e2e")


def _agree_on_plan(group, plan):
    digests = group.all_gather_json(plan.digest())
    assert len(set(digests)) == 1, f"ranks computed different transfer plans: {digests}"


def _trainer(rank, world, case, port, receivers):
    from megatron_sync.convert import get_converter
    from megatron_sync.trainer.gather import GatherMemoryTracker
    from megatron_sync.transports.p2p.execute import send_share
    from megatron_sync.layout.rank import specs_to_wire
    from megatron_sync.transports.p2p.plan import build_transfer_plan, send_bytes_per_tensor
    from megatron_sync.transports.p2p.replica import DistributedReplica
    from megatron_sync.core.grid import ParallelLayout
    from megatron_sync.trainer.stream import MegatronWeightStream
    from tests.support import models
    from tests.support.dist import init_megatron

    init_megatron(**case["layout"])
    spec = models.ModelSpec(family=case["family"], num_kv_heads=case["kv"])
    chunks = models.build_model_chunks(spec)
    models.load_reference_weights(chunks, models.reference_weights(spec, seed=SEED), spec)
    converter = get_converter(case["family"], models.hf_config(spec), dtype=torch.bfloat16)
    specs = converter.tensor_specs()
    fleet = _fleet(case, specs)
    tracker = GatherMemoryTracker()
    stream = MegatronWeightStream(chunks, ParallelLayout.from_megatron(), converter, gather_budget_bytes=GATHER_BUDGET)
    replica = DistributedReplica(stream, rank=rank, cost=send_bytes_per_tensor(specs, [r.layout for r in fleet]),
                                 gather_budget_bytes=GATHER_BUDGET, tracker=tracker)
    replica.refresh()
    holders = replica.assignment.hf_holders()
    group = _open(rank, world + receivers, port)
    if rank == 0:
        group.board.post("plan_inputs", json.dumps({"specs": specs_to_wire(specs), "holders": holders}).encode())
    plan = build_transfer_plan(specs, holders, fleet, BUCKET)
    _agree_on_plan(group, plan)
    sent = {}
    for version, backend in enumerate(BACKENDS, start=1):
        mover = _mover(backend, group, world, receivers)
        sent[backend] = send_share(plan, rank, replica.tensors, mover, group.board, version=version).nbytes
        group.all_gather_json(rank)  # stands in for the all-ranks commit agreement
        mover.close()
    group.close()
    assignment = replica.assignment
    stage = [r.rank for r in assignment.ranks if r.pp == replica.me.pp]
    return {"held": replica.held_bytes, "assigned": assignment.bytes_per_rank()[rank],
            "stage_bytes": sum(assignment.bytes_per_rank()[r] for r in stage), "stage_ranks": len(stage),
            "gather_peak": tracker.peak, "largest": tracker.largest_tensor, "sent": sent,
            "planned_send": plan.bytes_from_sender().get(rank, 0)}


def _receiver(index, count, case, port, trainers):
    from megatron_sync.transports.p2p.execute import receive_shards
    from megatron_sync.layout.rank import specs_from_wire
    from megatron_sync.transports.p2p.plan import build_transfer_plan

    group = _open(trainers + index, trainers + count, port)
    inputs = json.loads(group.board.fetch("plan_inputs", 240))
    specs = specs_from_wire(inputs["specs"])
    plan = build_transfer_plan(specs, inputs["holders"], _fleet(case, specs), BUCKET)
    _agree_on_plan(group, plan)
    me = plan.receivers[index]
    out = {"engine": me.engine, "rank": me.rank, "shard_bytes": me.layout.shard_bytes}
    for version, backend in enumerate(BACKENDS, start=1):
        mover = _mover(backend, group, trainers, count)
        staging = torch.full((me.layout.nbytes,), SENTINEL, dtype=torch.uint8)
        mover.expose(index, staging)
        stats = receive_shards(plan, index, staging, mover, group.board, version=version, timeout_s=120)
        out[backend] = {"shards": {p.name: me.layout.destination(staging, p).clone() for p in me.layout.placements},
                        "received": stats.nbytes, "clean": untouched_outside_placements(me.layout, staging)}
        group.all_gather_json(index)
        mover.close()
    group.close()
    return out


def _reference_shards(case, engine_tp, rank):
    """Return the reference engine's params of the single-rank conversion of the same seeded weights."""
    from megatron_sync.convert import get_converter
    from megatron_sync.engines.reference.engine import ReferenceEngine
    from tests.support import models

    spec = models.ModelSpec(family=case["family"], num_kv_heads=case["kv"])
    cfg = models.hf_config(spec)
    converter = get_converter(case["family"], cfg, dtype=torch.bfloat16)
    full = {}
    for name, tensor in models.reference_weights(spec, seed=SEED).items():
        full.update(converter.convert(name, tensor))
    engine = ReferenceEngine(cfg, tp_rank=rank, tp_size=engine_tp, dtype=torch.bfloat16)
    return {name: shard_of(engine, name, full[name]) for name in full}


CASES = [
    pytest.param(dict(family="qwen3", kv=2, layout=dict(tp=2), trainers=2, engines=[1]), id="tp2-into-tp1"),
    pytest.param(dict(family="qwen3_moe", kv=1, layout=dict(ep=2), trainers=2, engines=[2]),
                 id="ep2-into-tp2-replicated-kv"),
    pytest.param(dict(family="qwen3_moe", kv=2, layout=dict(tp=2, ep=2), trainers=4, engines=[1, 2]),
                 id="tp2-ep2-into-two-engines"),
    pytest.param(dict(family="llama", kv=1, layout=dict(pp=2), trainers=2, engines=[2, 1]),
                 id="pp2-into-two-engines-replicated-kv"),
]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_p2p_sync_delivers_reference_shards_over_both_backends(case):
    import mooncake.engine  # noqa: F401 — a requirement (requirements-cpu.txt): missing is a failure
    receivers = sum(case["engines"])
    port = free_port()
    trainer_out, receiver_out = run_side_by_side([
        (_trainer, case["trainers"], (case, port, receivers)),
        (_receiver, receivers, (case, port, case["trainers"])),
    ], timeout=420)
    for got in receiver_out:
        want = _reference_shards(case, case["engines"][got["engine"]], got["rank"])
        for backend in BACKENDS:
            shards = got[backend]["shards"]
            assert set(shards) == set(want), f"{backend}: engine {got['engine']} rank {got['rank']} names differ"
            wrong = [n for n in want if not torch.equal(shards[n], want[n])]
            assert not wrong, f"{backend}: engine {got['engine']} rank {got['rank']}: {wrong[:5]}"
            assert got[backend]["received"] == got["shard_bytes"], (backend, got["received"], got["shard_bytes"])
            assert got[backend]["clean"], f"{backend}: bytes outside the shards were written"
    for rank, t in enumerate(trainer_out):
        assert t["held"] == t["assigned"] > 0, f"trainer rank {rank}: replica {t['held']} != share {t['assigned']}"
        if t["stage_ranks"] > 1:
            assert t["held"] < t["stage_bytes"], f"trainer rank {rank} holds its whole stage"
        assert t["gather_peak"] <= GATHER_BUDGET + t["largest"]
        assert t["sent"] == {b: t["planned_send"] for b in BACKENDS}
    print(f"\n[{case['layout']} -> engines {case['engines']}] replica bytes per trainer rank: "
          f"{[t['held'] for t in trainer_out]}, sent: {[t['planned_send'] for t in trainer_out]}, "
          f"received per inference rank: {[r['torch']['received'] for r in receiver_out]}")
