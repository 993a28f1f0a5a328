"""Device-direct P2P on GPU clusters (`transport: p2p` with NIXL or Mooncake): the time its schedule takes.

What the code does per version (`transports/p2p/schedule.py`, `build.py`, `balance.py`):

- every trainer rank that writes gathers over its TP / ETP group (NVLink inside a node) the units it
  sends (each member of the group sends its shard of a unit to the ranks that write the unit, and only
  to them), converts them on the GPU, copies each of its pieces into its registered arena and
  checksums it there (`wsum64`); a message is posted as soon as its pieces are staged, so gather,
  convert, staging and checksum overlap the wire, one NIC per GPU (GPUDirect RDMA), NVLink to a GPU
  of its own node;
- the head engine of each chain receives every byte it needs once, straight into its staging set (or a
  bounded receive window copied into it round by round), at its NIC; rows several of its ranks hold come
  once, to one of them, which relays them to the others once it verified their round (NVLink inside a
  node, the NIC across nodes, both directions at once); each later engine of the chain
  receives the same rounds from the engine before it, pipelined: it ends one round after the one
  before it;
- every report (a writer's round landed, with its checksums) goes through the notice store of the receiver's
  engine (one per engine, hosted beside the session's store: `session/shards.py`), which serves the posts
  and the takes one at a time while the bytes move: the transfer ends no sooner than the busiest store;
- the last round is verified on the GPU (wsum64), then two agreement rounds and the switch to the other
  staging set (no copy).

So the sync takes max(the busiest sender's production and writes, a head receiver's ingress, a head rank's
relays out, the busiest notice store), plus the last round's relays, (chain length - 1) rounds, the last
round's verification and the agreement. Into a bounded window, each round but the last can add a stall: the writes of a round wait until
the last round in its slot of the window was verified, relayed, copied out and released, and only the
rounds in the other slots arrive meanwhile. NIXL and Mooncake both write over RDMA from registered GPU memory
here, so they share this model (`local` measures each).
"""

from __future__ import annotations

import math

from megatron_sync.scale.hardware import HardwareProfile
from megatron_sync.scale.phases import Phase, SyncOptions, device_checksum_rate, engine_tail, gather_seconds, rate_of
from megatron_sync.scale.summary import PlanSummary, Traffic


def _sender(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions, s) -> dict[str, float]:
    """Return one sender's phases: its production (sequential on its GPU) and its writes."""
    totals = summary.extra["p2p"]
    traffic = summary.gather.get(s.rank)
    local = totals.local_sent.get(s.rank, 0)
    return {"gather (its units' shards from its group)": gather_seconds(traffic, profile),
            "convert": (traffic.converted if traffic else 0) / profile.hbm.value,
            "stage into arena": s.bytes / profile.device_copy,
            "checksum (wsum64)": s.bytes / device_checksum_rate(profile, options.checksum),
            "write": ((s.bytes - local) / profile.nic_per_gpu + local / profile.nvlink.value
                      + s.messages * profile.message_s.value)}


def _sender_end(phases: dict[str, float], nbytes: int, piece: int) -> float:
    """Return when a sender's last write lands: production and writes overlap, a piece at a time."""
    produce = sum(v for k, v in phases.items() if k != "write")
    part = min(1.0, piece / max(1, nbytes))
    return max(produce + phases["write"] * part, phases["write"] + produce * part)


def _hop_rate(summary: PlanSummary, profile: HardwareProfile) -> tuple[float, str]:
    """Return the rate and the link of a forward from rank r of one engine to rank r of the next."""
    fleet, trainer = summary.fleet, summary.trainer
    same = fleet.engines > 1 and all(fleet.node_of(r, trainer) == fleet.node_of(r + fleet.engine_ranks, trainer)
                                     for r in range(fleet.engine_ranks))
    return (profile.nvlink.value, "nvlink") if same else (profile.nic_per_gpu, "nic")


def _head_engine(summary: PlanSummary, profile: HardwareProfile, out: list[Phase]):
    """Append the head engine's phases to `out`: its ingress through its NIC and from its node, and the relays
    of rows its ranks share; return the heads, the (seconds, rank) of each phase and the relays' link."""
    totals = summary.extra["p2p"]
    heads = [r for r in summary.receivers if r.rank < totals.heads * summary.fleet.engine_ranks]
    relay = {r.rank: totals.relay.get(r.rank % summary.fleet.engine_ranks, Traffic()) for r in heads}
    ingress = max(((r.bytes - totals.local_received.get(r.rank, 0) - relay[r.rank].in_intra) / profile.nic_per_gpu,
                   r.rank) for r in heads)
    local_in = max(((totals.local_received.get(r.rank, 0) + relay[r.rank].in_intra) / profile.nvlink.value, r.rank)
                   for r in heads)
    relay_out = max((max(t.out_inter / profile.nic_per_gpu, t.out_intra / profile.nvlink.value), rank)
                    for rank, t in relay.items())
    out.append(Phase("receive (head engine)", ingress[0], f"inference rank {ingress[1]}", rate_of(profile, "nic")))
    if local_in[0]:
        out.append(Phase("receive from its node", local_in[0], f"inference rank {local_in[1]}",
                         rate_of(profile, "nvlink")))
    relay_link = "nic" if any(t.out_inter for t in relay.values()) else "nvlink"
    if relay_out[0]:
        out.append(Phase("relay rows its engine's ranks share", relay_out[0], f"inference rank {relay_out[1]}",
                         rate_of(profile, relay_link)))
    return heads, ingress, local_in, relay_out, relay_link


SENDER_LINKS = {"gather (its units' shards from its group)": "nvlink", "convert": "hbm", "stage into arena": "copy",
                "checksum (wsum64)": "wsum64", "write": "nic"}
"""The link or unit whose rate each of a sender's phases (`_sender`) runs at."""


def p2p_gpu(summary: PlanSummary, profile: HardwareProfile, options: SyncOptions):
    """Return the phases, total, bound and (no) CPU-seconds of a device-direct P2P sync (module doc)."""
    totals, opts = summary.extra["p2p"], summary.extra["options"]
    ends = []
    for s in summary.senders:
        phases = _sender(summary, profile, options, s)
        ends.append((_sender_end(phases, s.bytes, opts.piece_bytes), s.rank, phases))
    send_end, busiest, sender_phases = max(ends)
    out = [Phase(name, seconds, f"trainer rank {busiest}", rate_of(profile, SENDER_LINKS[name]))
           for name, seconds in sender_phases.items()]
    heads, ingress, local_in, relay_out, relay_link = _head_engine(summary, profile, out)
    hop_rate, hop_link = _hop_rate(summary, profile)
    round_bytes = min(opts.round_bytes, max(r.bytes for r in summary.receivers))
    hop = round_bytes / hop_rate + profile.message_s.value
    last_relay = relay_out[0] * round_bytes / max(r.bytes for r in heads)
    if last_relay:
        out.append(Phase("relay the last round", last_relay, f"inference rank {relay_out[1]}",
                         rate_of(profile, relay_link)))
    out.append(Phase("forward along the chain", (totals.chain - 1) * hop,
                     f"{totals.chain} engines per chain, rounds of {round_bytes / 2**20:,.0f} MiB",
                     rate_of(profile, hop_link)))
    window = round_bytes / profile.device_copy if opts.window_bytes else 0.0
    if window:
        out.append(Phase("copy the last round out of the window", window, "last engine", rate_of(profile, "copy")))
    verify = round_bytes / device_checksum_rate(profile, options.checksum)
    out.append(Phase("verify the last round (wsum64)", verify, "last engine", rate_of(profile, "wsum64")))
    # A bounded window of `slots` rounds: round r is written once round r - slots was verified, relayed, copied
    # out and released (a report and a release message); the slots - 1 rounds between arrive meanwhile, so
    # the writes stop only for what the turnaround takes beyond them, at every round but the last.
    rounds, turnaround = sender_rounds(summary), verify + window + last_relay + 2 * profile.message_s.value
    stall = max(0.0, turnaround - (opts.slots - 1) * round_bytes / profile.nic_per_gpu)
    turns = (rounds - 1) * stall if window else 0.0
    if turns:
        out.append(Phase("wait for each round's release (bounded window)", turns,
                         f"{rounds} rounds of {round_bytes / 2**20:,.0f} MiB", rate_of(profile, "copy")))
    notices, busiest_store = _notice_store(totals.notices, profile, out)
    transfer = max(send_end, ingress[0], local_in[0], relay_out[0], notices)
    tail = engine_tail(summary, profile, 2, options)
    total = (transfer + turns + last_relay + (totals.chain - 1) * hop + window + verify
             + sum(p.seconds for p in tail))
    if notices >= max(send_end, ingress[0], local_in[0], relay_out[0]):
        bound = busiest_store
    elif send_end >= max(ingress[0], local_in[0], relay_out[0]):
        bound = f"trainer rank {busiest}: production and writes ({send_end:.2f} s)"
    elif relay_out[0] > max(ingress[0], local_in[0]):
        bound = f"relays (inference rank {relay_out[1]}: rows its engine's ranks share)"
    else:
        bound = f"receive (head engine) (inference rank {ingress[1]}: its shard through its NIC)"
    return out + tail, total, bound, None


def _notice_store(notices: dict[int, tuple[int, int]], profile: HardwareProfile,
                  out: list[Phase]) -> tuple[float, str]:
    """Append the busiest engine notice store's phase to `out` and return its seconds and what it is: each
    store serves its engine's reports and takes one at a time while the bytes move, so the last round is not
    verified before it has served them all."""
    seconds, engine = max((r * profile.store_post_s.value + t * profile.store_take_s.value, e)
                          for e, (r, t) in notices.items())
    reports, takes = notices[engine]
    out.append(Phase("reports through the busiest notice store", seconds,
                     f"engine {engine}'s: {reports:,} reports, {takes:,} takes a version ({len(notices)} stores)",
                     rate_of(profile, "store")))
    return seconds, f"engine {engine}'s notice store: {reports:,} reports and {takes:,} takes, one at a time"


def sender_rounds(summary: PlanSummary) -> int:
    """Return how many forwarding rounds a head receiver's shard is cut into (for the report)."""
    opts = summary.extra["options"]
    return max(1, math.ceil(max(r.bytes for r in summary.receivers) / opts.round_bytes))
