"""Everyone fails together: one agreement mechanism for every group the library uses.

Each rank contributes its status (None when fine, else a message); every rank
learns all statuses through the group's all-gather and raises the same
`AgreedFailure` if any rank failed, so nobody is left waiting in a collective.
The all-gather is whatever the group offers: a torch.distributed group
(`torch_gather`) or a transport's `all_gather_json`.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from megatron_sync.core.errors import AgreedFailure

Gather = Callable[[Any], list]
"""All-gather of one JSON-serialisable object per rank, returned in rank order."""


def torch_gather(group: Any = None) -> Gather:
    """Return the all-gather of a torch.distributed `group` (None: the default group; one process: itself)."""

    def gather(obj: Any) -> list:
        if not (dist.is_available() and dist.is_initialized()):
            return [obj]
        out: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather


def failures_of(statuses: list[Optional[str]]) -> list[tuple[int, str]]:
    """Return [(rank, message)] of the ranks whose status is an error."""
    return [(rank, status) for rank, status in enumerate(statuses) if status is not None]


def agree(error: Optional[str], *, what: str, gather: Gather,
          failure: Callable[[list[tuple[int, str]]], AgreedFailure] | None = None) -> None:
    """Share this rank's `error` (None when fine); raise on every rank if any rank failed.

    `failure(failures)` builds the exception (default: `AgreedFailure(what, failures)`).
    """
    failures = failures_of(gather(error))
    if failures:
        raise failure(failures) if failure is not None else AgreedFailure(what, failures)


def describe(exc: BaseException, limit: int = 6) -> str:
    """Return the one-string report of `exc` that other ranks see: type, message, short traceback."""
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=limit)}"


@contextmanager
def failing_together(what: str, gather: Gather) -> Iterator[None]:
    """Run a block; afterwards every rank learns whether any rank's block raised, and all raise together."""
    error = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 — the error is shared, then raised on every rank
        error = describe(exc)
    agree(error, what=what, gather=gather)
