"""Everyone fails together: share each rank's status before a stage and raise on all ranks."""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed as dist


class AgreedFailure(RuntimeError):
    """Raised on every rank when any rank of the group failed; names each failing rank."""

    def __init__(self, what: str, failures: list[tuple[int, str]]):
        self.failures = failures
        lines = "\n".join(f"  [rank {rank}] {message}" for rank, message in failures)
        super().__init__(f"{what} failed on {len(failures)} rank(s):\n{lines}")


def agree(error: str | None, *, what: str, group: Any = None) -> None:
    """All-gather every rank's error (None when fine); raise `AgreedFailure` on all ranks if any."""
    if not (dist.is_available() and dist.is_initialized()):
        statuses = [error]
        ranks = [0]
    else:
        statuses = [None] * dist.get_world_size(group)
        dist.all_gather_object(statuses, error, group=group)
        ranks = list(range(len(statuses)))
    failures = [(r, e) for r, e in zip(ranks, statuses) if e is not None]
    if failures:
        raise AgreedFailure(what, failures)


@contextmanager
def failing_together(what: str, group: Any = None) -> Iterator[None]:
    """Run a block; afterwards every rank learns whether any rank's block raised.

    A local exception is re-raised as `AgreedFailure` carrying the remote
    tracebacks of every failing rank, so nobody is left waiting in a collective.
    """
    error = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 — the error is shared, then raised on every rank
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
    agree(error, what=what, group=group)
