"""The P2P schedule as tables of invariants (pure, no processes): every byte once, from a rank that holds it,
balanced, one copy out of the trainer per layout, rounds and arenas that fit and never wait backwards."""

from __future__ import annotations

import pytest
import torch

from megatron_sync.layout.regions import Region
from megatron_sync.transports.p2p.build import build_schedule, feeds_of
from megatron_sync.transports.p2p.holders import Holders, group_of
from megatron_sync.transports.p2p.schedule import TRAINER, InferenceRank, Piece, ScheduleOptions
from tests.p2p_support import fusing, ref, schedule_of, trainer_grid, units_of_specs

CASES = [
    pytest.param("qwen3", [ref(1)], dict(tp=2), 4096, id="ref-tp1-from-tp2"),
    pytest.param("llama", [ref(2)], dict(tp=2, dp=2), 4096, id="ref-tp2-replicated-kv"),
    pytest.param("qwen3_moe", [ref(2), ref(2), ref(2)], dict(tp=2, dp=2, ep=2), 8192, id="three-engines-one-layout"),
    pytest.param("qwen3_moe", [fusing(2, expert_parallel=True), ref(2), fusing(2, expert_parallel=True)],
                 dict(dp=2, ep=2), 4096, id="two-layouts-chained"),
    pytest.param("qwen3_moe", [fusing(4)], dict(tp=2, pp=2, ep=2), 4096, id="fusing-tp4-from-pp2"),
    pytest.param("deepseek_v3", [fusing(2), ref(4)], dict(tp=2, dp=2), 4096, id="mla-two-engines"),
]


@pytest.mark.parametrize("family,engines,grid,piece", CASES)
def test_every_receiver_gets_each_of_its_placements_exactly_once(family, engines, grid, piece):
    _, s = schedule_of(family, engines, grid, piece_bytes=piece)
    for index, receiver in enumerate(s.receivers):
        offsets = receiver.layout.param_offsets
        mine = sorted((p.dst, p.dst + p.nbytes, p.name) for p in s.incoming(index))
        for (_, end, _), (start, _, _) in zip(mine, mine[1:]):
            assert end <= start, "two pieces overlap in one receiver's staging"
        merged = []
        for start, end, name in mine:  # the pieces of one placement tile it with no gap
            if merged and merged[-1][1] == start and merged[-1][2] == name:
                merged[-1] = (merged[-1][0], end, name)
            else:
                merged.append((start, end, name))
        want = sorted((offsets[p.param] + p.offset, offsets[p.param] + p.offset + p.nbytes, p.name)
                      for p in receiver.layout.placements if p.nbytes)
        assert merged == want
        assert s.bytes_to_receiver()[index] == receiver.layout.shard_bytes


@pytest.mark.parametrize("family,engines,grid,piece", CASES)
def test_every_piece_is_written_by_a_rank_that_holds_its_tensor(family, engines, grid, piece):
    _, s = schedule_of(family, engines, grid, piece_bytes=piece)
    holders = Holders(s.ranks)
    unit_of = {name: u for u in s.units for name, _ in u.hf}
    by_rank = {r.rank: r for r in s.ranks}
    for p in s.pieces:
        unit = unit_of[p.name]
        assert by_rank[p.sender] in holders.of(unit), (p.name, p.sender)
        assert group_of(unit, by_rank[p.sender]) in s.balance.gathering[unit.name]


@pytest.mark.parametrize("family,engines,grid,piece", CASES)
def test_the_trainer_writes_one_copy_per_layout_and_engines_forward_the_rest(family, engines, grid, piece):
    _, s = schedule_of(family, engines, grid, piece_bytes=piece)
    heads = [i for i, feed in enumerate(s.feeds) if feed == TRAINER]
    held: dict[tuple, int] = {}  # what the heads hold, each placement's rows once
    for i in heads:
        for p in s.receivers[i].layout.placements:
            held[(p.name, p.source)] = p.nbytes
    assert s.trainer_egress() == sum(held.values())
    several = any(r.rank > 0 for r in s.receivers)  # norms are on every rank of an engine
    assert (s.trainer_egress() < sum(s.receivers[i].layout.shard_bytes for i in heads)) == several
    assert {p.receiver for p in s.pieces} == set(heads)
    for i, feed in enumerate(s.feeds):
        if feed != TRAINER:  # same rank of the engine before it, with the same layout
            assert s.receivers[feed].rank == s.receivers[i].rank
            assert s.receivers[feed].engine < s.receivers[i].engine
            assert s.receivers[feed].layout.digest() == s.receivers[i].layout.digest()
            assert s.forwarded_bytes()[feed] == s.receivers[i].layout.shard_bytes


@pytest.mark.parametrize("family,engines,grid,piece", CASES)
def test_rows_several_heads_hold_come_once_and_their_owner_relays_them(family, engines, grid, piece):
    _, s = schedule_of(family, engines, grid, piece_bytes=piece)
    assert bool(s.relays) == any(r.rank > 0 for r in s.receivers), "norms are on every rank of an engine"
    for relay in s.relays:
        origin = s.piece(relay.origin)
        assert relay.relayed and not origin.relayed and relay.via == origin.receiver != relay.receiver
        assert s.feeds[relay.via] == s.feeds[relay.receiver] == TRAINER  # between heads only
        assert (relay.name, relay.region, relay.row, relay.rows, relay.nbytes, relay.round, relay.sender) == (
            origin.name, origin.region, origin.row, origin.rows, origin.nbytes, origin.round, origin.sender)
        assert relay in s.relays_from(relay.via, relay.round) and relay in s.incoming(relay.receiver)
        assert relay.sender not in s.senders_of(relay.receiver, relay.round) or any(
            p.sender == relay.sender for p in s.round_pieces(relay.receiver, relay.round) if not p.relayed)
    relayed = s.relayed_bytes()
    loads = [relayed[i] for i, feed in enumerate(s.feeds) if feed == TRAINER]  # spread over the heads
    assert max(loads) - min(loads) <= max(p.nbytes for p in s.pieces) * len(loads)


def test_without_forwarding_the_trainer_writes_every_rank_its_copy():
    _, s = schedule_of("qwen3", [ref(2)], dict(tp=2), piece_bytes=4096, forward=False)
    assert not s.relays and s.trainer_egress() == sum(r.layout.shard_bytes for r in s.receivers)


def test_a_bounded_window_still_relays_so_the_trainer_writes_one_copy():
    _, unbounded = schedule_of("qwen3", [ref(2), ref(2)], dict(tp=2), piece_bytes=4096)
    _, s = schedule_of("qwen3", [ref(2), ref(2)], dict(tp=2), piece_bytes=4096, window_bytes=8192)
    assert s.relays and s.trainer_egress() == unbounded.trainer_egress() < sum(
        r.layout.shard_bytes for r in s.receivers[:2])
    for relay in s.relays:  # lands in its origin's round, inside the peer's window, beside nothing else
        assert relay.round == s.piece(relay.origin).round
        assert relay.window + relay.nbytes <= 8192
    assert max(s.rounds) > 1 and _runs_to_the_end(s)


def test_three_engines_of_one_layout_form_a_chain_and_without_forwarding_all_are_heads():
    _, s = schedule_of("qwen3", [ref(2), ref(2), ref(2)], dict(tp=2), piece_bytes=4096)
    assert s.feeds == (TRAINER, TRAINER, 0, 1, 2, 3)
    assert s.successor(0) == 2 and s.successor(2) == 4 and s.successor(4) is None
    _, flat = schedule_of("qwen3", [ref(2), ref(2), ref(2)], dict(tp=2), piece_bytes=4096, forward=False)
    assert flat.feeds == (TRAINER,) * 6
    one_engine = sum(r.layout.shard_bytes for r in s.receivers[:2])
    assert flat.trainer_egress() == 3 * one_engine and not flat.relays  # every rank its own copy
    assert s.trainer_egress() < one_engine  # one copy, its ranks relaying what they both hold


def test_the_busiest_sender_carries_about_the_mean():
    # Dense only, data-parallel replicas: every rank of the stage holds every tensor after its gather.
    _, s = schedule_of("qwen3", [ref(2)], dict(tp=2, dp=2), piece_bytes=2048)
    assert s.balance.busiest_over_mean() <= 1.1, s.balance.load
    # A large replicated tensor (the embedding, whole on every reference rank) is spread by rows.
    embed = [p for p in s.pieces if p.name == "model.embed_tokens.weight"]
    assert len({p.sender for p in embed}) > 1


@pytest.mark.parametrize("window,round_bytes,slots", [(6000, 0, 1), (20000, 0, 2), (40000, 8192, 4)])
def test_bounded_windows_hold_each_round_in_its_slot_and_senders_never_wait_backwards(window, round_bytes, slots):
    _, s = schedule_of("qwen3_moe", [ref(2), ref(2)], dict(tp=2, ep=2), piece_bytes=4096, window_bytes=window,
                       round_bytes=round_bytes)
    assert s.slots == slots  # as many rounds of round_bytes as fit, at least two where two pieces fit
    slot = window if slots == 1 else window // slots // 64 * 64
    for receiver in range(len(s.receivers)):
        assert s.window_bytes(receiver) <= window
        for round_ in range(s.rounds[receiver]):
            spans = sorted((p.window, p.window + p.nbytes) for p in s.round_pieces(receiver, round_))
            assert all(round_ % slots * slot <= a and b <= (round_ % slots + 1) * slot for a, b in spans)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two pieces overlap in a window"
    for sender in {p.sender for p in s.pieces}:  # every sender's pieces to a receiver come in round order
        last: dict[int, int] = {}
        for p in s.sender_queue(sender):
            assert p.round >= last.get(p.receiver, 0)
            last[p.receiver] = p.round
    assert max(s.rounds) > 1 and s.relays
    assert _runs_to_the_end(s)


@pytest.mark.parametrize("family,engines,grid,piece", CASES)
@pytest.mark.parametrize("window", [1, 3])
def test_every_rank_waiting_on_bounded_windows_and_relays_gets_to_the_end(family, engines, grid, piece, window):
    """Play the protocol's waits (`writer`, `rounds`) on the schedule until nothing moves: every write, relay
    and release happens, whatever the layouts, with windows of one to three pieces."""
    _, s = schedule_of(family, engines, grid, piece_bytes=piece, window_bytes=window * piece)
    assert _runs_to_the_end(s)


def _runs_to_the_end(s) -> bool:
    """Whether the waits of a bounded-window version (heads only: forwarding adds a chain behind each) all end.

    A sender posts its messages in order, each once its receiver released the last round in the slot of the
    window it lands in (`Schedule.reuses`). A head receiver, round by round: takes the senders' messages,
    relays its pieces to each peer once that peer released the last round in the slot, takes the relays into
    it, releases the round."""
    heads = [i for i, feed in enumerate(s.feeds) if feed == TRAINER]
    queues = {sender: s.sender_messages(sender) for sender in {p.sender for p in s.pieces}}
    at = dict.fromkeys(queues, 0)  # sender -> messages posted
    written: set[int] = set()
    released = dict.fromkeys(heads, -1)
    state = {i: [0, 0] for i in heads}  # head -> [round, relay peers done (-1: trainer's writes not all in yet)]
    expected = {(m.receiver, m.round): set() for m in s.messages}
    for m in s.messages:
        expected[(m.receiver, m.round)].add(m.index)
    relayed: set[tuple[int, int, int]] = set()  # (owner, peer, round)
    moved = True
    while moved:
        moved = False
        for sender, queue in queues.items():
            while at[sender] < len(queue) and released[queue[at[sender]].receiver] >= s.reuses(queue[at[sender]].round):
                written.add(queue[at[sender]].index)
                at[sender], moved = at[sender] + 1, True
        for i in heads:
            moved |= _step(s, i, state, released, written, expected, relayed)
    return all(at[k] == len(q) for k, q in queues.items()) and all(state[i][0] == s.rounds[i] for i in heads)


def _step(s, i, state, released, written, expected, relayed) -> bool:
    round_, done = state[i]
    if round_ == s.rounds[i] or not expected.get((i, round_), set()) <= written:
        return False
    peers = sorted({p.receiver for p in s.relays_from(i, round_)})
    while done < len(peers) and released[peers[done]] >= s.reuses(round_):
        relayed.add((i, peers[done], round_))
        done += 1
    moved, state[i][1] = done > state[i][1], done
    into = {(p.via, i, round_) for p in s.round_pieces(i, round_) if p.relayed}
    if done < len(peers) or not into <= relayed:
        return moved
    released[i], state[i] = round_, [round_ + 1, 0]
    return True


def test_an_unbounded_window_is_the_staging_set_cut_into_rounds_that_pace_forwarding():
    _, s = schedule_of("qwen3", [ref(2), ref(2)], dict(tp=2), piece_bytes=2048, round_bytes=16384)
    assert all(p.window == p.dst for p in s.pieces)
    assert s.window_bytes(0) == s.receivers[0].layout.nbytes
    assert s.rounds[0] > 1 and s.rounds[2] == s.rounds[0]
    assert [p.index for p in s.incoming(2)] == [p.index for p in s.incoming(0)]


@pytest.mark.parametrize("arena", [0, 8192])
def test_arenas_hold_each_arena_round_and_messages_batch_what_lies_in_one(arena):
    _, s = schedule_of("qwen3_moe", [ref(2)], dict(tp=2, ep=2), piece_bytes=4096, arena_bytes=arena)
    for sender in {p.sender for p in s.pieces}:
        queue = s.sender_queue(sender)
        assert [p.arena_round for p in queue] == sorted(p.arena_round for p in queue)
        for round_ in {p.arena_round for p in queue}:
            spans = sorted((p.arena, p.arena + p.nbytes) for p in queue if p.arena_round == round_)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
            assert not arena or spans[-1][1] <= arena
        assert s.arena_bytes(sender) <= (arena or sum(p.nbytes for p in queue) + 64 * len(queue))
    covered = sorted(i for m in s.messages for i in m.pieces)
    assert covered == list(range(len(s.pieces)))
    for m in s.messages:
        pieces = [s.pieces[i] for i in m.pieces]
        assert {(p.sender, p.receiver, p.round, p.arena_round) for p in pieces} == {
            (m.sender, m.receiver, m.round, pieces[0].arena_round)}
        assert m.nbytes == sum(p.nbytes for p in pieces) and (m.nbytes <= 4096 or len(pieces) == 1)


def test_equal_inputs_give_equal_digests_and_an_option_changes_it():
    _, a = schedule_of("qwen3", [ref(2)], dict(tp=2), piece_bytes=4096)
    _, b = schedule_of("qwen3", [ref(2)], dict(tp=2), piece_bytes=4096)
    _, c = schedule_of("qwen3", [ref(2)], dict(tp=2), piece_bytes=4096, window_bytes=8192)
    assert a.digest() == b.digest() != c.digest()


def test_a_tensor_no_trainer_rank_produces_is_named():
    specs, s = schedule_of("qwen3", [ref(1)], dict(tp=1), piece_bytes=4096)
    units = [u for u in units_of_specs(specs) if "lm_head" not in u.hf[0][0]]
    with pytest.raises(ValueError, match=r"needs lm_head.weight, but no trainer rank converts it"):
        build_schedule(units, trainer_grid(), specs, s.receivers, ScheduleOptions(piece_bytes=4096))


def test_options_refuse_an_arena_smaller_than_a_piece():
    with pytest.raises(ValueError, match="arena_bytes=100 is smaller than one piece"):
        ScheduleOptions(piece_bytes=4096, arena_bytes=100)


def test_feeds_chain_engines_by_layout_in_engine_order():
    _, s = schedule_of("qwen3_moe", [ref(2), fusing(2), ref(2), fusing(2)], dict(tp=2), piece_bytes=4096)
    receivers = [InferenceRank(r.engine, r.rank, r.layout) for r in s.receivers]
    assert feeds_of(receivers, True) == (TRAINER, TRAINER, TRAINER, TRAINER, 0, 1, 2, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("region", ["columns", "rows"])
@pytest.mark.parametrize("offset", [0, 1])
def test_a_piece_copies_its_rows_bytes_into_any_slot_strided_or_not_aligned_or_not(dtype, region, offset):
    """A row-parallel shard's columns are strided: they are staged in one copy into a slot aligned to the
    element, and through a contiguous copy into one that is not (offset 1); either way the slot holds the
    bytes of the reference rows, as contiguous rows, and nothing around the slot is touched."""
    full = torch.randn((6, 8)).to(dtype)
    box = Region.box((6, 8), 1, 2, 4) if region == "columns" else Region.box((6, 8), 0, 1, 4)
    want = (full[1:3, 2:6] if region == "columns" else full[2:4]).contiguous().view(-1).view(torch.uint8)
    piece = Piece(0, 0, 0, "w", box, 1, 2, 0, want.numel(), 0, 0, 0, 0)
    buffer = torch.full((piece.nbytes + 2 * full.element_size(),), 7, dtype=torch.uint8)
    slot = buffer[offset:offset + want.numel()]
    piece.copy_into(slot, full)
    assert torch.equal(slot, want)
    assert torch.equal(buffer[:offset], torch.full((offset,), 7, dtype=torch.uint8))
    assert bool((buffer[offset + want.numel():] == 7).all())
