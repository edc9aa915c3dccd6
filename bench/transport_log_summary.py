#!/usr/bin/env python3
"""Summarises lce_server's JSON request log (--log-requests) from line FIRST on: per method and
number of engine calls (a proxy for the path and chunk plan: a one-call co-located request, a
6-call data-plane one...), the requests (after the first of each method, a warm-up) and the median
of their duration, engine time, queue time, waits (for the client's chunks, of which for the first,
for the device staging copies, for room to answer, for the last answers to drain) and what is
left: the handler's own work. On pipelined streams (RequestHeader.sends_ahead) the engine's calls
overlap the handler's reads and staging, so the parts add up to more than the duration and "other"
comes out negative: there, duration minus the first chunk's wait minus the engine is the rest. The
second line: the request's head (its start to the first engine call) and tail (the last call's end to
its end), which a one-call engine-only run does not pay.
Usage: transport_log_summary.py LOG [FIRST_LINE]"""
import collections
import json
import statistics
import sys

lines = open(sys.argv[1], errors="replace").read().splitlines()[int(sys.argv[2]) if len(sys.argv) > 2 else 0:]
# The first request of each method warms the engine up (cuBLAS plans): left out.
seen = set()
by = collections.defaultdict(list)
for line in lines:
    try:
        j = json.loads(line)
    except ValueError:
        continue
    if "method" in j:
        if j["method"] not in seen:
            seen.add(j["method"])
            continue
        by[(j["method"], j.get("engine_calls", 0))].append(j)
parts = ("engine_ms", "queue_ms", "read_wait_ms", "staging_ms", "write_wait_ms", "drain_ms")
for (m, calls), rs in sorted(by.items()):
    med = lambda k: statistics.median(r.get(k, 0) for r in rs)
    other = statistics.median(r.get("duration_ms", 0) - sum(r.get(k, 0) for k in parts) for r in rs)
    print(f"  server log {m}, {calls} engine calls: {len(rs)} streams, median {med('duration_ms'):.2f} ms = engine "
          f"{med('engine_ms'):.2f} + queue {med('queue_ms'):.2f} + read wait {med('read_wait_ms'):.2f} "
          f"(first chunk {med('first_chunk_wait_ms'):.2f}) + staging {med('staging_ms'):.2f} + write wait "
          f"{med('write_wait_ms'):.2f} + drain {med('drain_ms'):.2f} + other {other:.2f}"
          + (" (pipelined: waits overlap the engine)" if other < 0 else ""))
    if any("tp_control_ms" in r for r in rs):
        print(f"    of the engine's, sharing each call with the TP peers: control blocks {med('tp_control_ms'):.2f} ms, "
              f"inputs {med('tp_inputs_ms'):.2f} ms")
    if any("before_first_call_ms" in r for r in rs):
        print(f"    head (start to first engine call) {med('before_first_call_ms'):.2f} ms, tail (last call's end to "
              f"the end) {med('after_last_call_ms'):.2f} ms, outputs back (unstage) {med('unstage_ms'):.2f} ms")
