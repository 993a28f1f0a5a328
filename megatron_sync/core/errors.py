"""The errors a sync raises, one hierarchy: every failure a caller may handle is a `SyncError`."""

from __future__ import annotations

from typing import Sequence


class SyncError(RuntimeError):
    """Base of the errors a sync raises."""


class PeerFailureError(SyncError):
    """A collective or the rendezvous failed or timed out: a peer died, hangs, or never came."""


class TrainerGoneError(PeerFailureError):
    """An idle engine lost its trainer: the rendezvous stopped answering with no sync running (the trainer
    exited without "stop"); the engine holds its last committed version."""


class StoreSilentError(PeerFailureError):
    """The rendezvous store's host accepted the connection but did not answer within the bound: the process
    hosting it (the trainer's first stage) is stopped (SIGSTOP, a debugger) or hung, not gone."""


class SyncStoppedError(SyncError):
    """The trainer said "stop" while a sync was under way (it is stopping, e.g. on SIGTERM) and ended the
    transfer: the sync was abandoned on every rank, the engine keeps the version it held and leaves."""


class RendezvousError(SyncError):
    """The two jobs could not meet: the rendezvous refused a rank (naming the disagreement), could not be
    reached or hosted (naming why), or a rank of the session failed while starting (quoting its error)."""


class PlanMismatchError(SyncError):
    """Ranks computed different sync plans, or the plan does not cover what an engine expects."""


class CorruptBucketError(SyncError):
    """A received bucket's checksum or header did not match; nothing of it is applied."""


class SenderFailedError(SyncError):
    """A sender reported that it failed mid-sync (its error is in the message); nothing of it is applied.

    Unlike a PeerFailureError the sender is alive and the transport still works: the
    ranks agree on the failure and the next sync can go ahead.
    """


class AgreedFailure(SyncError):
    """Raised on every rank of a group when any rank failed a step; names each failing rank."""

    def __init__(self, what: str, failures: Sequence[tuple[int, str]]) -> None:
        self.what = what
        self.failures = list(failures)
        lines = "\n".join(f"  [rank {rank}] {message}" for rank, message in self.failures)
        super().__init__(
            f"{what} failed on {len(self.failures)} rank(s) {[r for r, _ in self.failures]}:\n{lines}"
        )


class SyncAbortedError(AgreedFailure):
    """Some rank failed this sync; every rank raises it and the engines keep the previous version."""

    def __init__(self, version: int, failures: Sequence[tuple[int, str]]) -> None:
        self.version = version
        super().__init__(f"sync of version {version} (aborted on every rank; engines keep the previous "
                         f"version)", failures)


class DriftError(SyncError):
    """An engine's scores of the canary sequence drifted from the trainer's past `max_logprob_drift`: it holds
    the bytes sent (the post-load check passed) but computes differently (a config or kernel of its own)."""
