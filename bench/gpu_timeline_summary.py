#!/usr/bin/env python3
"""Summarises a GPU timeline (bench/gpu_timeline.cc) of an lce process: engine calls, their GEMMs,
and the GPU's idle time between the calls of one request.

An engine call starts with the memset of its per-row partials (rows x 16 bytes) on the engine's
stream; it ends with the last kernel or copy on the engine's two streams (the GEMM stream, found
from FinalizeKernel, and the tile-statistics stream) before the next call starts. Requests are
runs of calls whose rows add up to --rows.

Usage: gpu_timeline_summary.py timeline.PID.csv [--rows 8192]
"""
import argparse
import csv
import statistics
import sys
from collections import defaultdict


def load(path):
    acts = []
    with open(path) as f:
        for r in csv.DictReader(f):
            acts.append((int(r["start_ns"]), int(r["end_ns"]), r["what"], int(r["stream"]), int(r["size"]), r["name"]))
    acts.sort()
    return acts


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--rows", type=int, default=8192)
    a = ap.parse_args()
    acts = load(a.csv)
    main_streams = {s for (_, _, w, s, _, n) in acts if w == "kernel" and "FinalizeKernel" in n}
    aux_streams = {s for (_, _, w, s, _, n) in acts if w == "kernel" and "TileStatsKernel" in n}
    if not main_streams:
        print(f"{a.csv}: no engine calls")
        return
    engine = main_streams | aux_streams
    # Calls: the packed memset (rows*16 bytes, >= 256 bytes) on the main stream starts one.
    calls = []
    for (s, e, w, st, size, n) in acts:
        if st not in engine:
            continue
        if w == "memset" and st in main_streams and size >= 256 and size % 16 == 0:
            calls.append({"start": s, "end": e, "rows": size // 16, "gemm": 0, "gemms": 0, "stats": 0,
                          "other": 0, "train": False})
            continue
        if not calls:
            continue
        c = calls[-1]
        c["end"] = max(c["end"], e)
        d = e - s
        if w == "kernel" and "TileStatsKernel" in n:
            c["stats"] += d
        elif w == "kernel" and "3lce" not in n:  # not one of ours (namespace lce): cuBLASLt's GEMMs
            c["gemm"] += d
            c["gemms"] += 1
        else:
            c["other"] += d
        if "FinishDHidden" in n or "WriteGrad" in n:
            c["train"] = True
    # Requests: consecutive calls adding up to --rows.
    reqs, cur, got = [], [], 0
    for c in calls:
        cur.append(c)
        got += c["rows"]
        if got >= a.rows:
            reqs.append(cur)
            cur, got = [], 0
    by = defaultdict(list)
    for r in reqs:
        kind = ("train" if r[0]["train"] else "score", len(r))
        span = (r[-1]["end"] - r[0]["start"]) / 1e6
        busy = sum(c["end"] - c["start"] for c in r) / 1e6
        gaps = [(r[i]["start"] - r[i - 1]["end"]) / 1e6 for i in range(1, len(r))]
        gemm = sum(c["gemm"] for c in r) / 1e6
        by[kind].append({"span": span, "busy": busy, "gaps": sum(gaps), "max_gap": max(gaps, default=0.0),
                         "gemm": gemm, "gemms": sum(c["gemms"] for c in r),
                         "stats": sum(c["stats"] for c in r) / 1e6,
                         "rows": [c["rows"] for c in r]})
    print(f"{a.csv}: {len(calls)} engine calls, {len(reqs)} requests of {a.rows} rows "
          "(medians; ms; GPU span = first call's start to last call's end)")
    print("| op | calls | requests | GPU span | calls' busy | idle between calls | largest gap | GEMM sum | GEMMs | tile stats sum | rows per call (first request) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (op, n), rs in sorted(by.items()):
        m = lambda k: median([x[k] for x in rs])
        print(f"| {op} | {n} | {len(rs)} | {m('span'):.2f} | {m('busy'):.2f} | {m('gaps'):.2f} | {m('max_gap'):.2f} | "
              f"{m('gemm'):.2f} | {m('gemms'):.0f} | {m('stats'):.2f} | {rs[0]['rows']} |")
    # Per call size: what a call costs beyond its GEMMs.
    per = defaultdict(list)
    for c in calls:
        per[("train" if c["train"] else "score", c["rows"])].append(c)
    print("\n| op | rows | calls | call ms | GEMM ms | GEMMs | tile stats ms | other kernels/copies ms | call − GEMM ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (op, rows), cs in sorted(per.items()):
        span = median([(c["end"] - c["start"]) / 1e6 for c in cs])
        gemm = median([c["gemm"] / 1e6 for c in cs])
        print(f"| {op} | {rows} | {len(cs)} | {span:.3f} | {gemm:.3f} | {median([c['gemms'] for c in cs]):.0f} | "
              f"{median([c['stats'] / 1e6 for c in cs]):.3f} | {median([c['other'] / 1e6 for c in cs]):.3f} | {span - gemm:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
