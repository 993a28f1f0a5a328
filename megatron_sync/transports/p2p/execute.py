"""Walking a transfer plan: senders pack and write their messages, receivers verify what landed.

Out of band, on the control channel, each sender posts one report per receiver once its last
message to that receiver is written: the checksum of every range (`weight_sync.checksum`, the
one mechanism of `megatron_sync.core.checksum`; none with "none") and the bytes the transport
accepted, or the error that stopped it (a sender that fails also sends filler in place of its
unsent messages, so two-sided receives finish). A receiver waits (bounded) for its own
receives, which fail at once when a two-sided sender dies, then for the reports of all its
senders, and checks every range's checksum against its staging buffer. Committing the staged
version is the all-ranks agreement's job, not this module's.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from megatron_sync.core.checksum import checksum
from megatron_sync.core.errors import CorruptBucketError, PeerFailureError, SenderFailedError
from megatron_sync.transports.p2p.movers import ByteMover, Control
from megatron_sync.transports.p2p.plan import Range, TransferPlan


def report_key(version: int, sender: int, receiver: int, attempt: int = 0) -> str:
    """Return the control key of `sender`'s report to `receiver` for `version` (its `attempt`-th sync:
    a version that failed is sent again under the same number, and must not read the old reports)."""
    return f"p2p/v{version}.{attempt}/report/{sender}/{receiver}"


@dataclass
class TransferStats:
    """What one rank moved in one sync: bytes per peer, ranges, seconds."""

    bytes_per_peer: dict[int, int] = field(default_factory=dict)
    ranges: int = 0
    seconds: float = 0.0
    checksum_seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        """Return the bytes moved with every peer together."""
        return sum(self.bytes_per_peer.values())


def pack(ranges: list[Range], replica: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """Copy the ranges' bytes from the full tensors in `replica` into `buffer`, back to back; return the used part."""
    at = 0
    for r in ranges:
        buffer[at:at + r.nbytes].copy_(r.source(replica[r.name]))
        at += r.nbytes
    return buffer[:at]


def send_share(plan: TransferPlan, sender: int, replica: Mapping[str, torch.Tensor], mover: ByteMover,
               control: Control, *, version: int, attempt: int = 0, algorithm: str = "xxh3",
               set_offsets: Mapping[int, int] | None = None) -> TransferStats:
    """Send every message of `sender` in its queue order; post one report per receiver.

    `algorithm` checksums every range ("none": no checksums); `set_offsets[receiver]` is where
    the receiver's target staging set starts in what it exposed. On a failure, every receiver
    still waiting for this sender gets the error as its report (so it fails at once instead
    of timing out), then the error is raised.
    """
    start = time.perf_counter()
    queue = plan.sender_queue(sender)
    if not queue:
        return TransferStats()
    left = {}
    for m in queue:
        left[m.receiver] = left.get(m.receiver, 0) + 1
    sums: dict[int, list[list[int]]] = {receiver: [] for receiver in left}
    sent = {receiver: sum(len(m.ranges) for m in queue if m.receiver == receiver) for receiver in left}
    stats = TransferStats()
    before = mover.bytes_written
    buffer = mover.send_buffer(max(m.nbytes for m in queue))
    done = 0
    try:
        for done, m in enumerate(queue):
            ranges = [plan.ranges[i] for i in m.ranges]
            payload = pack(ranges, replica, buffer)
            stats.checksum_seconds -= time.perf_counter()
            at = 0
            for r in ranges:
                if algorithm != "none":
                    sums[m.receiver].append([r.index, checksum(payload[at:at + r.nbytes], algorithm)])
                at += r.nbytes
            stats.checksum_seconds += time.perf_counter()
            mover.write(m, plan.ranges, payload, (set_offsets or {}).get(m.receiver, 0))
            stats.ranges += len(ranges)
            left[m.receiver] -= 1
            if left[m.receiver] == 0:
                moved = mover.bytes_written.get(m.receiver, 0) - before.get(m.receiver, 0)
                stats.bytes_per_peer[m.receiver] = moved
                report = {"checksums": sums.pop(m.receiver), "bytes": moved, "ranges": sent[m.receiver]}
                control.post(report_key(version, sender, m.receiver, attempt), json.dumps(report).encode())
    except Exception as exc:
        error = f"trainer rank {sender}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        _give_up(queue[done:], sorted(sums), plan, mover, control,
                 lambda receiver: report_key(version, sender, receiver, attempt), error, buffer)
        raise
    stats.seconds = time.perf_counter() - start
    return stats


def fail_share(plan: TransferPlan, sender: int, mover: ByteMover, control: Control, *, version: int,
               error: str, attempt: int = 0) -> None:
    """Tell every receiver of `sender` that it failed before sending `version` (`error` says why).

    Two-sided movers get filler in place of every message, so the receivers' posted
    receives finish and the transport stays usable for the next version.
    """
    queue = plan.sender_queue(sender)
    if queue:
        buffer = mover.send_buffer(max(m.nbytes for m in queue))
        _give_up(queue, sorted({m.receiver for m in queue}), plan, mover, control,
                 lambda receiver: report_key(version, sender, receiver, attempt), error, buffer)


def _give_up(messages, receivers, plan: TransferPlan, mover: ByteMover, control: Control,
             key_of: Callable[[int], str], error: str, buffer: torch.Tensor) -> None:
    """Send filler for `messages` (skipping receivers that are gone), then post `error` to `receivers`."""
    gone: set[int] = set()
    for m in messages:
        if m.receiver in gone:
            continue
        try:
            mover.abandon(m, plan.ranges, buffer[:m.nbytes])
        except Exception:  # noqa: BLE001 — that receiver is gone; the others still wait for filler
            gone.add(m.receiver)
    for receiver in receivers:
        try:
            control.post(key_of(receiver), json.dumps({"error": error}).encode())
        except Exception:  # noqa: BLE001 — the store is gone: every receiver fails on it by itself
            return


def receive_shards(plan: TransferPlan, receiver: int, staging: torch.Tensor, mover: ByteMover,
                   control: Control, *, version: int, timeout_s: float, attempt: int = 0,
                   algorithm: str = "xxh3") -> TransferStats:
    """Receive this receiver's ranges into `staging` (its target staging set), verify each range's
    `algorithm` checksum (none with "none"); return what arrived.

    Waits (bounded by `timeout_s` in all) for the receives, then for every sender's
    report. Raises PeerFailureError when a sender died or stays silent (a two-sided
    transport is then unusable: receives may still be pending), SenderFailedError when
    a sender reported its own failure, and CorruptBucketError naming the range when
    bytes differ from what was sent. The caller keeps the previous version either way.
    """
    start = time.perf_counter()
    deadline = start + timeout_s
    messages = plan.incoming(receiver)
    pending = mover.expect(receiver, messages, plan.ranges, staging)
    try:
        arrived = pending.wait(max(deadline - time.perf_counter(), 0.001))
    except PeerFailureError as e:
        raise PeerFailureError(f"receiver {receiver}: version {version} did not arrive in full (a sender died, "
                               f"or sent nothing within timeout_s={timeout_s:g}s): {e}") from e
    reports = _collect_reports(control, version, attempt, receiver, sorted({m.sender for m in messages}),
                               deadline, timeout_s)
    stats = TransferStats(bytes_per_peer=arrived or {s: r["bytes"] for s, r in reports.items()})
    verify_start = time.perf_counter()
    stats.ranges = sum(r["ranges"] for r in reports.values())
    checked = _verify(plan, receiver, staging, reports, algorithm)
    stats.checksum_seconds = time.perf_counter() - verify_start
    expected = sum(len(m.ranges) for m in messages)
    if stats.ranges != expected or (algorithm != "none" and checked != expected):
        raise CorruptBucketError(f"receiver {receiver}: {stats.ranges} ranges reported ({checked} checksummed), "
                                 f"{expected} planned")
    stats.seconds = time.perf_counter() - start
    return stats


def _collect_reports(control: Control, version: int, attempt: int, receiver: int, senders: list[int],
                     deadline: float, timeout_s: float) -> dict[int, dict]:
    """Return every sender's report (consumed: deleted from the store); raise on an error report or silence."""
    reports: dict[int, dict] = {}
    for sender in senders:
        key = report_key(version, sender, receiver, attempt)
        try:
            reports[sender] = json.loads(control.fetch(key, max(deadline - time.perf_counter(), 0.001)))
        except PeerFailureError as e:
            raise PeerFailureError(f"receiver {receiver}: trainer rank {sender} sent no report for version "
                                   f"{version} within {timeout_s:g}s: {e}") from e
        control.delete(key)
    failed = [r["error"] for r in reports.values() if "error" in r]
    if failed:
        raise SenderFailedError(f"receiver {receiver}: a sender failed mid-transfer of version {version}: {failed[0]}")
    return reports


def _verify(plan: TransferPlan, receiver: int, staging: torch.Tensor, reports: dict[int, dict],
            algorithm: str) -> int:
    """Check every reported range's checksum against `staging`; return how many were checked."""
    checked = 0
    for sender, report in reports.items():
        for index, want in report["checksums"]:
            r = plan.ranges[index]
            if r.receiver != receiver or checksum(staging[r.dst:r.dst + r.nbytes], algorithm) != want:
                raise CorruptBucketError(
                    f"receiver {receiver}: range {index} of {r.name} (rows {r.row}..{r.row + r.rows - 1}, "
                    f"{r.nbytes} bytes from trainer rank {sender}) does not match its checksum; nothing is applied"
                )
            checked += 1
    return checked
