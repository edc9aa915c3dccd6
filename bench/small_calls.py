"""Small calls end to end (issue 21), Python client, against a running lce_server on loopback.

For each row count, sequential scores through lce_client.Client (one LceService.Call each) timed
end to end, against the server's own engine time of the same calls (lce_engine_seconds{op="score",
phase="compute"} from its /metrics, read before and after); then the rate of small scores from
C coroutines at once on one lce_client.aio.Client, with what the server's dynamic batcher did
meanwhile (lce_batch_*). bench/small_calls.sh runs it against a server with batching off and on.
The client merges concurrent scores into one Call (aio.Client(coalesce=True), the default; "calls an
RPC" says how many went in each); --no-coalesce sends one RPC a call. --rows "" skips the table.

    python bench/small_calls.py --target 127.0.0.1:50051 --metrics 127.0.0.1:9400 [--rows 1,16,64]
        [--iterations 200] [--warmup 20] [--concurrency 64] [--seconds 5] [--rate-rows 1] [--label on]
        [--no-coalesce]
"""
from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request

import numpy as np

import lce_client
import lce_client._coalesce

ENGINE_SUM = 'lce_engine_seconds_sum{op="score",phase="compute"}'
ENGINE_COUNT = 'lce_engine_seconds_count{op="score",phase="compute"}'


def scrape(host_port: str) -> str:
    with urllib.request.urlopen(f"http://{host_port}/metrics", timeout=30) as r:
        return r.read().decode()


def metric(text: str, prefix: str) -> float:
    """The sum of the series whose name and labels start with `prefix`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def make_rows(head, rows: int, seed: int):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, head.hidden_size)).astype(np.float32)
    if head.dtype != "fp32":  # bf16 bits (an fp16 head takes any bits)
        h = (h.view(np.uint32) >> 16).astype(np.uint16)
    return h, rng.integers(0, head.vocab_size, rows).astype(np.int64)


def time_calls(call, warmup: int, iterations: int) -> tuple:
    """Mean, p50 and p99 in ms of `iterations` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    ms = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        call()
        ms.append(1e3 * (time.perf_counter() - t0))
    ms.sort()
    return sum(ms) / len(ms), ms[len(ms) // 2], ms[min(len(ms) - 1, len(ms) * 99 // 100)]


def latency_table(args, head) -> None:
    print("| client | rows | mean ms | p50 ms | p99 ms | engine ms | mean - engine ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with lce_client.Client(args.target, timeout=60) as c:
        # The floor under every row below: a unary GetInfo, no engine, through the same channel.
        mean, p50, p99 = time_calls(c.info, args.warmup, args.iterations)
        print(f"| Python GetInfo (no engine) | - | {mean:.3f} | {p50:.3f} | {p99:.3f} | - | - |")
        for rows in [int(r) for r in args.rows.split(",")]:
            h, y = make_rows(head, rows, 7 + rows)
            for _ in range(args.warmup):
                c.score(h, y)
            before = scrape(args.metrics)
            mean, p50, p99 = time_calls(lambda: c.score(h, y), 0, args.iterations)
            after = scrape(args.metrics)
            calls = metric(after, ENGINE_COUNT) - metric(before, ENGINE_COUNT)
            engine = 1e3 * (metric(after, ENGINE_SUM) - metric(before, ENGINE_SUM)) / calls if calls else 0.0
            print(f"| Python | {rows} | {mean:.3f} | {p50:.3f} | {p99:.3f} | {engine:.3f} | {mean - engine:+.3f} |")


async def rate(args, head) -> tuple:
    h, y = make_rows(head, args.rate_rows, 99)
    done = 0
    stop = False

    async def caller(c):
        nonlocal done
        while not stop:
            await c.score(h, y)
            done += 1

    async with lce_client.aio.Client(args.target, timeout=60, coalesce=not args.no_coalesce) as c:
        await c.score(h, y)  # the channel up
        before, rpcs = scrape(args.metrics), c.rpcs_sent
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(caller(c)) for _ in range(args.concurrency)]
        await asyncio.sleep(args.seconds)
        stop = True
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        rpcs = c.rpcs_sent - rpcs
    after = scrape(args.metrics)
    return done, rpcs, wall, before, after


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--metrics", required=True, help="HOST:PORT of the server's /metrics")
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rate-rows", type=int, default=1)
    p.add_argument("--label", default="")
    p.add_argument("--no-coalesce", action="store_true", help="the asyncio client sends one RPC a call")
    p.add_argument("--one-in-flight", action="store_true",
                   help="the coalescing client as before 2026-11-26: one merged call of a key in flight, no halves")
    args = p.parse_args()
    if args.one_in_flight:
        lce_client._coalesce.Lane.DEPTH, lce_client._coalesce.Lane.SPLIT_MIN = 1, 1 << 62
    with lce_client.Client(args.target, timeout=60) as c:
        info = c.info()
    head = info.head
    print(f"Python client, {info.backend} head {head.vocab_size}x{head.hidden_size} ({head.dtype}), {args.label}: "
          f"sequential scores, one Call each, {args.iterations} after {args.warmup} warm-ups\n")
    if args.rows:
        latency_table(args, head)
    done, rpcs, wall, before, after = asyncio.run(rate(args, head))
    d = lambda name: metric(after, name) - metric(before, name)  # noqa: E731
    batches = d('lce_batch_requests_count{op="score"}')
    per_call = d('lce_batch_requests_sum{op="score"}') / batches if batches else 1.0
    client = "Python asyncio" + (", one RPC a call" if args.no_coalesce else
                                 ", coalesced, one in flight" if args.one_in_flight else ", coalesced")
    print("\n| client | callers | rows a call | calls/s | calls an RPC | engine calls/s | requests an engine call "
          "| engine busy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {client} | {args.concurrency} | {args.rate_rows} | {done / wall:.0f} | {done / max(rpcs, 1):.1f} "
          f"| {d(ENGINE_COUNT) / wall:.0f} | {per_call:.2f} | {100 * d(ENGINE_SUM) / wall:.0f}% |")


if __name__ == "__main__":
    main()
