"""An engine rank's per-version rows on a Prometheus endpoint: `GET /metrics` in the text exposition format.

Each inference rank with `weight_sync.metrics_port` serves on that port plus its inference rank (one port per
rank of a host, beside vLLM's own /metrics on its API port): the version it serves, the last sync's seconds
per phase and bytes, and how many syncs committed and aborted. A small HTTP server on a daemon thread; no
dependency beyond the standard library.
"""

from __future__ import annotations

import http.server
import threading
from typing import Optional

from megatron_sync.core.metrics import SyncMetrics

HELP = {
    "megatron_sync_version": ("gauge", "The weight version this engine rank serves"),
    "megatron_sync_sync_seconds": ("gauge", "Seconds per phase of the last sync this rank committed"),
    "megatron_sync_sync_bytes": ("gauge", "Bytes this rank received in the last sync it committed"),
    "megatron_sync_syncs_total": ("counter", "Syncs this rank took part in, by outcome"),
}


class MetricsExporter:
    """Serves one rank's rows (see the module doc) until `close()`."""

    def __init__(self, port: int, rank: int, host: str = "0.0.0.0") -> None:
        self.rank, self._lock = rank, threading.Lock()
        self._last: Optional[SyncMetrics] = None
        self._version = 0
        self._outcomes = {"committed": 0, "aborted": 0}
        exporter = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 — the standard library's name
                body = exporter.render().encode() if self.path.split("?")[0] == "/metrics" else b""
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes are not worth a log line each
                return

        try:
            self._server = http.server.ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise ValueError(f"weight_sync.metrics_port: inference rank {rank} cannot serve its metrics on port "
                             f"{port} ({e}); choose a metrics_port with metrics_port + rank free on every host, "
                             "or 0 for none") from e
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="megatron-sync-metrics",
                                        daemon=True)
        self._thread.start()

    def committed(self, metrics: SyncMetrics, version: int) -> None:
        """Record a version this rank committed (its metrics) and now serves."""
        with self._lock:
            self._last, self._version = metrics, version
            self._outcomes["committed"] += 1

    def aborted(self) -> None:
        """Record a sync every rank aborted (this rank serves on its version)."""
        with self._lock:
            self._outcomes["aborted"] += 1

    def render(self) -> str:
        """Return the rows in Prometheus's text format."""
        rank = f'rank="{self.rank}"'
        with self._lock:
            values = {"megatron_sync_version": [(rank, self._version)],
                      "megatron_sync_syncs_total": [(f'{rank},outcome="{o}"', n) for o, n in self._outcomes.items()]}
            if self._last is not None:
                values["megatron_sync_sync_seconds"] = [(f'{rank},phase="{p}"', s)
                                                        for p, s in self._last.phases.items() if s]
                values["megatron_sync_sync_bytes"] = [(rank, self._last.bytes)]
        lines = []
        for name, rows in values.items():
            kind, text = HELP[name]
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{labels}}} {value:g}" for labels, value in rows]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """Stop serving; safe to call twice."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
