#!/usr/bin/env python3
"""Where a streamed request's time goes, client and server together (issue 7).

Lines up lce_transport_bench's --trace-file (each timed request's start and end and its streams'
points, steady_clock microseconds) with lce_server's request log (--log-requests: start_mono_us,
duration_ms, before_first_call_ms, after_last_call_ms). steady_clock is one clock for every process
of a host, so the differences are real gaps. Prints, per path and op, the median of each step:

  to server        client start -> the server's handler starts (call setup, the header's way)
  server head      handler start -> first engine call (first chunk's arrival, staging)
  engine calls     first call's start -> last call's end
  server tail      last call's end -> handler returns
  to client        handler returns -> the client has the stream's status (the last answer, trailers)
  client after     the status -> the client's call returns (joins, checks)
  client opened / first chunk sent: points inside the client, from its start

Usage: transport_trace_summary.py TRACE_FILE SERVER_LOG [FIRST_LOG_LINE]
"""
import json
import statistics
import sys
from collections import defaultdict

METHOD = {"score": "Score", "train": "ForwardBackward"}


def main():
    trace_path, log_path = sys.argv[1], sys.argv[2]
    first_line = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    server = []
    with open(log_path) as f:
        for i, line in enumerate(f, 1):
            if i < first_line or not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "start_mono_us" in r and "engine_calls" in r:
                server.append(r)
    steps = defaultdict(lambda: defaultdict(list))
    with open(trace_path) as f:
        for line in f:
            c = json.loads(line)
            method = METHOD.get(c["op"])
            if method is None or len(c["streams"]) != 1:
                continue  # engine-only and wire rows have no server request; split requests: several
            mine = [r for r in server if r["method"] == method and c["start_us"] <= r["start_mono_us"] <= c["end_us"]]
            if len(mine) != 1:
                continue
            r, s = mine[0], c["streams"][0]
            t0, s0 = c["start_us"] / 1e3, r["start_mono_us"] / 1e3
            s_end = s0 + r["duration_ms"]
            first_call = s0 + r["before_first_call_ms"]
            last_end = s_end - r["after_last_call_ms"]
            row = steps[(c["path"], c["op"])]
            row["total"].append(c["end_us"] / 1e3 - t0)
            row["to server"].append(s0 - t0)
            row["server head"].append(first_call - s0)
            row["engine calls"].append(last_end - first_call)
            row["server tail"].append(s_end - last_end)
            row["to client"].append(s["ended_us"] / 1e3 - s_end)
            row["client after"].append(c["end_us"] / 1e3 - s["ended_us"] / 1e3)
            row["client opened"].append(s["opened_us"] / 1e3 - t0)
            if s["first_chunk_sent_us"]:
                row["first chunk sent"].append(s["first_chunk_sent_us"] / 1e3 - t0)
            row["last answer to status"].append((s["ended_us"] - s["last_answer_us"]) / 1e3)
    if not steps:
        print("  (no client request matched a server request)")
        return
    names = ["total", "to server", "server head", "engine calls", "server tail", "to client", "client after",
             "client opened", "first chunk sent", "last answer to status"]
    print("| path | op | n | " + " | ".join(n + " ms" for n in names) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in names) + " |")
    for (path, op), row in steps.items():
        cells = [f"{statistics.median(row[n]):.2f}" if row[n] else "-" for n in names]
        print(f"| {path} | {op} | {len(row['total'])} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
