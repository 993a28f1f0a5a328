"""Agreeing on a bucket plan at start-up: every rank of a transport computes it, and all compare.

Each rank builds the plan (`megatron_sync.plan.buckets`, pure) from the exchanged metadata with its
own settings, then all-gather (digest, problem, checksum choice): a differing digest or
checksum, an engine whose expected tensors the plan does not cover exactly, or a layout
region that does not fit the tensors sent, fails every rank alike with PlanMismatchError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_sync.core.errors import PlanMismatchError
from megatron_sync.layout.rank import RankLayout
from megatron_sync.core.meta import TensorMeta
from megatron_sync.plan.buckets import KeepTogether, SyncPlan, build_plan, coverage_problem, layout_problem

if TYPE_CHECKING:
    from megatron_sync.transports.base import BucketTransport, Transport


def handshake_plan(transport: "BucketTransport", stage_metas: Optional[list[TensorMeta]],
                   bucket_size_bytes: int, keep_together: KeepTogether,
                   expected: Optional[list[TensorMeta]] = None, *, checksum: Optional[str] = None,
                   layout: Optional[RankLayout] = None) -> SyncPlan:
    """Return the SyncPlan every rank agrees on, or raise PlanMismatchError on every rank.

    Stage sources pass their stage's metadata, other ranks None; an inference rank passes
    what its engine expects and its rank `layout`. Each rank builds the plan with its *own*
    bucket size and keep-together groups, then all ranks all-gather (digest, problem,
    checksum choice); a differing digest or checksum, an engine whose expected tensors the
    plan does not cover exactly, or a layout region that does not fit the tensors sent,
    fails every rank alike.
    """
    plan = build_plan(transport.exchange_metadata(stage_metas), bucket_size_bytes, keep_together)
    problem = coverage_problem(plan.tensors(), expected) if expected is not None else None
    if problem is None and layout is not None:
        problem = layout_problem(layout, plan.tensors(), who=f"transport rank {transport.rank}")
    agree_on_plan(transport, plan.digest(), problem, checksum=checksum)
    return plan


def agree_on_plan(transport: "Transport", digest: str, problem: Optional[str], *,
                  checksum: Optional[str] = None) -> None:
    """All-gather every rank's plan digest, coverage problem and checksum choice; raise
    PlanMismatchError on every rank if the digests or checksums differ or any rank found a
    problem (None: its engine is covered exactly)."""
    reports = transport.all_gather_json([transport.rank, digest, problem, checksum])
    by_digest: dict[str, list[int]] = {}
    by_checksum: dict[str, list[int]] = {}
    for rank, digest, _, algorithm in reports:
        by_digest.setdefault(digest, []).append(rank)
        by_checksum.setdefault(str(algorithm), []).append(rank)
    if len(by_digest) > 1:
        groups = "; ".join(f"ranks {ranks} -> {d[:12]}" for d, ranks in sorted(by_digest.items(), key=lambda kv: kv[1]))
        raise PlanMismatchError(
            f"[transport rank {transport.rank}] ranks computed different sync plans ({groups}); "
            "check that every rank uses the same bucket_size_mb, model family and code version"
        )
    if len(by_checksum) > 1:
        groups = "; ".join(f"ranks {ranks} -> {c}" for c, ranks in sorted(by_checksum.items(), key=lambda kv: kv[1]))
        raise PlanMismatchError(
            f"[transport rank {transport.rank}] ranks check buckets differently ({groups}); set the same "
            "weight_sync.checksum on the trainer and the engines (auto resolves by where buckets live)"
        )
    problems = [(rank, p) for rank, _, p, _ in reports if p]
    if problems:
        raise PlanMismatchError(
            f"[transport rank {transport.rank}] the plan does not match the engines' expected tensors:\n"
            + "\n".join(f"  transport rank {r}: {p}" for r, p in problems)
        )
