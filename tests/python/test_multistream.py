"""Requests split over several streams and connections (Client(streams=K), RequestHeader.partial): the
answers equal the unsplit call's (per-row values and d_hidden bit for bit, reduced losses and PolicyLoss
statistics to float64 rounding), also over shared-memory regions; the parts really are separate streams
on separate TCP connections (the server's metrics and the kernel's socket table say so); a part whose
valid-token count does not add up is caught; an error in one part is the call's error; small requests
are not split and go out exactly as before."""
from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

import lce_client
from lce_client._client import _combine_summaries
from lce_client._proto import lce_pb2 as pb
from lce_client._proto import lce_pb2_grpc as pb_grpc
from conftest import HIDDEN, VOCAB
from helpers import Recorder, free_port, intercept_parts, sample, scrape

ROW_BYTES = {"fp32": HIDDEN * 4, "bf16": HIDDEN * 2, "fp16": HIDDEN * 2}
CHUNK_ROWS = 16


def split_client(head, streams=4, min_rows=40, chunk_rows=CHUNK_ROWS, **kw):
    rb = ROW_BYTES[head.dtype]
    return head.client(chunk_bytes=chunk_rows * rb, streams=streams, min_stream_bytes=min_rows * rb, **kw)


def plain_client(head, chunk_rows=CHUNK_ROWS):
    return head.client(chunk_bytes=chunk_rows * ROW_BYTES[head.dtype])


def data(rows, seed=0, ignore_every=7):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, VOCAB, rows).astype(np.int64)
    y[::ignore_every] = -100
    return y


def test_plan_parts_cut_at_chunks_and_respect_the_minimum():
    c = lce_client.Client("127.0.0.1:1", chunk_bytes=100 * 10, streams=4, min_stream_bytes=100 * 25)
    rb, step = 100, 10
    assert c._plan_parts(1000, rb, step, None) == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    parts = c._plan_parts(1003, rb, step, None)  # 101 chunks, the last one short
    assert len(parts) == 4 and parts[0][0] == 0 and parts[-1][1] == 1003
    assert all(r0 % step == 0 for r0, _ in parts)
    assert all(b[1] == a[0] for b, a in zip(parts, parts[1:]))
    assert c._plan_parts(70, rb, step, None) == [(0, 30), (30, 70)]  # 2 parts of >= 25 rows
    assert c._plan_parts(49, rb, step, None) == [(0, 49)]            # too small to split
    assert c._plan_parts(1000, rb, step, 1) == [(0, 1000)]           # per-call override
    eight = c._plan_parts(1000, rb, step, 8)  # 8 parts of >= 25 rows: 100 chunks, 12 or 13 each
    assert len(eight) == 8 and all(r1 - r0 >= 25 for r0, r1 in eight) and eight[-1][1] == 1000
    # chunks larger than a part: the rows are split evenly
    big = lce_client.Client("127.0.0.1:1", chunk_bytes=100 * 1000, streams=3, min_stream_bytes=100)
    assert big._plan_parts(300, rb, 1000, None) == [(0, 100), (100, 200), (200, 300)]
    with pytest.raises(ValueError):
        c._plan_parts(1000, rb, step, 0)
    c.close()
    big.close()


def test_split_answers_equal_unsplit(head):
    rows = 517  # 33 chunks of 16 rows, the last short; 4 parts
    st, _ = head.hidden(rows, seed=11, shape=(11, 47))
    y = data(rows, seed=3).reshape(11, 47)
    rng = np.random.default_rng(5)
    gl = rng.standard_normal((11, 47)).astype(np.float32)
    glp = rng.standard_normal((11, 47)).astype(np.float32)
    gent = rng.standard_normal((11, 47)).astype(np.float32)
    with plain_client(head) as c1, split_client(head) as c4:
        assert len(c4._plan_parts(rows, ROW_BYTES[head.dtype], CHUNK_ROWS, None)) == 4

        lp1, ent1 = c1.score(st, y, temperature=0.9)
        lp4, ent4 = c4.score(st, y, temperature=0.9)
        assert lp4.shape == (11, 47)
        np.testing.assert_array_equal(lp4, lp1)
        np.testing.assert_array_equal(ent4, ent1)

        for reduction in ("mean", "sum", "none"):
            kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, return_logprobs=True)
            if reduction == "none":
                kw["grad_loss"] = gl
            r1 = c1.forward_backward(st, y, **kw)
            r4 = c4.forward_backward(st, y, **kw)
            np.testing.assert_array_equal(r4.per_token_loss, r1.per_token_loss)
            np.testing.assert_array_equal(r4.logprobs, r1.logprobs)
            np.testing.assert_array_equal(r4.d_hidden, r1.d_hidden)
            assert r4.valid_tokens == r1.valid_tokens == int(np.count_nonzero(y != -100))
            assert r4.rows == r1.rows == rows and r4.head_version == r1.head_version
            assert r4.loss == pytest.approx(r1.loss, rel=1e-12, abs=1e-12), reduction

        d1 = c1.backward(st, y, glp, gent)
        d4 = c4.backward(st, y, glp, gent)
        np.testing.assert_array_equal(d4, d1)

        old = r1.logprobs + rng.normal(0, 0.1, (11, 47)).astype(np.float32)
        adv = rng.standard_normal((11, 47)).astype(np.float32)
        ref = r1.logprobs + rng.normal(0, 0.05, (11, 47)).astype(np.float32)
        for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
            kw = dict(aggregation=agg, clip_low=0.1, clip_high=0.15, dual_clip=3.0, entropy_coef=0.01,
                      kl_coef=0.05, kl_estimator="k3", ref_logprobs=ref)
            p1 = c1.policy_loss(st, y, old, adv, **kw)
            p4 = c4.policy_loss(st, y, old, adv, **kw)
            np.testing.assert_array_equal(p4.d_hidden, p1.d_hidden)
            np.testing.assert_array_equal(p4.logprobs, p1.logprobs)
            np.testing.assert_array_equal(p4.entropy, p1.entropy)
            assert p4.valid_tokens == p1.valid_tokens
            assert p4.loss == pytest.approx(p1.loss, rel=1e-9, abs=1e-12), agg
            for stat in ("clip_fraction", "approx_kl", "mean_entropy", "mean_ratio", "mean_kl"):
                assert getattr(p4, stat) == pytest.approx(getattr(p1, stat), rel=1e-9, abs=1e-12), (agg, stat)
            assert 0 < p1.clip_fraction < 1  # the statistic is exercised, not trivially 0


def test_split_with_parts_smaller_than_a_chunk(heads):
    """chunk_bytes larger than a part: the rows are split evenly, and every row's answers are the same
    bits (the engine's invariance guarantee; only the request's summed loss may round differently)."""
    head = heads["fp32"]
    rows = 203
    st, _ = head.hidden(rows, seed=12)
    y = data(rows, seed=4)
    with plain_client(head, chunk_rows=4096) as c1, split_client(head, streams=3, min_rows=10,
                                                                   chunk_rows=4096) as c3:
        assert c3._plan_parts(rows, ROW_BYTES["fp32"], 4096, None) == [(0, 67), (67, 135), (135, 203)]
        r1 = c1.forward_backward(st, y)
        r3 = c3.forward_backward(st, y)
        np.testing.assert_array_equal(r3.per_token_loss, r1.per_token_loss)
        np.testing.assert_array_equal(r3.d_hidden, r1.d_hidden)
        assert r3.loss == pytest.approx(r1.loss, rel=1e-6)
        # a per-call override turns splitting off (and on)
        r3b = c3.forward_backward(st, y, streams=1)
        assert r3b.loss == r1.loss
        np.testing.assert_array_equal(r3b.d_hidden, r1.d_hidden)
        lp2, _ = c1.score(st, y, streams=2)
        np.testing.assert_array_equal(lp2, c1.score(st, y)[0])


def test_split_over_shared_memory_regions(heads):
    head = heads["bf16"]
    rows, rb = 300, ROW_BYTES["bf16"]
    st, _ = head.hidden(rows, seed=13)
    y = data(rows, seed=6)
    with plain_client(head) as c1, split_client(head, streams=3) as c3, c3.shared_memory_session() as s:
        region = s.create(st.nbytes + 3 * rb + 10)
        h = region.ndarray(st.shape, st.dtype, offset=3 * rb + 10)  # not at the region's start
        h[...] = st
        out = s.create(st.nbytes + 64)
        lp1, ent1 = c1.score(st, y)
        lp3, ent3 = c3.score(h, y, hidden_region=region)
        np.testing.assert_array_equal(lp3, lp1)
        np.testing.assert_array_equal(ent3, ent1)
        r1 = c1.forward_backward(st, y)
        r3 = c3.forward_backward(h, y, hidden_region=region, d_hidden_region=out, d_hidden_offset=64)
        np.testing.assert_array_equal(r3.d_hidden, r1.d_hidden)
        assert np.shares_memory(r3.d_hidden, out.array)
        # bit patterns: with ml_dtypes present d_hidden is typed bfloat16, the region view here is raw
        np.testing.assert_array_equal(out.ndarray(st.shape, st.dtype, offset=64).view(np.uint16),
                                      np.asarray(r1.d_hidden).view(np.uint16))
        assert r3.loss == pytest.approx(r1.loss, rel=1e-12)
        adv = np.random.default_rng(1).standard_normal(rows).astype(np.float32)
        p1 = c1.policy_loss(st, y, lp1, adv)
        p3 = c3.policy_loss(h, y, lp1, adv, hidden_region=region, d_hidden_region=out)
        np.testing.assert_array_equal(p3.d_hidden, p1.d_hidden)
        assert p3.loss == pytest.approx(p1.loss, rel=1e-9, abs=1e-12)


@pytest.fixture
def metrics_server(server_factory):
    port = free_port()
    srv = server_factory([f"--seed-head=97x{HIDDEN}", "--head-dtype=fp32", "--seed=5", f"--metrics-port={port}",
                          "--metrics-host=127.0.0.1"], name="split_metrics")
    srv.metrics_port = port
    return srv


def client_connections(server_port: int) -> set:
    """Established TCP connections to 127.0.0.1:server_port, seen from the connecting side (the kernel's
    socket table; only this test connects to its own server)."""
    conns = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(path).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            local, remote, state = f[1], f[2], f[3]
            if state == "01" and int(remote.rsplit(":", 1)[1], 16) == server_port:
                conns.add(local)
    return conns


def test_split_uses_several_streams_and_connections(metrics_server):
    srv = metrics_server
    rows, rb = 640, HIDDEN * 4
    rng = np.random.default_rng(7)
    st = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
    y = rng.integers(0, 97, rows)
    c = lce_client.Client(srv.target, timeout=30, chunk_bytes=32 * rb, streams=4, min_stream_bytes=64 * rb)
    c_main = lce_client.Client(srv.target, timeout=30, chunk_bytes=32 * rb)
    try:
        ref = c_main.forward_backward(st, y)
        before = scrape(srv.metrics_port)
        r = c.forward_backward(st, y)
        after = scrape(srv.metrics_port)
        d = lambda name, **kw: sample(after, name, **kw) - sample(before, name, **kw)  # noqa: E731
        assert d("lce_requests_total", method="ForwardBackward", code="OK") == 4  # four streams
        assert d("lce_tokens_total", op="forward_backward") == rows
        np.testing.assert_array_equal(r.d_hidden, ref.d_hidden)
        # four client-side sockets of `c` (its main channel was never used), plus c_main's one
        conns = client_connections(srv.port)
        assert len(conns) == 5, conns
        # a second call reuses the same connections
        c.score(st, y)
        assert client_connections(srv.port) == conns
        # a small request is not split: one more stream, no new connection
        before = scrape(srv.metrics_port)
        c.score(st[:100], y[:100])
        after = scrape(srv.metrics_port)
        assert sample(after, "lce_requests_total", method="Score", code="OK") - \
            sample(before, "lce_requests_total", method="Score", code="OK") == 1
    finally:
        c.close()
        c_main.close()


def test_unsplit_requests_go_out_as_before(heads):
    """streams=1, or a request too small to split: one stream on the main channel, partial unset, and the
    same messages whatever `streams` says."""
    head = heads["fp32"]
    rows = 50
    st, _ = head.hidden(rows, seed=14)
    y = data(rows)
    sent = {}
    for name, kw in (("one", {}), ("small", dict(streams=4, min_stream_bytes=40 * ROW_BYTES["fp32"]))):
        c = head.client(chunk_bytes=16 * ROW_BYTES["fp32"], **kw)
        rec = Recorder()
        c._stub = pb_grpc.LceServiceStub(grpc.intercept_channel(c._channel, rec))
        c.forward_backward(st, y)
        c.score(st, y)
        assert not c._part_channels, "no extra channel for requests that are not split"
        assert [m for m, _ in rec.calls] == ["/lce.v1.LceService/ForwardBackward", "/lce.v1.LceService/Score"]
        for _, msgs in rec.calls:
            assert msgs[0].HasField("header") and not msgs[0].header.partial
        sent[name] = [[m.SerializeToString() for m in msgs] for _, msgs in rec.calls]
        c.close()
    assert sent["one"] == sent["small"]


def test_split_parts_carry_the_whole_requests_counts(heads):
    head = heads["fp32"]
    rows = 400
    st, _ = head.hidden(rows, seed=15)
    y = data(rows, seed=8)
    with split_client(head) as c:
        recs = intercept_parts(c, 4, lambda i: Recorder())
        c.forward_backward(st, y)
        adv = np.ones(rows, np.float32)
        seq = np.repeat(np.arange(4), 100)
        c.policy_loss(st, y, np.zeros(rows, np.float32), adv, sequence_ids=seq, aggregation="seq-mean-token-mean")
    valid = int(np.count_nonzero(y != -100))
    per_seq = [int(np.count_nonzero(y[q * 100:(q + 1) * 100] != -100)) for q in range(4)]
    for rec in recs:
        (m_fb, fb), (m_pl, pl) = rec.calls
        assert m_fb.endswith("/ForwardBackward") and m_pl.endswith("/PolicyLoss")
        assert fb[0].header.partial and fb[0].header.num_valid_tokens == valid
        assert pl[0].header.partial and list(pl[0].header.policy.sequence_valid_tokens) == per_seq
    # the parts' rows tile the request, each part's first chunk is where its rows begin
    parts = c._plan_parts(rows, ROW_BYTES["fp32"], CHUNK_ROWS, None)
    assert parts == [(0, 96), (96, 192), (192, 288), (288, 400)]  # 25 chunks of 16: 6, 6, 6, 7 (last short)
    for rec, (r0, r1) in zip(recs, parts):
        chunks = [m.chunk for m in rec.calls[0][1][1:]]
        got = np.concatenate([np.asarray(ch.targets) for ch in chunks])
        np.testing.assert_array_equal(got, y[r0:r1])
        np.testing.assert_array_equal(np.frombuffer(b"".join(ch.hidden for ch in chunks), np.float32),
                                      st[r0:r1].reshape(-1))


def _drop_one_valid_target(part_to_tamper):
    """A tamper that turns the first valid target of a part's first chunk into ignore_index."""

    def make(i):
        def tamper(k, m):
            if i == part_to_tamper and k == 1:
                m2 = pb.StreamRequest()
                m2.CopyFrom(m)
                t = list(m2.chunk.targets)
                j = next(j for j, v in enumerate(t) if v != -100)
                m2.chunk.targets[j] = -100
                return m2
            return m

        return Recorder(tamper)

    return make


def test_a_count_that_does_not_add_up_is_caught(heads):
    head = heads["fp32"]
    rows = 400
    st, _ = head.hidden(rows, seed=16)
    y = data(rows, seed=9)
    with split_client(head) as c:
        intercept_parts(c, 4, _drop_one_valid_target(2))
        valid = int(np.count_nonzero(y != -100))
        # reduction "sum" declares no count: the summary reports what the server saw
        assert c.forward_backward(st, y, reduction="sum").valid_tokens == valid - 1
        for call in (lambda: c.forward_backward(st, y),
                     lambda: c.policy_loss(st, y, np.zeros(rows, np.float32), np.ones(rows, np.float32))):
            with pytest.raises(lce_client.LceError) as ei:
                call()
            e = ei.value
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT, e
            assert f"add up to {valid - 1}" in e.details and f"but {valid} were declared" in e.details, e.details


def test_an_error_in_one_part_is_the_calls_error(heads):
    head = heads["fp32"]
    rows = 400
    st, _ = head.hidden(rows, seed=17)
    y = data(rows, seed=10)

    def make(i):
        def tamper(k, m):
            if i == 3 and k == 2:
                m2 = pb.StreamRequest()
                m2.CopyFrom(m)
                m2.chunk.targets[0] = VOCAB + 5  # out of range: INVALID_ARGUMENT from the server
                return m2
            return m

        return Recorder(tamper)

    seen = []
    with split_client(head) as c:
        intercept_parts(c, 4, make)
        with pytest.raises(lce_client.LceError) as ei:
            c.forward_backward(st, y, progress=lambda done, total: seen.append(done))
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert str(VOCAB + 5) in ei.value.details or "target" in ei.value.details
        # the client (and server) go on
        intercept_parts(c, 4, lambda i: Recorder())
        r = c.forward_backward(st, y)
        assert r.rows == rows


def test_split_progress_is_reported_in_the_calling_thread(heads):
    head = heads["fp32"]
    rows = 400
    st, _ = head.hidden(rows, seed=18)
    y = data(rows)
    seen, threads = [], set()

    def cb(done, total):
        seen.append((done, total))
        threads.add(threading.get_ident())

    with split_client(head) as c:
        c.score(st, y, progress=cb)
    assert threads == {threading.get_ident()}
    assert [t for _, t in seen] == [rows] * len(seen) and len(seen) == -(-rows // CHUNK_ROWS)
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and dones[-1] == rows


def test_combine_summaries_checks_versions_and_weights_stats():
    parts = [(0, 10), (10, 30)]
    a = pb.RequestSummary(rows=10, valid_tokens=5, loss=0.25, head_version=3, clip_fraction=0.2, mean_ratio=1.0)
    b = pb.RequestSummary(rows=20, valid_tokens=15, loss=0.5, head_version=3, clip_fraction=0.6, mean_ratio=2.0)
    s = _combine_summaries("PolicyLoss", parts, [a, b], 20)
    assert (s.rows, s.valid_tokens, s.head_version) == (30, 20, 3)
    assert s.loss == 0.75
    assert s.clip_fraction == pytest.approx((0.2 * 5 + 0.6 * 15) / 20)
    assert s.mean_ratio == pytest.approx((1.0 * 5 + 2.0 * 15) / 20)
    b.head_version = 4
    with pytest.raises(lce_client.LceError) as ei:
        _combine_summaries("ForwardBackward", parts, [a, b], 20)
    assert ei.value.code == grpc.StatusCode.ABORTED and "[3, 4]" in ei.value.details
    # no valid tokens at all: statistics are 0, as the server's are
    z = [pb.RequestSummary(rows=10, valid_tokens=0, head_version=1), pb.RequestSummary(rows=20, head_version=1)]
    s = _combine_summaries("PolicyLoss", parts, z, 0)
    assert s.clip_fraction == 0 and s.loss == 0
