"""Helpers the Python tests share: a free port, the metrics endpoint's series, lce_cli as a process,
and a recorder of a channel's streaming calls."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest

from lce_client._proto import lce_pb2_grpc as pb_grpc
from conftest import server_binary

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


def sample(text: str, name: str, **labels) -> float:
    """Value of the series `name{labels}` (exact label set match on the given labels), or 0."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, value = line.rsplit(" ", 1)
        if series.split("{")[0] != name:
            continue
        body = series[len(name):].strip("{}")
        got = dict(kv.split("=", 1) for kv in body.split(",") if kv) if body else {}
        got = {k: v.strip('"') for k, v in got.items()}
        if all(got.get(k) == str(v) for k, v in labels.items()):
            return float(value)
    return 0.0


def requests_by_method(srv) -> dict:
    """RPCs a conftest.Server finished, by method, from its request log (--log-requests)."""
    counts = {}
    for line in srv.log_path.read_text().splitlines():
        if line.startswith("{"):
            m = json.loads(line).get("method", "")
            counts[m] = counts.get(m, 0) + 1
    return counts


def cli_binary() -> Path:
    env = os.environ.get("LCE_CLI_BIN")
    p = Path(env) if env else server_binary().parent / "lce_cli"
    if not p.is_file():
        pytest.fail(f"lce_cli not found at {p}: build it (ninja -C build lce_cli) or set LCE_CLI_BIN", pytrace=False)
    return p


def cli(*args, code=0) -> str:
    p = subprocess.run([str(cli_binary()), *map(str, args), "--timeout-seconds=60"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == code, f"lce_cli {' '.join(map(str, args))} exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout + p.stderr


class Recorder(grpc.StreamStreamClientInterceptor):
    """Records (and optionally rewrites) the request messages of each streaming call on a channel."""

    def __init__(self, tamper=None):
        self.calls, self.tamper, self.lock = [], tamper, threading.Lock()

    def intercept_stream_stream(self, continuation, details, request_iterator):
        msgs = []
        with self.lock:
            self.calls.append((details.method, msgs))

        def gen():
            for i, m in enumerate(request_iterator):
                if self.tamper is not None:
                    m = self.tamper(i, m)
                msgs.append(m)
                yield m

        return continuation(details, gen())


def intercept_parts(client, n, make):
    """Puts an interceptor (make(i)) on the channels of the first n parts of split requests."""
    recs = []
    for i in range(n):
        client._stream_stub(i)
        rec = make(i)
        recs.append(rec)
        client._part_stubs[i] = pb_grpc.LceServiceStub(grpc.intercept_channel(client._part_channels[i], rec))
    return recs
