"""Where a small call's server time goes: the mean of each stage of lce_server's request log (--log-requests)
over consecutive blocks of a method's requests (as lce_small_calls_bench sends them: warm-up + iterations per
row count), so that each block is one row count.

    python bench/call_stages.py SERVER_STDERR --method Score --block 120 --skip 20 --labels 1,16,64
"""
import argparse
import json

FIELDS = ["duration_ms", "engine_ms", "queue_ms", "read_wait_ms", "staging_ms", "unstage_ms", "write_wait_ms",
          "drain_ms", "before_first_call_ms", "after_last_call_ms"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--method", default="Score")
    ap.add_argument("--block", type=int, required=True, help="requests a row count (warm-up included)")
    ap.add_argument("--skip", type=int, default=0, help="warm-up requests at the start of each block")
    ap.add_argument("--labels", default="", help="a label a block, comma-separated")
    a = ap.parse_args()
    lines = []
    with open(a.log) as f:
        for text in f:
            if text.startswith("{"):
                rec = json.loads(text)
                if rec.get("method") == a.method:
                    lines.append(rec)
    labels = a.labels.split(",") if a.labels else []
    print("| block | n | " + " | ".join(FIELDS) + " |")
    print("| --- " * (len(FIELDS) + 2) + "|")
    for b in range(0, len(lines) // a.block):
        recs = lines[b * a.block + a.skip:(b + 1) * a.block]
        means = [sum(r.get(k, 0.0) for r in recs) / len(recs) for k in FIELDS]
        label = labels[b] if b < len(labels) else str(b)
        print(f"| {label} | {len(recs)} | " + " | ".join(f"{m:.3f}" for m in means) + " |")


if __name__ == "__main__":
    main()
