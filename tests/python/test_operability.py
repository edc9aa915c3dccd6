"""Operability of the real lce_server: Prometheus metrics under traffic (promtool-valid, counters
moved by the right amounts), a real Prometheus scraping it, admin tokens, admission control under
overload, and cancelled requests releasing their resources."""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

import lce_client
from conftest import HIDDEN
from helpers import free_port, sample, scrape

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")


def batch(rows, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, HIDDEN)).astype(np.float32), rng.integers(0, 64, rows)


@pytest.fixture
def metrics_server(server_factory):
    port = free_port()
    srv = server_factory([f"--seed-head=64x{HIDDEN}", "--head-dtype=fp32", f"--metrics-port={port}",
                          "--metrics-host=127.0.0.1"], name="metrics")
    srv.metrics_port = port
    return srv


def test_metrics_under_traffic_are_valid_and_count_right(metrics_server):
    c = lce_client.Client(metrics_server.target, timeout=30, chunk_bytes=HIDDEN * 4 * 10)
    before = scrape(metrics_server.metrics_port)
    h, y = batch(35)
    for _ in range(3):
        c.score(h, y)
    c.forward_backward(h, y, reduction="sum")
    with pytest.raises(lce_client.LceError):
        c.score(h, np.full(35, 10_000))  # target out of range: INVALID_ARGUMENT
    after = scrape(metrics_server.metrics_port)
    d = lambda name, **kw: sample(after, name, **kw) - sample(before, name, **kw)  # noqa: E731
    assert d("lce_requests_total", method="Score", code="OK") == 3
    assert d("lce_requests_total", method="ForwardBackward", code="OK") == 1
    assert d("lce_requests_total", method="Score", code="INVALID_ARGUMENT") == 1
    assert d("lce_tokens_total", op="score") == 3 * 35
    assert d("lce_tokens_total", op="forward_backward") == 35
    assert d("lce_request_duration_seconds_count", method="Score") == 4
    assert d("lce_bytes_received_total") >= 4 * 35 * HIDDEN * 4
    assert d("lce_bytes_sent_total") >= 35 * HIDDEN * 4  # d_hidden of the forward-backward
    assert sample(after, "lce_inflight_requests") == 0
    assert sample(after, "lce_head_version", head="default") == 1
    assert sample(after, "lce_tp_size") == 1
    assert sample(after, "lce_device_memory_bytes", kind="weights") > 0
    if PROMTOOL is None:
        pytest.skip("promtool not installed: exposition format not validated (apt-get install prometheus)")
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=after, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_sessions_and_regions_are_counted_and_released(metrics_server):
    port = metrics_server.metrics_port
    assert sample(scrape(port), "lce_sessions") == 0
    with lce_client.Client(metrics_server.target, timeout=30) as c:
        with c.shared_memory_session() as s:
            s.create(4096)
            s.create(8192)
            m = scrape(port)
            assert sample(m, "lce_sessions") == 1
            assert sample(m, "lce_regions", kind="host") == 2
            assert sample(m, "lce_regions", kind="device") == 0
        # the session's end releases its regions (the server notices the stream's end)
        for _ in range(100):
            m = scrape(port)
            if sample(m, "lce_sessions") == 0 and sample(m, "lce_regions", kind="host") == 0:
                break
            time.sleep(0.05)
        assert sample(m, "lce_sessions") == 0 and sample(m, "lce_regions", kind="host") == 0, m


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")
def test_real_prometheus_scrapes_the_server(metrics_server, tmp_path):
    c = lce_client.Client(metrics_server.target, timeout=30)
    h, y = batch(20)
    c.score(h, y)
    prom_port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: lce\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{metrics_server.metrics_port}']\n")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import json
        deadline, result = time.time() + 60, []
        while time.time() < deadline:
            try:
                q = f"http://127.0.0.1:{prom_port}/api/v1/query?query=lce_requests_total"
                with urllib.request.urlopen(q, timeout=5) as r:
                    result = json.loads(r.read())["data"]["result"]
                if result:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert result, "Prometheus never returned lce_requests_total"
        methods = {s["metric"]["method"] for s in result}
        assert "Score" in methods
        assert all(s["metric"]["job"] == "lce" for s in result)
    finally:
        prom.terminate()
        prom.wait(timeout=30)


def test_admin_rpcs_need_the_admin_token(server_factory, workdir):
    (workdir / "scoring.tok").write_text("scoring-token-0123456789\n")
    (workdir / "admin.tok").write_text("admin-token-0123456789ab\n")
    srv = server_factory([f"--seed-head=64x{HIDDEN}", "--head-dtype=fp32",
                          f"--auth-token-file={workdir / 'scoring.tok'}",
                          f"--admin-token-file={workdir / 'admin.tok'}"], name="admin")
    scorer = lce_client.Client(srv.target, timeout=30, token="scoring-token-0123456789")
    admin = lce_client.Client(srv.target, timeout=30, token="admin-token-0123456789ab")
    h, y = batch(5)
    scorer.score(h, y)  # scoring works with the scoring token
    admin.score(h, y)   # and with the admin token
    with pytest.raises(lce_client.LceError) as ei:
        scorer.zero_grad()
    assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(lce_client.LceError) as ei:
        scorer.optimizer_step(lr=1e-3)
    assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(lce_client.LceError) as ei:
        lce_client.Client(srv.target, timeout=30).zero_grad()
    assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED
    admin.zero_grad()
    assert admin.optimizer_step(lr=1e-3) is not None


def test_overload_gets_resource_exhausted_and_admitted_requests_finish(server_factory):
    srv = server_factory([f"--seed-head=4096x{HIDDEN}", "--head-dtype=fp32", "--max-concurrent-streams=2",
                          "--cpu-threads=1"], name="overload")
    h, y = batch(4000, seed=3)
    ref, _ = lce_client.Client(srv.target, timeout=120).score(h, y)
    results, errors = [], []
    lock = threading.Lock()

    def one():
        try:
            lp, _ = lce_client.Client(srv.target, timeout=120, chunk_bytes=HIDDEN * 4 * 200).score(h, y)
            with lock:
                results.append(lp)
        except lce_client.LceError as e:
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors, "12 concurrent requests against a limit of 2 streams: some must be refused"
    assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors), [e.code for e in errors]
    assert all("concurrent streams" in e.details for e in errors)
    assert results, "admitted requests must finish"
    for lp in results:
        np.testing.assert_allclose(lp, ref, rtol=1e-6, atol=1e-6)
    # The server still serves, and it has no stream left in flight.
    lp, _ = lce_client.Client(srv.target, timeout=60).score(h[:10], y[:10])
    np.testing.assert_allclose(lp, ref[:10], rtol=1e-6, atol=1e-6)


def test_cancelled_request_frees_its_resources(server_factory):
    port = free_port()
    srv = server_factory([f"--seed-head=4096x{HIDDEN}", "--head-dtype=fp32", "--max-concurrent-streams=1",
                          f"--metrics-port={port}", "--metrics-host=127.0.0.1", "--cpu-threads=1"], name="cancel")
    h, y = batch(80000, seed=4)  # ~30 GFLOP on one CPU thread: far longer than the 1 s deadline
    c = lce_client.Client(srv.target, timeout=1.0, chunk_bytes=HIDDEN * 4 * 100)  # deadline expires mid-request
    with pytest.raises(lce_client.LceError) as ei:
        c.score(h, y)
    assert ei.value.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
    # The single stream slot comes back: a new request is admitted, and nothing stays in flight.
    deadline = time.time() + 20
    while time.time() < deadline and sample(scrape(port), "lce_inflight_requests") != 0:
        time.sleep(0.1)
    assert sample(scrape(port), "lce_inflight_requests") == 0
    lp, _ = lce_client.Client(srv.target, timeout=60).score(h[:8], y[:8])
    assert lp.shape == (8,)
