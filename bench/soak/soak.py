#!/usr/bin/env python3
"""Soak of lce_server: a bounded run of mixed traffic against one server (CPU engine, seeded heads),
with faults injected, every answer checked against a float64 reference, and the server's memory,
file descriptors and threads checked to come back to their warm level.

    python bench/soak/soak.py --duration=120                      # what CI runs (tests/run_all.sh)
    python bench/soak/soak.py --duration=1800 --json=soak.json    # the recorded run (docs/OPERATING.md)

Traffic (one thread a lane, lanes.py, training.py, faults.py, kills.py): score, forward-backward,
backward and policy loss over gRPC bytes (Calls, streams, several streams), shared-memory sessions
and the data plane; training on head "train" (accumulate, GetGrad, OptimizerStep, UpdateWeights,
LoadHead, SaveHead) with a scorer pinned to its versions; a fault lane; client processes SIGKILLed
mid-upload. The run is a warm-up (its figures are the warm level) and then the soak proper; at the
end, with every client gone, the server must hold no session, region or request, and its RSS may
have grown by at most --max-rss-growth-mb over the warm level, its fds and threads not at all.
Exit status 0 when all held, 1 otherwise; the report lists requests by kind, faults by kind and
outcome, and the memory / fd / thread figures.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lce_client  # noqa: E402
import reference as R  # noqa: E402
from common import HeadRef, Ledger  # noqa: E402
from faults import FaultLane  # noqa: E402
from kills import KillLane  # noqa: E402
from lanes import BytesLane, DataPlaneLane, ShmLane  # noqa: E402
from training import TRAIN_HEAD, TrainedHeadLane, TrainerLane, TrainState  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MAX_MESSAGE_BYTES = 2 << 20
MAX_ROWS = 4096
DP_BYTES_PER_SESSION = 64 << 20
HIDDEN = 128
GRPC_CQS = 2
CPU_THREADS = 2
# gRPC's synchronous server keeps between 1 and IDLE_THREADS idle threads a completion queue
# (--grpc-idle-threads, set here: its default, 64 over all queues, would allow a leak of that many to
# pass), and each keeps the OpenMP team it made when it ran the CPU engine (CPU_THREADS - 1 workers,
# which inherit its name): so many may rest there with no client, whatever the warm level caught.
IDLE_THREADS = 4
# gRPC's timer manager starts a thread whenever none waits with a deadline, and an extra one retires
# only when timers next run: with no client, 2 or 3 may rest (the warm level caught 2 where a 2-minute
# CI run ended with 3; the 30-minute runs ended with 2 and 3). A leak would grow past the bound.
IDLE_POOL_BOUND = {"grpcpp_sync_ser": GRPC_CQS * IDLE_THREADS * CPU_THREADS, "grpc_global_tim": 4}
# The server's header and idle timeouts: short, so that the faults that wait for them end soon, but
# not so short that a busy machine trips them on a good client (1 s did: at load 11 on 2 cores a
# data-plane client's header came more than 1 s after its stream opened).
HEADER_TIMEOUT_S, IDLE_TIMEOUT_S = 5, 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """lce_server on a free port: CPU engine, a seeded fp32 head, data plane, metrics, tight limits."""

    def __init__(self, binary: str, workdir: Path, seed: int):
        self.metrics_port = free_port()
        port_file = workdir / "server.port"
        self.log_path = workdir / "server.log"
        args = [binary, "--host=127.0.0.1", "--port=0", f"--port-file={port_file}", "--backend=cpu",
                f"--cpu-threads={CPU_THREADS}", f"--seed-head=4096x{HIDDEN}", "--head-dtype=fp32", f"--seed={seed}",
                f"--grpc-cqs={GRPC_CQS}", f"--grpc-idle-threads={IDLE_THREADS}", "--data-port=0",
                f"--metrics-port={self.metrics_port}", "--metrics-host=127.0.0.1",
                f"--max-message-bytes={MAX_MESSAGE_BYTES}", f"--max-rows-per-request={MAX_ROWS}",
                f"--data-plane-bytes-per-session={DP_BYTES_PER_SESSION}",
                f"--stream-header-timeout-seconds={HEADER_TIMEOUT_S}", f"--stream-idle-timeout-seconds={IDLE_TIMEOUT_S}",
                "--shutdown-grace-seconds=5", "--log-requests=false"]
        port_file.unlink(missing_ok=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lce_server did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        self.target = f"127.0.0.1:{port_file.read_text().strip()}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def sample(self) -> dict:
        """RSS, open fds and threads of the server process, from /proc."""
        pid = self.proc.pid
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kb = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
        threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
        return {"t": time.time(), "rss_mb": rss_kb / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}

    def thread_names(self) -> dict:
        """Threads by name (/proc/<pid>/task/*/comm): gRPC's pools, lce_server's own."""
        names: dict = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                name = (task / "comm").read_text().strip()
            except OSError:  # the thread ended meanwhile
                continue
            names[name] = names.get(name, 0) + 1
        return names

    def metrics(self) -> dict:
        """The gauges that must be 0 with no client: sessions, regions (all kinds), requests in flight."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out = {"sessions": 0.0, "regions": 0.0, "inflight_requests": 0.0}
        for line in text.splitlines():
            for key, name in (("sessions", "lce_sessions"), ("regions", "lce_regions"),
                              ("inflight_requests", "lce_inflight_requests")):
                if re.match(rf"{name}(\{{.*\}})? ", line):
                    out[key] += float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


class Monitor(threading.Thread):
    """Samples the server every second: the series' peaks, and the server's death if it dies."""

    def __init__(self, server: Server):
        super().__init__(name="monitor", daemon=True)
        self.server, self.stop, self.samples = server, threading.Event(), []

    def run(self) -> None:
        while not self.stop.wait(1.0) and self.server.alive():
            try:
                self.samples.append(self.server.sample())
            except (OSError, AttributeError):
                break

    def peak(self, key: str, since: float = 0.0) -> float:
        return max((s[key] for s in self.samples if s["t"] >= since), default=0.0)


def load_heads(client: lce_client.Client, workdir: Path, seed: int) -> dict:
    """The heads the soak uses and their weights, read back with SaveHead: the server's default (fp32,
    seeded at start), "bf16" and "train" (fp32), loaded seeded here."""
    client.load_head("bf16", seeded=(4096, HIDDEN, seed + 1, "bf16"))
    client.load_head(TRAIN_HEAD, seeded=(1024, HIDDEN, seed + 2, "fp32"))
    heads = {}
    for name in ("default", "bf16", TRAIN_HEAD):
        _, index = client.save_head(str(workdir / "heads" / name), name)
        w, dtype = R.read_saved_head(index)
        info = client.head_info(name, refresh=True)
        ref = HeadRef(name, dtype, w.shape[0], w.shape[1])
        ref.publish(info.version, R.to_f64(w, dtype))
        heads[name] = ref
    return heads


def run_phase(ctx, seconds: float, server: Server) -> None:
    """All lanes at once for `seconds` (or until the server dies), then stopped and their clients closed."""
    seed = int(ctx.rng_seed.pop())
    lanes = [BytesLane(ctx, seed), BytesLane(ctx, seed + 1), ShmLane(ctx, seed + 2), DataPlaneLane(ctx, seed + 3),
             TrainerLane(ctx, seed + 4), TrainedHeadLane(ctx, seed + 5), FaultLane(ctx, seed + 6), KillLane(ctx, seed + 7)]
    for lane in lanes:
        lane.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end and server.alive():
        time.sleep(0.5)
    for lane in lanes:
        lane.stop.set()
    for lane in lanes:
        lane.thread.join(timeout=180)
        if lane.thread.is_alive():
            ctx.ledger.fail(f"lane {lane.name} did not stop within 180 s")


def settle(server: Server, target: dict = None, timeout: float = 30.0) -> dict:
    """The server's figures once idle: sessions, regions and requests gone and fds / threads steady (or
    down to `target`'s), or whatever they are after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        s = server.sample()
        s.update(server.metrics())
        s["thread_names"] = server.thread_names()
        idle = s["sessions"] == 0 and s["regions"] == 0 and s["inflight_requests"] == 0
        steady = last is not None and (s["fds"], s["threads"]) == (last["fds"], last["threads"])
        reached = target is not None and s["fds"] <= target["fds"] and \
            not thread_growth(target["thread_names"], s["thread_names"])
        if idle and (reached or (target is None and steady)) or time.monotonic() > deadline:
            return s
        last = s
        time.sleep(1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-bin", default=os.environ.get("LCE_SERVER_BIN", str(REPO / "build" / "bin" / "lce_server")))
    ap.add_argument("--duration", type=float, default=120.0, help="seconds in all, warm-up included (default 120)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds of warm-up (default: 15%% of the run, 30-120 s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    ap.add_argument("--json", help="write the report here too")
    ap.add_argument("--workdir", help="server log, saved heads (default: a temporary directory)")
    a = ap.parse_args()
    warmup = a.warmup if a.warmup is not None else min(120.0, max(30.0, 0.15 * a.duration))
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="lce-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    server = Server(a.server_bin, workdir, a.seed)
    monitor = Monitor(server)
    monitor.start()
    ledger = Ledger()
    try:
        with lce_client.Client(server.target, timeout=60) as c:
            heads = load_heads(c, workdir, a.seed)
            data_port = c.info().data_port
        ctx = SimpleNamespace(target=server.target, heads=heads, static_heads=["default", "bf16"], ledger=ledger,
                              data_port=data_port, metrics_port=server.metrics_port, workdir=workdir,
                              max_message_bytes=MAX_MESSAGE_BYTES, max_rows=MAX_ROWS,
                              data_plane_bytes_per_session=DP_BYTES_PER_SESSION,
                              train=TrainState(*heads[TRAIN_HEAD].latest()), rng_seed=[a.seed * 1000 + 100, a.seed * 1000])
        print(f"soak: server {server.target} (pid {server.proc.pid}), warm-up {warmup:.0f} s, then "
              f"{a.duration - warmup:.0f} s; workdir {workdir}", flush=True)
        run_phase(ctx, warmup, server)
        warm = settle(server) if server.alive() else None
        print(f"soak: warm level {warm}", flush=True)
        soak_from = time.time()
        if warm is not None:
            run_phase(ctx, a.duration - warmup, server)
        final = settle(server, target=warm, timeout=60.0) if server.alive() else None
        if final is not None and thread_growth(warm["thread_names"], final["thread_names"]):
            dump_threads(server, workdir / "threads_at_end.txt")
    finally:
        monitor.stop.set()
        crashed = not server.alive()
        code = server.stop()
    report = summarize(ledger, warm, final, monitor, soak_from if warm else started, crashed, code, a, time.time() - started)
    print_report(report)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1, sort_keys=True))
    if report["failures"] or crashed:
        print(f"soak: server log {server.log_path}:\n" + server.log_path.read_text()[-3000:])
    return 0 if report["passed"] else 1


def summarize(ledger: Ledger, warm, final, monitor: Monitor, soak_from: float, crashed: bool, exit_code: int, a,
              elapsed: float) -> dict:
    snap = ledger.snapshot()
    by_kind: dict = {}
    for lane_kind, n in snap["requests"].items():
        kind = lane_kind.split("/")[-1]
        by_kind[kind] = by_kind.get(kind, 0) + n
    failures = list(snap["failures"])
    if crashed:
        failures.append(f"the server died (exit status {exit_code})")
    elif exit_code != 0:
        failures.append(f"the server exited {exit_code} on SIGTERM")
    figures = {}
    if warm and final:
        figures = {"rss_mb": {"warm": warm["rss_mb"], "final": final["rss_mb"], "peak": monitor.peak("rss_mb", soak_from),
                              "growth": final["rss_mb"] - warm["rss_mb"]},
                   "fds": {"warm": warm["fds"], "final": final["fds"], "peak": monitor.peak("fds", soak_from)},
                   "threads": {"warm": warm["threads"], "final": final["threads"], "peak": monitor.peak("threads", soak_from),
                               "warm_by_name": warm["thread_names"], "final_by_name": final["thread_names"]},
                   "after": {k: final[k] for k in ("sessions", "regions", "inflight_requests")}}
        if figures["rss_mb"]["growth"] > a.max_rss_growth_mb:
            failures.append(f"RSS grew {figures['rss_mb']['growth']:.1f} MB over the warm level (limit {a.max_rss_growth_mb})")
        if final["fds"] > warm["fds"]:
            failures.append(f"fds: {final['fds']} with no client, {warm['fds']} at the warm level")
        failures += thread_growth(warm["thread_names"], final["thread_names"])
        for k, v in figures["after"].items():
            if v != 0:
                failures.append(f"{k}: {v} with no client")
    elif not crashed:
        failures.append("no warm or final figures")
    t0 = monitor.samples[0]["t"] if monitor.samples else 0.0
    series = [[round(x["t"] - t0), round(x["rss_mb"], 1), x["fds"], x["threads"]] for x in monitor.samples[::10]]
    return {"passed": not failures, "seconds": round(elapsed, 1), "duration": a.duration, "seed": a.seed,
            "requests": sum(by_kind.values()), "requests_by_kind": by_kind, "requests_by_lane": snap["requests"],
            "faults": sum(sum(v.values()) for v in snap["faults"].values()), "faults_by_kind": snap["faults"],
            "notes": snap["notes"], "figures": figures, "server_exit": exit_code, "failures": failures,
            "series_s_rss_mb_fds_threads": series, "driver_peak_rss_mb": _own_peak_rss_mb()}


def dump_threads(server: Server, path: Path) -> None:
    """Every thread's stack (gdb, where installed), to tell what an extra thread waits on."""
    try:
        out = subprocess.run(["gdb", "-p", str(server.proc.pid), "-batch", "-ex", "thread apply all bt 12"],
                             capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        out = f"no stacks: {e}"
    path.write_text(out)
    print(f"soak: the server's threads at the end: {path}", flush=True)


def _own_peak_rss_mb() -> float:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def thread_growth(warm: dict, final: dict) -> list:
    """Threads by name beyond the warm level, save gRPC's idle pollers within their bound."""
    out = []
    for name, n in sorted(final.items()):
        allowed = max(warm.get(name, 0), IDLE_POOL_BOUND.get(name, 0))
        if n > allowed:
            out.append(f"threads named {name!r}: {n} with no client, {warm.get(name, 0)} at the warm level"
                       + (f" (idle pool bound {IDLE_POOL_BOUND[name]})" if name in IDLE_POOL_BOUND else ""))
    return out


def print_report(r: dict) -> None:
    print(f"\nsoak: {r['seconds']:.0f} s, {r['requests']} requests checked, {r['faults']} faults injected")
    for k, n in sorted(r["requests_by_kind"].items()):
        print(f"  {k:<24} {n}")
    print("faults (outcome: count):")
    for k, v in sorted(r["faults_by_kind"].items()):
        print(f"  {k:<36} " + ", ".join(f"{o}: {n}" for o, n in sorted(v.items())))
    for k, n in sorted(r["notes"].items()):
        print(f"  note: {k}: {n}")
    f = r["figures"]
    if f:
        print(f"RSS MB: warm {f['rss_mb']['warm']:.1f}, final {f['rss_mb']['final']:.1f}, peak {f['rss_mb']['peak']:.1f}, "
              f"growth {f['rss_mb']['growth']:+.1f}")
        print(f"fds: warm {f['fds']['warm']}, final {f['fds']['final']}, peak {f['fds']['peak']:.0f}; threads: warm "
              f"{f['threads']['warm']}, final {f['threads']['final']}, peak {f['threads']['peak']:.0f}; after: {f['after']}")
        print(f"threads by name: warm {f['threads']['warm_by_name']}, final {f['threads']['final_by_name']}")
    print(f"server exit status {r['server_exit']}; this driver's peak RSS {r['driver_peak_rss_mb']:.0f} MB")
    for x in r["failures"]:
        print(f"FAILED: {x}")
    print("soak: PASSED" if r["passed"] else f"soak: FAILED ({len(r['failures'])} failures)")


if __name__ == "__main__":
    sys.exit(main())
