"""Each sync's figures where users look: the trainer's writer (TensorBoard, W&B) and every engine rank's
Prometheus endpoint. The demo's TensorBoard event files are read back in tests/test_end_to_end.py."""

from __future__ import annotations

import urllib.request

import pytest

from megatron_sync.core.metrics import SyncMetrics
from megatron_sync.core.writers import log_sync, sync_scalars
from megatron_sync.engines.exporter import MetricsExporter


def _metrics() -> SyncMetrics:
    m = SyncMetrics(3, role="sender", rank=0, bytes=4096)
    m.phases.update(transfer=0.25, total=0.5)
    m.drift = {"0": {"max": 1e-6, "mean": 2e-7}}
    return m


def test_a_writer_gets_every_figure_at_the_version_as_its_step():
    calls = []

    class Board:  # what a TensorBoard SummaryWriter offers
        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

    log_sync(Board(), _metrics())
    got = {tag: (value, step) for tag, value, step in calls}
    assert got["weight_sync/seconds/total"] == (0.5, 3) and got["weight_sync/bytes"] == (4096.0, 3)
    assert got["weight_sync/drift_max/engine0"] == (1e-6, 3) and "weight_sync/seconds/gather" not in got

    logged = []

    class Run:  # what a W&B run offers
        def log(self, values, step):
            logged.append((values, step))

    log_sync(Run(), _metrics())
    assert logged == [(sync_scalars(_metrics()), 3)]
    with pytest.raises(TypeError, match="needs add_scalar"):
        log_sync(object(), _metrics())


def test_an_engine_rank_serves_its_rows_in_prometheus_text_format():
    exporter = MetricsExporter(0, rank=2, host="127.0.0.1")  # port 0: the OS picks one
    try:
        url = f"http://127.0.0.1:{exporter.port}/metrics"
        assert 'megatron_sync_version{rank="2"} 0' in urllib.request.urlopen(url, timeout=10).read().decode()
        m = _metrics()
        exporter.committed(m, 3)
        exporter.aborted()
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'megatron_sync_version{rank="2"} 3' in text
        assert 'megatron_sync_sync_seconds{rank="2",phase="transfer"} 0.25' in text
        assert 'megatron_sync_syncs_total{rank="2",outcome="committed"} 1' in text
        assert 'megatron_sync_syncs_total{rank="2",outcome="aborted"} 1' in text
        assert "# TYPE megatron_sync_syncs_total counter" in text
    finally:
        exporter.close()


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_each_engine_rank_is_scraped_at_its_own_port_with_the_version_it_serves():
    from tests.support.dist import free_port
    from tests.support.jobs import run_pair

    port = free_port()
    while (after := free_port()) != port + 1:  # rank 1 serves on port + 1: both must be ours, handed out in turn
        port = after
    case = {"spec": {"family": "qwen3"}, "layout": {"tp": 2}, "engine_tp": 2, "versions": 2, "keep_tensors": False,
            "weight_sync": {"metrics_port": port}}
    _, engines = run_pair(case, timeout=240)
    for rank, engine in enumerate(engines):
        for held in engine["held"]:
            assert f'megatron_sync_version{{rank="{rank}"}} {held["version"]}' in held["scraped"], held["scraped"]
            assert f'megatron_sync_syncs_total{{rank="{rank}",outcome="committed"}} {held["version"]}' in held["scraped"]
