"""Chunk plans (lce_client.plan_chunks, the C++ client's PlanChunks) and Client(first_chunk_bytes=,
last_chunk_bytes=): a stream's first chunk may be smaller (the server starts sooner) and its last chunk
smaller (a short tail). The plan is the C++ one (same cases as tests/client/wire_codec_test.cc
PlanChunks.*); every streaming call uses it on the wire and over the data plane, each stream of a split
request planned on its own rows, while shared-memory requests keep chunk_bytes alone (as the C++ client
ignores both options there). The server really gets those chunks: the request messages, the answers
(progress), and its request log's engine_calls say so, and the answers are bit for bit those of the same
chunks sent one request each.

(On the CPU engine a row's values depend on the shape of the chunk it is computed in, to the last bit:
the same request cut differently agrees to float rounding, not bit for bit, whatever the options. So
bitwise comparisons here are against the same chunks, and comparisons with the default chunking are
to float tolerance.)"""
from __future__ import annotations

import json
import random
import time
import uuid

import grpc
import numpy as np
import pytest

import lce_client
from lce_client import plan_chunks
from lce_client._proto import lce_pb2_grpc as pb_grpc
from conftest import (assert_close, DTYPES, GRAD_RTOL, HIDDEN, serve_heads, targets_for_rows)
from helpers import Recorder, intercept_parts

ROW_BYTES = {"fp32": HIDDEN * 4, "bf16": HIDDEN * 2, "fp16": HIDDEN * 2}


# ------------------------------------------------------------------------------------- the plan
def expect_tiles(plan, rows, max_rows):
    """As ExpectTiles in wire_codec_test.cc: in order, contiguous, 1..max_rows rows each, covering rows."""
    nxt = 0
    for first, n in plan:
        assert first == nxt, plan
        assert 1 <= n <= max_rows, plan
        nxt = first + n
    assert nxt == rows, plan


def test_cuts_at_chunk_bytes_with_at_least_one_row():
    # 10 rows of 100 bytes, 350-byte chunks: 3 rows each, the last one 1.
    p = plan_chunks(10, 100, 350)
    assert len(p) == 4
    assert p[-1] == (9, 1)
    expect_tiles(p, 10, 3)
    # Exact multiple.
    p = plan_chunks(12, 100, 400)
    assert len(p) == 3
    expect_tiles(p, 12, 4)
    # Rows larger than a chunk: one row per chunk.
    p = plan_chunks(5, 1000, 10)
    assert len(p) == 5
    expect_tiles(p, 5, 1)
    # Everything fits in one chunk.
    p = plan_chunks(7, 8, 4 << 20)
    assert p == [(0, 7)]
    # No rows: no chunks.
    assert plan_chunks(0, 100, 1000) == []


def test_a_smaller_first_chunk_then_full_ones():
    p = plan_chunks(10, 100, 400, 100)
    assert len(p) == 4
    assert p[0] == (0, 1)
    assert p[1] == (1, 4)
    assert p[3] == (9, 1)
    assert p == [(0, 1), (1, 4), (5, 4), (9, 1)]
    # never more than a full chunk, never less than a row
    assert plan_chunks(10, 100, 400, 4000)[0][1] == 4
    assert plan_chunks(10, 100, 400, 1)[0][1] == 1


def test_a_smaller_last_chunk_where_the_rows_allow_it():
    p = plan_chunks(20, 100, 600, 100, 200)  # 1, 6, 6, 5, then the last 2 rows
    assert len(p) == 5
    assert p[0] == (0, 1)
    assert p[3] == (13, 5)
    assert p[4] == (18, 2)
    assert p == [(0, 1), (1, 6), (7, 6), (13, 5), (18, 2)]
    expect_tiles(plan_chunks(20, 100, 600, 0, 200), 20, 6)
    assert plan_chunks(20, 100, 600, 0, 200) == [(0, 6), (6, 6), (12, 6), (18, 2)]
    # Too few rows for a first and a last chunk: no separate last one.
    assert len(plan_chunks(3, 100, 600, 100, 200)) == 2
    assert plan_chunks(3, 100, 600, 100, 200) == [(0, 1), (1, 2)]
    assert len(plan_chunks(1, 100, 600, 0, 100)) == 1
    # Exactly first + last rows: still no separate last one (the rows must go past both).
    assert plan_chunks(3, 100, 600, 100, 200 + 99) == [(0, 1), (1, 2)]
    assert plan_chunks(4, 100, 600, 100, 200) == [(0, 1), (1, 1), (2, 2)]
    # A last chunk larger than a full one is a full one.
    assert plan_chunks(20, 100, 600, 0, 10_000) == [(0, 6), (6, 6), (12, 2), (14, 6)]


def test_growing_from_the_first_chunk():
    # 1, 2, 4, then 6-row chunks (the cap), the last 2 rows apart: the C++ PlanChunks test's plan.
    assert plan_chunks(30, 100, 600, 100, 200, grow=True) == [(0, 1), (1, 2), (3, 4), (7, 6), (13, 6), (19, 6),
                                                               (25, 3), (28, 2)]
    # Without a smaller first chunk there is nothing to grow from.
    assert plan_chunks(30, 100, 600, 0, 0, True) == plan_chunks(30, 100, 600)
    # 8192 rows of 8 KiB (the C++ test's plans): doubling until what is left fits in a full chunk.
    assert [n for _, n in plan_chunks(8192, 8192, 34 << 20, 2 << 20, 0, True)] == [256, 512, 1024, 2048, 4352]
    assert [n for _, n in plan_chunks(8192, 8192, 32 << 20, 2 << 20, 0, True)] == [256, 512, 1024, 2048, 4096, 256]
    assert [n for _, n in plan_chunks(8192, 8192, 36 << 20, 4 << 20, 0, True)] == [512, 1024, 2048, 4608]
    rng = random.Random(11)
    for _ in range(500):
        rows, chunk = 1 + rng.randrange(3000), 100 * (1 + rng.randrange(64))
        g = plan_chunks(rows, 100, chunk, 100 * (1 + rng.randrange(8)), 100 * rng.randrange(4), True)
        expect_tiles(g, rows, chunk // 100)
        # each grown chunk at most doubles the one before, but the one that takes what is left
        grown_end = len(g) - (1 if len(g) > 1 and g[-1][1] < g[-2][1] else 0)
        assert all(g[k][1] <= 2 * g[k - 1][1] for k in range(1, grown_end - 1)), g


def test_the_client_plans_growing_chunks_when_asked():
    c = lce_client.Client("127.0.0.1:1", chunk_bytes=600, first_chunk_bytes=100, last_chunk_bytes=200,
                          grow_chunks=True)
    assert c._plan_part(30, 100, region_backed=False) == plan_chunks(30, 100, 600, 100, 200, True)
    # a score keeps its last chunk whole
    assert c._plan_part(30, 100, region_backed=False, d_hidden_back=False) == plan_chunks(30, 100, 600, 100, 0, True)
    # region-backed requests are cut at chunk_bytes alone
    assert c._plan_part(30, 100, region_backed=True) == plan_chunks(30, 100, 600)
    assert lce_client.Client("127.0.0.1:1").grow_chunks is False


def test_both_off_is_the_uniform_plan():
    for rows, rb, cb in ((517, 192, 16 * 192), (1, 96, 1), (100, 7, 1000), (4096, 96, 4 << 20), (33, 10, 11)):
        step = max(1, cb // rb)
        want = [(r0, min(step, rows - r0)) for r0 in range(0, rows, step)]
        assert plan_chunks(rows, rb, cb) == want
        assert plan_chunks(rows, rb, cb, 0, 0) == want


def test_random_shapes_tile_the_rows():
    rng = random.Random(3)
    for _ in range(2000):
        rows, row_bytes, chunk = rng.randrange(5000), 1 + rng.randrange(20000), 1 + rng.randrange(1 << 20)
        per = max(1, chunk // row_bytes)
        expect_tiles(plan_chunks(rows, row_bytes, chunk), rows, per)
        fb, lb = rng.randrange(1 << 20) * rng.randrange(2), rng.randrange(1 << 20) * rng.randrange(2)
        p = plan_chunks(rows, row_bytes, chunk, fb, lb)
        expect_tiles(p, rows, per)
        if not p:
            assert rows == 0
            continue
        first_cap = min(per, max(1, fb // row_bytes)) if fb else per
        last_cap = min(per, max(1, lb // row_bytes)) if lb else per
        # a separate last chunk where the rows go past the first chunk and it
        split_last = bool(lb) and rows > first_cap + last_cap
        if split_last:
            assert len(p) >= 3 and p[-1] == (rows - last_cap, last_cap), p
        else:
            assert len(p) == len(plan_chunks(rows, row_bytes, chunk, fb)), p  # as if last_chunk_bytes were 0
        body = p[:-1] if split_last else p
        assert body[0][1] == min(first_cap, rows - (last_cap if split_last else 0)), p
        # between the first chunk and the last of the body (which may be short), every chunk is full
        assert all(n == per for _, n in body[1:-1]), p
        # the default is the same plan as the explicit zeros
        if not fb and not lb:
            assert p == plan_chunks(rows, row_bytes, chunk)


@pytest.mark.parametrize("bad", [-1, -4096, 1.5, "16", True, None])
def test_options_are_checked(bad):
    for name in ("first_chunk_bytes", "last_chunk_bytes"):
        with pytest.raises(ValueError, match=name):
            lce_client.Client("127.0.0.1:1", **{name: bad})


def test_options_default_to_off():
    c = lce_client.Client("127.0.0.1:1")
    assert c.first_chunk_bytes == 0 and c.last_chunk_bytes == 0
    c.close()
    c = lce_client.Client("127.0.0.1:1", first_chunk_bytes=np.int64(4096), last_chunk_bytes=1 << 20)
    assert (c.first_chunk_bytes, c.last_chunk_bytes) == (4096, 1 << 20)
    assert type(c.first_chunk_bytes) is int
    c.close()


# ------------------------------------------------------------------------------------ the client
@pytest.fixture(scope="module")
def plan_heads(workdir):
    """A server per dtype with the data plane on, its request log (engine_calls) in server.log_path."""
    yield from serve_heads(workdir, "plan_head", 300, ["--data-port=0", "--log-requests=true"])




def as_bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def tagged(client, rid):
    """Sends x-request-id `rid` with the client's calls (the server's request log then names it)."""
    client._metadata = tuple(m for m in (client._metadata or ()) if m[0] != "x-request-id") + (("x-request-id", rid),)


def engine_calls(server, rid, method, timeout=5.0, parts=1):
    """Engine calls of request `rid` (all its streams) by the server's request log, once `parts`
    streams of it are logged (or the timeout passes)."""
    deadline = time.time() + timeout
    while True:
        lines = []
        for line in server.log_path.read_text().splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                if d.get("request_id") == rid and d.get("method") == method:
                    lines.append(d)
        if len(lines) >= parts or time.time() > deadline:
            return sum(d.get("engine_calls", 0) for d in lines), len(lines)
        time.sleep(0.02)


def expected_chunks(client, rows, row_bytes, region_backed=False, score=False):
    """The request's parts and the chunks each is sent as, in the request's rows. A score has no
    smaller last chunk (its last answer is a few floats: nothing to shorten)."""
    parts = client._plan_parts(rows, row_bytes, max(1, client.chunk_bytes // row_bytes), None)
    out = []
    for r0, r1 in parts:
        if region_backed:
            p = plan_chunks(r1 - r0, row_bytes, client.chunk_bytes)
        else:
            p = plan_chunks(r1 - r0, row_bytes, client.chunk_bytes, client.first_chunk_bytes,
                            0 if score else client.last_chunk_bytes)
        out.append([(r0 + f, n) for f, n in p])
    return parts, out


# rows, chunk rows, first / last chunk rows (0: off), streams, data-plane sockets. Chunks of 400 fp32
# rows are 75 KiB: over the data plane they are split over the sockets, the small ones not.
CASES = {
    "first-and-last": (1000, 64, 3, 5, 1, 1),
    "first-only": (1000, 64, 1, 0, 1, 2),
    "last-only": (1000, 64, 0, 10, 1, 2),
    "first-and-last-3-streams": (1000, 64, 3, 5, 3, 2),
    "large-chunks-4-sockets": (2100, 400, 16, 40, 1, 4),
    "large-chunks-2-streams": (2100, 400, 16, 40, 2, 3),
}
PATHS = ["bytes", "shm", "data-plane"]


def make_client(head, path, chunk_rows, first_rows, last_rows, streams, sockets):
    rb = ROW_BYTES[head.dtype]
    # first/last given in bytes a little over whole rows: the plan takes whole rows (at least one)
    kw = dict(chunk_bytes=chunk_rows * rb, first_chunk_bytes=first_rows * rb + (rb // 2 if first_rows else 0),
              last_chunk_bytes=last_rows * rb + (rb - 1 if last_rows else 0), streams=streams,
              min_stream_bytes=100 * rb)
    if path == "data-plane":
        kw.update(data_plane=True, data_plane_sockets=sockets, data_plane_streams=streams)
    return head.client(**kw)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_the_server_gets_the_planned_chunks_and_answers_as_for_them(plan_heads, case, path):
    rows, chunk_rows, first_rows, last_rows, streams, sockets = CASES[case]
    # a dtype per combination (all three over the cases); 400-row chunks of fp32 are split over sockets
    dtype = "fp32" if case.startswith("large") else DTYPES[(list(CASES).index(case) + PATHS.index(path)) % 3]
    head = plan_heads[dtype]
    rb = ROW_BYTES[dtype]
    st, _ = head.hidden(rows, seed=31)
    y = targets_for_rows(rows, seed=32)
    rng = np.random.default_rng(33)
    gl = rng.standard_normal(rows).astype(np.float32)
    glp = rng.standard_normal(rows).astype(np.float32)
    gent = rng.standard_normal(rows).astype(np.float32)
    c = make_client(head, path, chunk_rows, first_rows, last_rows, streams, sockets)
    default = head.client(chunk_bytes=chunk_rows * rb)   # the default chunking, one stream
    one = head.client(chunk_bytes=1 << 30)                 # a whole request a chunk (the per-chunk reference)
    session = region = None
    try:
        parts, plans = expected_chunks(c, rows, rb, region_backed=path == "shm")
        assert len(parts) == streams
        chunks = [ch for p in plans for ch in p]
        if path != "shm":
            # the options did something: each stream starts (and, where asked, ends) with its small chunk
            for (r0, r1), p in zip(parts, plans):
                if first_rows:
                    assert p[0] == (r0, first_rows)
                if last_rows:
                    assert p[-1] == (r1 - last_rows, last_rows)
        else:  # shared memory: chunk_bytes alone
            assert all(n == chunk_rows for p in plans for _, n in p[:-1])
        call_kw = {}
        if path == "shm":
            session = c.shared_memory_session()
            region = session.create(st.nbytes)
            h = region.ndarray(st.shape, st.dtype)
            h[...] = st
            call_kw["hidden_region"] = region
        else:
            h = st

        # What the server got, three ways: the messages on each stream, the answers (progress), and
        # the engine calls in its request log.
        recs = intercept_parts(c, streams, lambda i: Recorder()) if streams > 1 else None
        if recs is None:
            rec = Recorder()
            c._stub = pb_grpc.LceServiceStub(grpc.intercept_channel(c._channel, rec))
            recs = [rec]
        rid = "plan-" + uuid.uuid4().hex[:12]
        tagged(c, rid)
        done = []
        r = c.forward_backward(h, y, reduction="none", grad_loss=gl, return_logprobs=True, return_entropy=True,
                               progress=lambda d, t: done.append(d), **call_kw)
        for rec, plan in zip(recs, plans):  # stream i's messages are part i's plan, in order
            calls = [msgs for method, msgs in rec.calls if method.endswith("/ForwardBackward")]
            assert len(calls) == 1
            sent = [m.chunk for m in calls[0] if m.WhichOneof("kind") == "chunk"]
            assert [len(ch.targets) for ch in sent] == [n for _, n in plan]
            for ch, (r0, n) in zip(sent, plan):
                if path == "bytes":
                    assert ch.hidden == st[r0:r0 + n].tobytes()
                else:  # a slice of the region (both regions hold the batch from offset 0)
                    assert len(ch.hidden) == 0
                    assert (ch.hidden_region.offset, ch.hidden_region.byte_size) == (r0 * rb, n * rb)
                assert list(ch.targets) == y[r0:r0 + n].tolist()
        increments = np.diff([0] + done).tolist()
        assert done[-1] == rows and sorted(increments) == sorted(n for _, n in chunks)
        calls, logged = engine_calls(head.server, rid, "ForwardBackward", parts=streams)
        assert logged == streams and calls == len(chunks), (calls, logged, len(chunks))

        # Bit for bit the answers of the same chunks, each sent as a request of its own.
        want_lp, want_ent = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
        want_loss = np.zeros(rows, np.float32)
        want_dh = np.zeros_like(st)
        want_bwd = np.zeros_like(st)
        for r0, n in chunks:
            sl = slice(r0, r0 + n)
            ref = one.forward_backward(st[sl], y[sl], reduction="none", grad_loss=gl[sl], return_logprobs=True,
                                       return_entropy=True)
            want_lp[sl], want_ent[sl], want_loss[sl], want_dh[sl] = ref.logprobs, ref.entropy, \
                ref.per_token_loss, ref.d_hidden
            want_bwd[sl] = one.backward(st[sl], y[sl], glp[sl], gent[sl])
        np.testing.assert_array_equal(r.logprobs, want_lp)
        np.testing.assert_array_equal(r.entropy, want_ent)
        np.testing.assert_array_equal(r.per_token_loss, want_loss)
        np.testing.assert_array_equal(as_bits(r.d_hidden), as_bits(want_dh))
        np.testing.assert_array_equal(as_bits(c.backward(h, y, glp, gent, **call_kw)), as_bits(want_bwd))
        # a score's chunks: the same without the smaller last one
        _, score_plans = expected_chunks(c, rows, rb, region_backed=path == "shm", score=True)
        score_chunks = [ch for p in score_plans for ch in p]
        if path != "shm" and last_rows:
            assert len(score_chunks) < len(chunks)
        sid = "plan-score-" + uuid.uuid4().hex[:12]
        tagged(c, sid)
        lp, ent = c.score(h, y, **call_kw)
        calls, _ = engine_calls(head.server, sid, "Score", parts=streams)
        assert calls == len(score_chunks), (calls, len(score_chunks))
        want_slp, want_sent = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
        for r0, n in score_chunks:
            want_slp[r0:r0 + n], want_sent[r0:r0 + n] = one.score(st[r0:r0 + n], y[r0:r0 + n])
        np.testing.assert_array_equal(lp, want_slp)
        np.testing.assert_array_equal(ent, want_sent)

        # And what the default chunking answers, to float rounding (bit for bit where the chunks are
        # the default's: shared memory).
        d = default.forward_backward(st, y, return_logprobs=True)
        m = c.forward_backward(h, y, return_logprobs=True, **call_kw)
        if path == "shm":
            np.testing.assert_array_equal(as_bits(m.d_hidden), as_bits(d.d_hidden))
            np.testing.assert_array_equal(m.logprobs, d.logprobs)
        tol = GRAD_RTOL[dtype]
        assert_close(m.logprobs, d.logprobs, rtol=1e-5, atol=1e-5, what="logprobs")
        assert_close(m.per_token_loss, d.per_token_loss, rtol=1e-5, atol=1e-5, what="per-token loss")
        assert_close(lce_client.bf16_bits_to_f32(m.d_hidden) if dtype == "bf16" else m.d_hidden,
                     lce_client.bf16_bits_to_f32(d.d_hidden) if dtype == "bf16" else d.d_hidden,
                     rtol=tol, atol=1e-7, what="d_hidden")
        assert m.loss == pytest.approx(d.loss, rel=1e-6)
        assert m.valid_tokens == d.valid_tokens
        # policy_loss goes the same way
        old = (d.logprobs + 0.1).astype(np.float32)
        adv = rng.standard_normal(rows).astype(np.float32)
        pl = c.policy_loss(h, y, old, adv, **call_kw)
        pd = default.policy_loss(st, y, old, adv)
        assert pl.loss == pytest.approx(pd.loss, rel=1e-5, abs=1e-7)
        assert_close(pl.logprobs, pd.logprobs, rtol=1e-5, atol=1e-5, what="policy logprobs")
    finally:
        if session is not None:
            session.close()
        for x in (c, default, one):
            x.close()


def test_default_options_send_the_uniform_chunks(plan_heads):
    """first_chunk_bytes = last_chunk_bytes = 0: chunk_bytes rows a chunk, as before."""
    head = plan_heads["bf16"]
    rb = ROW_BYTES["bf16"]
    rows = 517
    st, _ = head.hidden(rows, seed=41)
    y = targets_for_rows(rows, seed=42)
    for kw in ({}, dict(data_plane=True)):
        with head.client(chunk_bytes=16 * rb, **kw) as c:
            done = []
            c.score(st, y, progress=lambda d, t: done.append(d))
            assert done == [min(rows, r0 + 16) for r0 in range(0, rows, 16)]
