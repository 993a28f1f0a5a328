"""Engine to engine: a committed engine sends its live staging set to an engine of the same layout.

Two engines of one layout hold the same bytes rank for rank (each rank's staging set is its params as the
layout places them), so a relay is one point-to-point copy per rank: rank r of the source engine sends its
live set to rank r of the destination, over a group of both engines' ranks built for this relay alone (a
part of the sync session, `relay_part`). Before any byte moves, every rank shows its layout digest, the
version it holds or expects and its set size; a pair that differs is refused on both sides by name. The
source sends the set's checksum after the bytes; the destination checks it. The destination's commit then
runs the usual agreement rounds with the trainer over its own link (`WeightReceiver.receive_relayed`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_sync.core.checksum import checksum
from megatron_sync.core.errors import CorruptBucketError
from megatron_sync.transports.base import BucketHeader
from megatron_sync.session.group import transport_group_over

GROUP_NAME = "megatron_sync_relay"


def relay_part(version: int, source: tuple[int, int], destination: tuple[int, int]) -> str:
    """Return the session part of one relay: (engine, generation) of the source and of the destination."""
    return f"relay/v{version}/e{source[0]}g{source[1]}-e{destination[0]}g{destination[1]}"


def _group(part: Any, ranks: int, rank: int, backend: str, timeout_s: float) -> Any:
    return transport_group_over(part, 2 * ranks, rank, backend=backend, timeout=timeout_s, group_name=GROUP_NAME)


def _check_pairs(shown: list[dict], ranks: int) -> Optional[str]:
    """Return why the relay cannot go ahead (the same answer on every rank), or None."""
    problems = []
    for r in range(ranks):
        source, destination = shown[r], shown[ranks + r]
        if source["version"] is None:
            problems.append(f"source rank {r} holds no version it committed (start-up weights are not relayed)")
        elif source["version"] != destination["version"]:
            problems.append(f"source rank {r} holds version {source['version']}, destination rank {r} expects "
                            f"{destination['version']}")
        if source["layout"] != destination["layout"] or source["nbytes"] != destination["nbytes"]:
            problems.append(f"rank {r}'s layouts differ (source {source['layout'][:12]}, {source['nbytes']} bytes; "
                            f"destination {destination['layout'][:12]}, {destination['nbytes']} bytes): only "
                            "engines of one layout relay to each other")
    return "; ".join(problems) or None


def send_live_set(part: Any, *, ranks: int, rank: int, live: Optional[tuple[int, torch.Tensor]], layout: str,
                  algorithm: str, backend: str, timeout_s: float) -> int:
    """Source rank `rank` (of `ranks`): send `live` = (version, set bytes) to the destination's rank `rank`;
    return the bytes sent. Raises ValueError when the pair does not fit, PeerFailureError when the peer is gone."""
    group = _group(part, ranks, rank, backend, timeout_s)
    try:
        version, data = live if live is not None else (None, None)
        shown = group.all_gather_json({"layout": layout, "version": version,
                                       "nbytes": None if data is None else data.numel()})
        problem = _check_pairs(shown, ranks)
        if problem is not None:
            raise ValueError(f"relay refused: {problem}")
        payload = data if data.device == group.device else data.to(group.device)
        sent = group.send(payload, ranks + rank, tag=0)
        header = BucketHeader(version, -1, data.numel(), checksum(data, algorithm)).to_tensor(group.device)
        group.send(header, ranks + rank, tag=1).wait()
        sent.wait()
        return data.numel()
    finally:
        group.close()


def receive_live_set(part: Any, *, ranks: int, rank: int, version: int, target: torch.Tensor, layout: str,
                     algorithm: str, backend: str, timeout_s: float) -> None:
    """Destination rank `rank`: receive the source's rank `rank` set of `version` into `target` and check it.
    Raises ValueError (the pair does not fit), CorruptBucketError (checksum) or PeerFailureError (source gone)."""
    group = _group(part, ranks, ranks + rank, backend, timeout_s)
    try:
        shown = group.all_gather_json({"layout": layout, "version": version, "nbytes": target.numel()})
        problem = _check_pairs(shown, ranks)
        if problem is not None:
            raise ValueError(f"relay refused: {problem}")
        wire = target if target.device == group.device else torch.empty_like(target, device=group.device)
        header_t = torch.zeros(4, dtype=torch.int64, device=group.device)
        group.recv(wire, rank, tag=0).wait()
        group.recv(header_t, rank, tag=1).wait()
        if wire is not target:
            target.copy_(wire)
        header = BucketHeader.from_tensor(header_t)
        if (header.version, header.nbytes) != (version, target.numel()):
            raise CorruptBucketError(f"relay header says version {header.version}, {header.nbytes} bytes; expected "
                                     f"version {version}, {target.numel()} bytes")
        if algorithm != "none":
            got = checksum(target, algorithm)
            if got != header.checksum:
                raise CorruptBucketError(f"relayed set of version {version}: {algorithm} {got:#x} != source's "
                                         f"{header.checksum:#x}; not committed")
    finally:
        group.close()
