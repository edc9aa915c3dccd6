"""lce_client.aio.Client: the four computations as coroutines over grpc.aio, many in flight from one
event loop, with the sync client's answers bit for bit (the CPU engine is batch-invariant)."""
from __future__ import annotations

import asyncio

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
