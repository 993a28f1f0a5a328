"""Stopping on SIGTERM / SIGINT: as an exception the code can clean up after, with a watchdog for blocked ranks.

`stop_on_signals()` turns SIGTERM and SIGINT into `Terminated` raised in the
main thread, so `with` blocks and `finally` clauses run (the trainer tells the
engines to stop; an engine reports the version it holds). Python runs signal
handlers only between bytecodes, so a rank blocked in native code (a
collective waiting for a peer that hangs) would not notice for up to
`timeout_s`; with `grace_s`, a watchdog thread, woken by the signal itself
through `signal.set_wakeup_fd`, gives the main thread `grace_s` to unwind and
otherwise reports and exits the process itself. `uninterrupted()` holds the
exception back over a step every rank must finish together (a sync's commit
rounds), and raises it when the step ends.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Held:
    """Signals held back by `uninterrupted()` (signal handlers run in the main thread: no lock needed)."""

    depth = 0
    signum: Optional[int] = None


class Terminated(BaseException):
    """SIGTERM or SIGINT arrived: the process was asked to stop (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by this signal (143 for SIGTERM)."""
        return 128 + self.signum


class StopSignal:
    """What `stop_on_signals` yields: the signal that arrived, if any (an error that unwound the main
    thread after it, e.g. a collective failing because the peers stopped, is still a stop by signal)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    def as_exception(self) -> Optional[Terminated]:
        return Terminated(self.signum) if self.signum is not None else None


@contextmanager
def stop_on_signals(*, grace_s: Optional[float] = None,
                    report: Optional[Callable[[str], None]] = None) -> Iterator[StopSignal]:
    """While the block runs, SIGTERM / SIGINT raise `Terminated` in the main thread (once).

    A handler the application installed itself is left alone, and so is
    everything when not called from the main thread. With `grace_s`, if the
    main thread has not left the block `grace_s` after the signal (it is
    blocked in native code), `report(what)` is called from the watchdog and
    the process exits with 128 + signum.
    """
    state = StopSignal()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def raise_terminated(signum, frame):
        if state.signum is None:  # a second signal while unwinding is the watchdog's business
            state.signum = signum
            if _Held.depth:
                _Held.signum = signum  # raised when the uninterrupted step ends
                return
            raise Terminated(signum)

    previous = {}
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
            previous[signum] = signal.signal(signum, raise_terminated)
    watchdog = _Watchdog(grace_s, report) if grace_s is not None and previous else None
    try:
        yield state
    finally:
        if watchdog is not None:
            watchdog.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Run a step that every rank must finish together (it is short, and other ranks wait in it for this
    one); a `Terminated` of `stop_on_signals` arriving meanwhile is raised when the step ends. A rank
    blocked in the step still meets the watchdog's `grace_s`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _Held.depth += 1
    try:
        yield
    finally:
        _Held.depth -= 1
        if _Held.depth == 0 and _Held.signum is not None:
            signum, _Held.signum = _Held.signum, None
            raise Terminated(signum)


class _Watchdog:
    """Woken through the signal wakeup fd; stops the process if the main thread stays blocked."""

    def __init__(self, grace_s: float, report: Optional[Callable[[str], None]]) -> None:
        self._grace_s, self._report = grace_s, report
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._done = threading.Event()
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="megatron-sync-stop-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            try:
                data = self._read.recv(1)
            except OSError:
                return
            if not data or self._done.is_set():
                return
            if data[0] in STOP_SIGNALS:
                break
        signum = data[0]
        if self._done.wait(self._grace_s):
            return
        name = signal.Signals(signum).name
        if self._report is not None:
            try:
                self._report(f"{name} while blocked (for {self._grace_s:g}s after the signal)")
            except Exception:  # noqa: BLE001 — the exit below must happen regardless
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)

    def stop(self) -> None:
        self._done.set()
        signal.set_wakeup_fd(self._previous_fd)
        try:
            self._write.send(b"\0")  # wake the thread so it returns
        except OSError:
            pass
        self._thread.join(timeout=1.0)
        self._read.close()
        self._write.close()
