"""lce_client.aio.Client: the four computations as coroutines over grpc.aio, many in flight from one
event loop, with the sync client's answers bit for bit (the CPU engine is batch-invariant)."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc
import numpy as np
import pytest

import lce_client
from conftest import HIDDEN, VOCAB


def batch(head, rows, seed):
    h, _ = head.hidden(rows, seed=seed)
    y = np.random.default_rng(seed + 1).integers(0, VOCAB, rows).astype(np.int64)
    y[::5] = -100
    return h, y


def test_64_concurrent_scores_equal_the_sync_clients(heads):
    head = heads["fp32"]
    batches = [batch(head, 1 + i % 13, 200 + i) for i in range(64)]
    with head.client() as sync:
        want = [sync.score(h, y) for h, y in batches]

    async def run():
        async with lce_client.aio.Client(head.target, timeout=60) as c:
            return await asyncio.gather(*(c.score(h, y) for h, y in batches))

    got = asyncio.run(run())
    assert len(got) == 64
    for (lp, ent), (wlp, went) in zip(got, want):
        assert np.array_equal(lp, wlp) and np.array_equal(ent, went)


def test_every_computation_and_a_streamed_request(heads):
    head = heads["fp32"]
    h, y = batch(head, 40, 300)
    u = np.random.default_rng(301).standard_normal(40).astype(np.float32)
    old = np.full(40, -7.0, np.float32)
    adv = np.random.default_rng(302).standard_normal(40).astype(np.float32)
    with head.client() as sync:
        want = (sync.forward_backward(h, y), sync.backward(h, y, u, u), sync.policy_loss(h, y, old, adv))

    async def run(chunk_bytes):
        async with lce_client.aio.Client(head.target, timeout=60, chunk_bytes=chunk_bytes) as c:
            fb = await c.forward_backward(h, y)
            bw = await c.backward(h, y, u, u)
            pl = await c.policy_loss(h, y, old, adv)
            info = await c.info()
            return fb, bw, pl, info

    for chunk_bytes in (1 << 22, 7 * HIDDEN * 4):  # one Call; a stream of six chunks
        fb, bw, pl, info = asyncio.run(run(chunk_bytes))
        assert fb.loss == want[0].loss and np.array_equal(fb.d_hidden, want[0].d_hidden)
        assert np.array_equal(fb.per_token_loss, want[0].per_token_loss)
        assert np.array_equal(bw, want[1])
        assert pl.loss == want[2].loss and np.array_equal(pl.d_hidden, want[2].d_hidden)
        assert info.head.vocab_size == VOCAB


def test_errors_and_what_is_the_sync_clients(heads):
    head = heads["fp32"]
    h, y = batch(head, 4, 400)
    y[1] = VOCAB

    async def run():
        async with lce_client.aio.Client(head.target, timeout=60) as c:
            with pytest.raises(lce_client.LceError) as e:
                await c.score(h, y)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "target" in e.value.details
            with pytest.raises(ValueError, match="sync lce_client.Client"):
                c.score(h, y, streams=2)
            y[1] = 0
            lp, _ = await c.score(h, y)  # the client goes on
            return lp

    assert asyncio.run(run()).shape == (4,)


def test_a_stream_refused_early_reports_the_servers_status(heads):
    # grpc.aio masks the status of a stream the server ended while we wrote (grpc/grpc#36066).
    head = heads["fp32"]
    h, y = batch(head, 400, 401)

    async def run():
        async with lce_client.aio.Client(head.target, timeout=60, chunk_bytes=4096) as c:
            for _ in range(5):
                with pytest.raises(lce_client.LceError) as e:
                    await c.score(h, y, head="no-such-head")
                assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-head" in e.value.details
            return await c.score(h, y)

    lp, _ = asyncio.run(run())
    want, _ = lce_client.Client(head.target).score(h, y)
    assert np.array_equal(lp, want)


# ------------------------------------------------------------------------------------- coalescing
# Concurrent small calls on one aio.Client go as one merged Call (Client(coalesce=True), the default);
# the CPU engine reports every output invariant across batches, so merging is on for these servers.

def one_at_a_time(target, calls, method="score"):
    """Each (args, kwargs) of `calls` awaited alone, one after the other (so never merged)."""
    async def run():
        async with lce_client.aio.Client(target, timeout=60) as c:
            return [await getattr(c, method)(*a, **kw) for a, kw in calls]

    return asyncio.run(run())


def concurrently(target, calls, method="score", **client_kw):
    """All of `calls` at once (asyncio.gather, exceptions returned); and the RPCs that the client sent."""
    async def run():
        async with lce_client.aio.Client(target, timeout=60, **client_kw) as c:
            got = await asyncio.gather(*(getattr(c, method)(*a, **kw) for a, kw in calls), return_exceptions=True)
            return got, c.rpcs_sent

    return asyncio.run(run())


def test_64_concurrent_scores_of_different_rows_merge_into_two_calls_with_the_same_bits(heads):
    head = heads["fp32"]
    with head.client() as c:  # what lets the client merge
        assert {"logprob", "entropy", "d_hidden"} <= set(c.info().invariant_across_batches)
    calls = [(batch(head, 1 + (7 * i) % 13, 500 + i), {}) for i in range(64)]
    calls[10] = (calls[10][0], {"entropy": False})  # other options: a lane of its own
    want = one_at_a_time(head.target, calls)
    got, rpcs = concurrently(head.target, calls)
    assert rpcs == 3  # two merged Calls for the 63 calls of one key (halves of 32 and 31), one for the other
    for (lp, ent), (wlp, went) in zip(got, want):
        assert lp.shape == wlp.shape and lp.view(np.uint32).tobytes() == wlp.view(np.uint32).tobytes()
        assert (ent is None and went is None) or ent.view(np.uint32).tobytes() == went.view(np.uint32).tobytes()


def test_concurrent_backwards_merge_and_forward_backward_never_does(heads):
    head = heads["bf16"]
    rng = np.random.default_rng(510)
    calls = []
    for i in range(12):
        h, y = batch(head, 1 + i % 5, 510 + i)
        calls.append(((h, y, rng.standard_normal(len(y)).astype(np.float32),
                       rng.standard_normal(len(y)).astype(np.float32)), {}))
    want = one_at_a_time(head.target, calls, "backward")
    got, rpcs = concurrently(head.target, calls, "backward")
    assert rpcs == 1
    assert all(np.array_equal(g, w) and g.shape == w.shape for g, w in zip(got, want))
    fb = [((h, y), {"reduction": "sum"}) for (h, y, _, _), _ in calls]
    got, rpcs = concurrently(head.target, fb, "forward_backward")
    assert rpcs == len(fb)  # its loss is over the whole request: never merged
    assert all(g.loss == w.loss for g, w in zip(got, one_at_a_time(head.target, fb, "forward_backward")))


def test_only_calls_whose_outputs_are_all_invariant_merge(heads):
    head = heads["fp32"]
    calls = [batch(head, 2, 515 + i) for i in range(8)]

    async def run(**kw):
        async with lce_client.aio.Client(head.target, timeout=60) as c:
            await c.score(*calls[0])
            # As a server whose entropy may differ in rounding with the batch (GetInfo's invariance).
            c._limits[""] = dataclasses.replace(c._limits[""], invariant=frozenset({"logprob"}))
            sent = c.rpcs_sent
            await asyncio.gather(*(c.score(h, y, **kw) for h, y in calls))
            return c.rpcs_sent - sent

    assert asyncio.run(run()) == 8
    assert asyncio.run(run(entropy=False)) == 1


def test_the_servers_count_of_rpcs_with_and_without_coalescing(server_factory):
    from helpers import free_port, sample, scrape

    port = free_port()
    srv = server_factory([f"--seed-head={VOCAB}x{HIDDEN}", "--head-dtype=fp32", f"--metrics-port={port}",
                          "--metrics-host=127.0.0.1"], name="aio_metrics")
    rng = np.random.default_rng(520)
    calls = [((rng.standard_normal((2, HIDDEN)).astype(np.float32), rng.integers(0, VOCAB, 2)), {})
             for _ in range(64)]
    for coalesce, want_rpcs in ((False, 64), (True, 2)):  # merged: two halves of 32
        before = sample(scrape(port), "lce_requests_total", method="Score", code="OK")
        got, rpcs = concurrently(srv.target, calls, coalesce=coalesce)
        after = sample(scrape(port), "lce_requests_total", method="Score", code="OK")
        assert rpcs == want_rpcs and after - before == want_rpcs
        assert all(isinstance(g, tuple) for g in got)


def test_a_large_queue_goes_as_two_halves_in_flight_together(heads):
    """With nothing in flight, 32 or more queued calls of a key go as two merged calls at once, so that
    the client's Python can work on one half's answers while the server computes the other's."""
    head = heads["fp32"]
    calls = [batch(head, 1, 560 + i) for i in range(64)]
    want = one_at_a_time(head.target, [(c, {}) for c in calls])

    async def run():
        async with lce_client.aio.Client(head.target, timeout=60) as c:
            await c.score(*calls[0])  # the head's limits in
            tasks = [asyncio.ensure_future(c.score(h, y)) for h, y in calls]
            for _ in range(4):  # the calls submit, then the lane launches one half a loop turn
                await asyncio.sleep(0)
            flying = sorted(len(b) for lane in c._lanes.values() for b in lane.inflight.values())
            return flying, await asyncio.gather(*tasks)

    flying, got = asyncio.run(run())
    assert flying == [32, 32]
    for (lp, ent), (wlp, went) in zip(got, want):
        assert lp.view(np.uint32).tobytes() == wlp.view(np.uint32).tobytes()
        assert ent.view(np.uint32).tobytes() == went.view(np.uint32).tobytes()


@pytest.mark.parametrize("found_by", ["client", "server"])
def test_a_bad_request_among_good_ones_fails_alone(heads, found_by):
    head = heads["fp32"]
    calls = [(batch(head, 4, 530 + i), {}) for i in range(16)]
    bad_y = calls[7][0][1].copy()
    bad_y[2] = VOCAB + 3
    calls[7] = ((calls[7][0][0], bad_y), {})
    want = one_at_a_time(head.target, calls[:7] + calls[8:])

    async def run():
        async with lce_client.aio.Client(head.target, timeout=60) as c:
            await c.score(*calls[0][0])  # the head's limits in
            if found_by == "server":  # a stale vocabulary: the client lets the bad target into the merged call
                c._limits[""] = dataclasses.replace(c._limits[""], vocab=VOCAB + 10)
            sent = c.rpcs_sent
            got = await asyncio.gather(*(c.score(*a) for a, _ in calls), return_exceptions=True)
            return got, c.rpcs_sent - sent

    got, rpcs = asyncio.run(run())
    e = got[7]
    assert isinstance(e, lce_client.LceError) and e.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "row 2" in e.details and "target" in e.details  # its own row, not the merged call's
    # The client keeps it out of the merged call (1 + 1), or the server refuses that and each goes alone.
    assert rpcs == (2 if found_by == "client" else 1 + 16)
    for (lp, ent), (wlp, went) in zip(got[:7] + got[8:], want):
        assert np.array_equal(lp, wlp) and np.array_equal(ent, went)


class Gate:
    """A stub whose Calls wait for `open` (so that a merged call stays in flight while the test acts)."""

    def __init__(self, stub):
        self.stub, self.open, self.calls = stub, asyncio.Event(), 0

    def __getattr__(self, name):
        return getattr(self.stub, name)

    async def Call(self, request, **kw):  # noqa: N802 - the stub's name
        self.calls += 1
        await self.open.wait()
        return await self.stub.Call(request, **kw)


def test_a_cancelled_caller_leaves_the_merged_call_to_the_others(heads):
    head = heads["fp32"]
    calls = [(batch(head, 3, 540 + i), {}) for i in range(16)]
    want = one_at_a_time(head.target, calls)

    async def run():
        async with lce_client.aio.Client(head.target, timeout=60) as c:
            await c.score(*calls[0][0])
            gate = c._aio_stubs[0] = Gate(c._aio_stubs[0])
            tasks = [asyncio.create_task(c.score(*a)) for a, _ in calls]
            while gate.calls == 0:  # the merged call in flight
                await asyncio.sleep(0.001)
            assert tasks[5].cancel()
            second = asyncio.create_task(c.score(*calls[1][0]))  # a second call in flight beside it
            late = asyncio.create_task(c.score(*calls[2][0]))  # queued behind both, then cancelled
            await asyncio.sleep(0.01)
            assert second.cancel() and late.cancel()
            gate.open.set()
            got = await asyncio.gather(*tasks, return_exceptions=True)
            return got, gate.calls, second, late

    got, rpcs, second, late = asyncio.run(run())
    # The calls in flight were neither cancelled nor sent again; the cancelled queued one never went.
    assert rpcs == 2 and second.cancelled() and late.cancelled()
    assert isinstance(got[5], asyncio.CancelledError)
    for (lp, ent), (wlp, went) in zip(got[:5] + got[6:], want[:5] + want[6:]):
        assert np.array_equal(lp, wlp) and np.array_equal(ent, went)


def test_each_caller_has_its_own_deadline_and_a_merged_call_the_latest(heads):
    head = heads["fp32"]
    h, y = batch(head, 2, 550)

    async def run():
        loop = asyncio.get_running_loop()
        async with lce_client.aio.Client(head.target, timeout=1.0) as c:
            await c.score(h, y)
            gate = c._aio_stubs[0] = Gate(c._aio_stubs[0])
            sent = []  # (when, timeout) of each Call
            call = gate.Call

            async def record(request, **kw):
                sent.append((loop.time(), kw["timeout"]))
                return await call(request, **kw)

            gate.Call = record
            starts, tasks = [], []
            for _ in range(4):  # the first two go (and wait at the gate), the others queue behind them
                starts.append(loop.time())
                tasks.append(asyncio.create_task(c.score(h, y)))
                await asyncio.sleep(0.2)
            with pytest.raises(lce_client.LceError) as e:
                await tasks[0]
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert loop.time() - starts[0] < 1.1 and not tasks[1].done()  # its own deadline
            gate.open.set()
            got = await asyncio.gather(*tasks[1:])
            return got, sent, starts

    got, sent, starts = asyncio.run(run())
    assert len(sent) == 3 and all(lp.shape == (2,) for lp, _ in got)
    when, timeout = sent[2]  # the third Call: both queued calls, with the later one's deadline
    assert abs(when + timeout - (starts[3] + 1.0)) < 0.05  # (the earlier one's: 0.2 s sooner)
