"""A rendezvous store client whose every call returns within a bound, even when the store's host is stopped.

A TCPStore client waits without limit in `check`, `get` and `add` (and in the
clean-up after a timed-out `wait`) when the process that hosts the store is
alive but not running: stopped (SIGSTOP, a debugger, a suspended job) or hung
so hard that its store thread no longer runs. The kernel still accepts the
request, nobody answers, and the client's own timeout does not apply (torch
2.13; measured: an engine idling on the control channel of a stopped trainer
waited until the trainer was killed). `BoundedStore` runs every call on one
helper thread and gives it up after its bound: `timeout_s` unless the caller
asks for less. A call that outlives the full `timeout_s` makes the host
*silent*: the call raises `StoreSilentError`, and so does every later call, at
once, so no exit path waits for that host a second time. A shorter bound the
caller chose (never under `MIN_BOUND_S`: a live host answers in milliseconds)
only raises: the host may just be slow for a moment. Silence is counted from
when the stuck call began, so calls queued behind it share its `timeout_s`.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_sync.core.wait import clock, poll
from megatron_sync.core.errors import StoreSilentError

MIN_BOUND_S = 2.0
"""The least time a call is given, whatever the caller's remaining time (within `timeout_s`)."""
CHECK_EVERY_S = 0.05  # how often a waiting caller looks at how long the helper has been in its call


class _Silence:
    """When the calls to one store host were first found unanswered (None: never), shared by its clients."""

    def __init__(self) -> None:
        self.since: Optional[float] = None
        self.lock = threading.Lock()


class BoundedStore:
    """The calls of a c10d store (`raw`) the library makes, each bounded (see the module docstring). A client
    and its clones share what they found: once one is silent, all are."""

    def __init__(self, raw: Any, *, where: str, timeout_s: float, silence: Optional[_Silence] = None) -> None:
        self.raw, self.where, self.timeout_s = raw, where, timeout_s
        self._requests: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._silence = silence or _Silence()  # the clock time when a call that outlived timeout_s began
        self._busy_since: Optional[float] = None  # when the helper began the call it runs now (None: idle)

    @property
    def silent_since(self) -> Optional[float]:
        return self._silence.since

    def set(self, key: str, value: bytes, *, bound: Optional[float] = None) -> None:
        self._call(f"set {key!r}", self.raw.set, key, value, bound=bound)

    def get(self, key: str, *, bound: Optional[float] = None) -> bytes:
        return self._call(f"get {key!r}", self.raw.get, key, bound=bound)

    def check(self, keys: list[str], *, bound: Optional[float] = None) -> bool:
        return self._call(f"check {keys}", self.raw.check, keys, bound=bound)

    def add(self, key: str, amount: int, *, bound: Optional[float] = None) -> int:
        return self._call(f"add {key!r}", self.raw.add, key, amount, bound=bound)

    def delete_key(self, key: str, *, bound: Optional[float] = None) -> bool:
        return self._call(f"delete {key!r}", self.raw.delete_key, key, bound=bound)

    def wait(self, keys: list[str], seconds: float, *, bound: Optional[float] = None) -> None:
        """Block in the store's own wait until every key is set (answered the moment it is) or `seconds`
        passed (the store raises its "wait timeout" DistStoreError); the call as a whole stays bounded."""
        self._call(f"wait {keys}", self.raw.wait, keys, datetime.timedelta(seconds=seconds), bound=bound)

    def get_within(self, keys: list[str], seconds: float, *, bound: Optional[float] = None) -> list[bytes]:
        """Return the values under `keys` once all are set (the store's own get waits for them and answers the
        moment they are) or raise the store's "wait timeout" DistStoreError after `seconds`: a wait and a read
        in one request. It sets this client's timeout, so it is for a client only one waiting thread uses (a
        clone)."""
        def get() -> list[bytes]:
            self.raw.set_timeout(datetime.timedelta(seconds=seconds))
            return self.raw.multi_get(keys)

        return self._call(f"get {keys}", get, bound=bound)

    def beside(self, host: str, port: int) -> "BoundedStore":
        """Return a bounded client of another store of this one's host (at `port`), connected within the bound
        (a stopped host accepts the connection and never answers it), that shares what this client found:
        the host is stopped for both at once."""
        def connect() -> Any:
            return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=self.timeout_s),
                                 wait_for_workers=False)

        raw = self._call(f"connect to the store at {host}:{port}", connect, bound=None)
        return BoundedStore(raw, where=f"{host}:{port}", timeout_s=self.timeout_s, silence=self._silence)

    def clone(self) -> "BoundedStore":
        """Return a bounded client of the same store on a connection (and helper thread) of its own; connecting
        is bounded too (a stopped host accepts the connection and never answers it)."""
        raw = self._call("connect a second client", self.raw.clone, bound=None)
        return BoundedStore(raw, where=self.where, timeout_s=self.timeout_s, silence=self._silence)

    @property
    def silent(self) -> bool:
        """True once a call outlived `timeout_s`: the host is stopped or hung."""
        return self.silent_since is not None

    def found_silent(self, since: float) -> None:
        """Other evidence (a fresh connection that got no answer) says the host is silent since `since`."""
        with self._silence.lock:
            self._silence.since = self._silence.since or since

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, bound: Optional[float]) -> Any:
        if self.silent_since is not None:
            raise self._silent_error(what, clock().now() - self.silent_since)
        limit = self.timeout_s if bound is None else min(max(bound, MIN_BOUND_S), self.timeout_s)
        box: dict[str, Any] = {}
        done = threading.Event()
        self._start()
        self._requests.put((fn, args, box, done))

        def answered() -> bool:
            # The host is silent once one call has gone unanswered for timeout_s (counted from when the helper
            # started it, so a call queued behind one already stuck does not wait a second timeout_s).
            busy_since = self._busy_since
            if not done.is_set() and busy_since is not None and clock().now() - busy_since >= self.timeout_s:
                self.found_silent(busy_since)
                raise self._silent_error(what, clock().now() - busy_since)
            return done.is_set()

        def unanswered(waited: float) -> StoreSilentError:
            if limit < self.timeout_s:  # a bound the caller chose: the host may just be slow for a moment
                return StoreSilentError(f"the store at {self.where} did not answer ({what}) within {limit:.3g}s")
            # unanswered for the full timeout_s since it was asked: silent, even where the helper began the call
            # later than that (it was finishing another) and `answered` has not yet seen it timeout_s old
            self.found_silent(clock().now() - waited)
            return self._silent_error(what, waited)

        poll(answered, within=limit, what=f"the store's answer ({what})", max_pause_s=CHECK_EVERY_S, wake=done,
             timeout=unanswered)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _silent_error(self, what: str, waited: float) -> StoreSilentError:
        return StoreSilentError(
            f"the store at {self.where} accepts connections but has not answered for {waited:.3g}s ({what}): "
            "its host is stopped (e.g. SIGSTOP) or hung")

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                # A daemon thread: a call stuck on a stopped host must not keep the process from exiting.
                self._thread = threading.Thread(target=self._serve, name="megatron-sync-store", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            fn, args, box, done = request
            self._busy_since = clock().now()
            try:
                box["value"] = fn(*args)
            except BaseException as e:  # noqa: BLE001 — handed to the caller
                box["error"] = e
            self._busy_since = None
            done.set()

    def close(self) -> None:
        """Let the helper thread end (at once when idle; a call stuck on a stopped host keeps it, as a daemon)."""
        if self._thread is not None:
            self._requests.put(None)
            self._thread = None


def bounded(store: Any, *, where: str, timeout_s: float) -> BoundedStore:
    """Return `store` as a BoundedStore (itself when it is one already)."""
    return store if isinstance(store, BoundedStore) else BoundedStore(store, where=where, timeout_s=timeout_s)
