#!/usr/bin/env python3
"""Summarises lce_server's JSON request log (--log-requests) from line FIRST on: per method, the
requests (after the first, a warm-up), their mean duration and the mean engine time, queue time,
engine calls and waits (for the client's chunks, for room to answer, for the last answers to drain).
Usage: transport_log_summary.py LOG [FIRST_LINE]"""
import collections
import json
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
        by[j["method"]].append(j)
for m, rs in sorted(by.items()):
    n = len(rs)
    mean = lambda k: sum(r.get(k, 0) for r in rs) / n
    print(f"  server log {m}: {n} streams, mean {mean('duration_ms'):.2f} ms each, engine {mean('engine_ms'):.2f} ms "
          f"in {mean('engine_calls'):.1f} calls, queue {mean('queue_ms'):.2f} ms, read wait {mean('read_wait_ms'):.2f} ms "
          f"(first chunk {mean('first_chunk_wait_ms'):.2f}), staging {mean('staging_ms'):.2f} ms, "
          f"write wait {mean('write_wait_ms'):.2f} ms, drain {mean('drain_ms'):.2f} ms")
