"""JSON over HTTP to an inference engine's own API, with a timeout on every request.

Standard library only (no requests/httpx dependency). Every failure is an
`EngineHTTPError` that names the engine URL, the route, the HTTP status and
the server's answer, so a trainer log says which engine refused what.
`BackgroundCall` runs a request that blocks until the engine's workers have
done their part (joining the transport group, receiving a version) while the
trainer does its own.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Optional


class EngineHTTPError(RuntimeError):
    """An engine's HTTP API refused a request, answered with an error, or did not answer in time."""

    def __init__(self, url: str, route: str, problem: str, *, status: Optional[int] = None) -> None:
        self.url, self.route, self.status = url, route, status
        super().__init__(f"engine {url}: {route} {problem}")


def request_json(url: str, route: str, *, method: str = "POST", body: Any = None,
                 query: Optional[dict[str, Any]] = None, timeout_s: float, text: bool = False) -> Any:
    """Send one request to `url + route` and return the decoded JSON answer (None for an empty body).

    `body` is sent as JSON (POST), `query` as URL parameters (booleans as
    "true"/"false"); with `text` the answer is returned as a string (routes
    that answer in plain text). Raises EngineHTTPError on a connection
    failure, a timeout, a non-2xx status, or an answer that is not JSON.
    """
    target = url.rstrip("/") + route
    if query:
        target += "?" + urllib.parse.urlencode({k: _query_value(v) for k, v in query.items()})
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(target, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise EngineHTTPError(url, route, f"answered HTTP {e.code}: {detail}", status=e.code) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise EngineHTTPError(
            url, route, f"did not answer within {timeout_s:g}s or refused the connection ({reason}); "
            "check that the server is running and reachable"
        ) from None
    if text:
        return raw.decode(errors="replace")
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise EngineHTTPError(url, route, f"answered with something that is not JSON: {raw[:200]!r}") from None


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class BackgroundCall:
    """A blocking call run on a daemon thread; `wait` re-raises its exception in the caller."""

    def __init__(self, fn: Callable[[], Any], what: str) -> None:
        self.what = what
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=what, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 — handed to whoever waits
            self._error = e

    def done(self) -> bool:
        """True once the call returned or raised."""
        return not self._thread.is_alive()

    def failed(self) -> bool:
        """True once the call raised (its error is what `wait` raises)."""
        return self.done() and self._error is not None

    def wait(self, timeout_s: float) -> None:
        """Return when the call finished; raise its exception, or TimeoutError after `timeout_s`."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.what} did not finish within {timeout_s:g}s")
        if self._error is not None:
            raise self._error
