"""The data plane (Client(data_plane=True), lce_client._data_plane, server/transport/region_data_plane.h): hidden
states and d_hidden travel over plain TCP into and out of server memory, and the answers are the bytes
path's bit for bit (same chunks, same engine calls on the CPU engine), over one and several streams and
sockets; regions grow with the batch and go with the session; a server without a data plane is a clear
error; every transfer is checked by the server (owner, bounds, kind of region) and a refusal leaves the
connection working, while a header without the magic closes it; a failure mid-request is the call's
error and the next call starts afresh."""
from __future__ import annotations

import re
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest

import lce_client
from lce_client import _data_plane as dpm
from conftest import (as_f64, assert_close, DTYPES, grad_of, GRAD_RTOL, HIDDEN, reference, requires_torch,
                      serve_heads, targets_for_rows, VOCAB)
from helpers import free_port, sample, scrape

ROW_BYTES = {"fp32": HIDDEN * 4, "bf16": HIDDEN * 2, "fp16": HIDDEN * 2}


@pytest.fixture(scope="module")
def dp_heads(workdir):
    """One server per dtype with the data plane on (--data-port=0) and metrics, serving the same weight
    as the `heads` fixture's."""
    yield from serve_heads(workdir, "dp_head", 100, lambda: ["--data-port=0", f"--metrics-port={free_port()}",
                                                               "--metrics-host=127.0.0.1"])


@pytest.fixture(params=DTYPES)
def dp_head(request, dp_heads):
    return dp_heads[request.param]




def clients(head, chunk_rows, streams=1, sockets=2, min_rows=None):
    """(bytes-path client, data-plane client) with the same chunks and streams, so that the server
    makes the same engine calls for both."""
    rb = ROW_BYTES[head.dtype]
    kw = dict(chunk_bytes=chunk_rows * rb, streams=streams, min_stream_bytes=(min_rows or chunk_rows) * rb)
    return head.client(**kw), head.client(data_plane=True, data_plane_sockets=sockets, data_plane_streams=streams, **kw)


def server_regions(head) -> float:
    return sample(scrape(head.server.metrics_port), "lce_regions", kind="server")


def as_bits(x) -> np.ndarray:
    """The bytes of an array (bitwise comparison, whatever the dtype: bf16 bits, NaNs, -0)."""
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def wait_for(fn, want, timeout=5.0):
    deadline = time.time() + timeout
    got = fn()
    while got != want and time.time() < deadline:
        time.sleep(0.02)
        got = fn()
    return got


# (rows, chunk rows, streams, sockets per direction per stream). Chunks of 700 rows are 64 KiB and
# more, so each is split over the sockets; chunks of 16 rows go over one socket each.
CASES = {
    "small-chunks": (517, 16, 1, 1),
    "small-chunks-4-streams": (517, 16, 4, 2),
    "split-over-4-sockets": (2300, 700, 1, 4),
    "3-streams-3-sockets": (2300, 700, 3, 3),
    "2-streams-4-sockets": (2300, 700, 2, 4),
}


def test_one_stream_by_default(dp_head):
    """A call over the data plane goes as one stream (data_plane_streams, default 1) where the same request
    splits over the wire; a call's own streams= still splits it."""
    head = dp_head
    rows, chunk_rows = 2800, 700
    st, _ = head.hidden(rows, seed=24, shape=(rows,))
    y = targets_for_rows(rows, seed=25)
    rb = ROW_BYTES[head.dtype]
    kw = dict(chunk_bytes=chunk_rows * rb, streams=4, min_stream_bytes=chunk_rows * rb)
    with head.client(**kw) as plain, head.client(data_plane=True, **kw) as dp:
        assert dp.data_plane_streams == 1
        assert len(plain._plan_parts(rows, rb, chunk_rows, None)) == 4  # the wire would split it
        lp0, _ = plain.score(st, y)
        lp1, _ = dp.score(st, y)
        np.testing.assert_array_equal(lp1, lp0)
        assert len(dp._data_plane.lanes) == 1
        lp2, _ = dp.score(st, y, streams=3)
        np.testing.assert_array_equal(lp2, lp0)
        assert len(dp._data_plane.lanes) == 3


@pytest.mark.parametrize("case", list(CASES))
def test_answers_equal_the_bytes_path(dp_head, case, monkeypatch):
    rows, chunk_rows, streams, sockets = CASES[case]
    # Which connections carried how many bytes, by direction.
    moved = {"write": {}, "read": {}}
    for op in ("write", "read"):
        orig = getattr(dpm.DataPlaneConnection, op)

        def wrapped(self, sid, region, offset, buf, _orig=orig, _op=op):
            n = memoryview(buf).nbytes
            moved[_op][id(self)] = moved[_op].get(id(self), 0) + n
            return _orig(self, sid, region, offset, buf)

        monkeypatch.setattr(dpm.DataPlaneConnection, op, wrapped)
    head = dp_head
    st, _ = head.hidden(rows, seed=21, shape=(rows,))
    y = targets_for_rows(rows, seed=22)
    rng = np.random.default_rng(23)
    gl = rng.standard_normal(rows).astype(np.float32)
    glp = rng.standard_normal(rows).astype(np.float32)
    gent = rng.standard_normal(rows).astype(np.float32)
    plain, dp = clients(head, chunk_rows, streams, sockets)
    with plain, dp:
        parts = dp._plan_parts(rows, ROW_BYTES[head.dtype], chunk_rows, None)
        assert len(parts) == streams, parts

        lp0, ent0 = plain.score(st, y, temperature=0.9)
        lp1, ent1 = dp.score(st, y, temperature=0.9)
        np.testing.assert_array_equal(lp1, lp0)
        np.testing.assert_array_equal(ent1, ent0)
        assert dp._data_plane.session is not None and len(dp._data_plane.lanes) == streams
        assert all(len(lane.up) == len(lane.down) == sockets for lane in dp._data_plane.lanes)
        # every hidden byte went over the data plane, over every socket of every stream
        # (chunks under 64 KiB go over the first socket of their stream's)
        used = streams * (sockets if chunk_rows * ROW_BYTES[head.dtype] >= dpm.SPLIT_MIN_BYTES else 1)
        assert sum(moved["write"].values()) == st.nbytes and not moved["read"]
        assert len(moved["write"]) == used

        for reduction in ("mean", "none"):
            kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, return_logprobs=True,
                      return_entropy=True)
            if reduction == "none":
                kw["grad_loss"] = gl
            r0 = plain.forward_backward(st, y, **kw)
            r1 = dp.forward_backward(st, y, **kw)
            np.testing.assert_array_equal(as_bits(r1.d_hidden), as_bits(r0.d_hidden))
            np.testing.assert_array_equal(r1.per_token_loss, r0.per_token_loss)
            np.testing.assert_array_equal(r1.logprobs, r0.logprobs)
            np.testing.assert_array_equal(r1.entropy, r0.entropy)
            assert r1.valid_tokens == r0.valid_tokens and r1.rows == r0.rows == rows
            assert r1.loss == pytest.approx(r0.loss, rel=1e-12, abs=1e-12)
            if streams == 1:
                assert r1.loss == r0.loss

        assert sum(moved["read"].values()) == 2 * st.nbytes  # both forward_backward calls' d_hidden
        assert len(moved["read"]) == used

        d0 = plain.backward(st, y, glp, gent)
        d1 = dp.backward(st, y, glp, gent)
        np.testing.assert_array_equal(as_bits(d1), as_bits(d0))

        adv = rng.standard_normal(rows).astype(np.float32)
        seq = np.arange(rows) // 50
        p0 = plain.policy_loss(st, y, lp0, adv, sequence_ids=seq, aggregation="seq-mean-token-mean", kl_coef=0.05,
                               ref_logprobs=lp0 + 0.01)
        p1 = dp.policy_loss(st, y, lp0, adv, sequence_ids=seq, aggregation="seq-mean-token-mean", kl_coef=0.05,
                            ref_logprobs=lp0 + 0.01)
        np.testing.assert_array_equal(as_bits(p1.d_hidden), as_bits(p0.d_hidden))
        np.testing.assert_array_equal(p1.logprobs, p0.logprobs)
        np.testing.assert_array_equal(p1.entropy, p0.entropy)
        assert p1.loss == pytest.approx(p0.loss, rel=1e-9, abs=1e-12)
        assert p1.valid_tokens == p0.valid_tokens


@requires_torch
def test_matches_the_float64_reference(dp_head):
    head = dp_head
    rows = 300
    st, h64 = head.hidden(rows, seed=31, shape=(3, 100))
    y = targets_for_rows(rows, seed=32).reshape(3, 100)
    with head.client(data_plane=True, chunk_bytes=64 * ROW_BYTES[head.dtype]) as c:
        lp, ent = c.score(st, y, temperature=0.7)
        r = c.forward_backward(st, y, reduction="sum", temperature=0.7)
    assert lp.shape == (3, 100) and r.d_hidden.shape == (3, 100, HIDDEN)
    ref = reference(head.w64, h64, y, temperature=0.7)
    assert_close(lp.reshape(-1), ref["logprobs"].detach(), rtol=2e-6, atol=2e-5, what="logprobs")
    assert_close(ent.reshape(-1), ref["entropy"].detach(), rtol=2e-6, atol=2e-5, what="entropy")
    assert_close(r.per_token_loss.reshape(-1), ref["loss"].detach(), rtol=2e-6, atol=3e-5, what="loss")
    assert_close(r.loss, ref["loss"].sum().detach(), rtol=2e-6, atol=2e-5, what="reduced loss")
    assert_close(as_f64(r.d_hidden, head.dtype).reshape(-1, HIDDEN), grad_of(ref["loss"].sum(), ref["h"]),
                 rtol=GRAD_RTOL[head.dtype], atol=1e-7, what="d_hidden")


def test_regions_grow_are_reused_and_go_with_the_session(dp_heads):
    head = dp_heads["bf16"]
    small_st, _ = head.hidden(200, seed=41)
    big_st, _ = head.hidden(30000, seed=42)  # 2.9 MB: more than the first regions' whole MiB
    y_small, y_big = targets_for_rows(200, seed=43), targets_for_rows(30000, seed=44)
    assert wait_for(lambda: server_regions(head), 0) == 0
    plain, dp = clients(head, 4096)
    try:
        lp0, _ = plain.score(small_st, y_small)
        lp1, _ = dp.score(small_st, y_small)
        np.testing.assert_array_equal(lp1, lp0)
        assert server_regions(head) == 1  # the hidden states' region; Score needs no other
        plane = dp._data_plane
        assert plane.hidden_bytes == 1 << 20

        before = scrape(head.server.metrics_port)
        r1 = dp.forward_backward(small_st, y_small)
        after = scrape(head.server.metrics_port)
        # the data plane's bytes count as the messages' do
        assert sample(after, "lce_bytes_received_total") - sample(before, "lce_bytes_received_total") >= small_st.nbytes
        assert sample(after, "lce_bytes_sent_total") - sample(before, "lce_bytes_sent_total") >= small_st.nbytes
        np.testing.assert_array_equal(r1.d_hidden, plain.forward_backward(small_st, y_small).d_hidden)
        assert server_regions(head) == 2
        first_session, first_hidden = plane.session.session_id, plane.hidden_region

        # a larger batch: both regions grow (the old ones are given back first), same session
        r_big = dp.forward_backward(big_st, y_big)
        np.testing.assert_array_equal(r_big.d_hidden, plain.forward_backward(big_st, y_big).d_hidden)
        assert plane.hidden_bytes == plane.d_hidden_bytes == 3 << 20
        assert plane.session.session_id == first_session and plane.hidden_region != first_hidden
        assert server_regions(head) == 2
        # a smaller one after it reuses them
        grown = (plane.hidden_region, plane.d_hidden_region)
        r2 = dp.forward_backward(small_st, y_small)
        np.testing.assert_array_equal(r2.d_hidden, r1.d_hidden)
        assert (plane.hidden_region, plane.d_hidden_region) == grown
        dp.close()  # the session ends, and its server memory with it
        assert plane.session is None and plane.lanes == []
        assert wait_for(lambda: server_regions(head), 0) == 0
    finally:
        plain.close()
        dp.close()


def test_regions_bypass_the_data_plane(dp_heads):
    head = dp_heads["fp32"]
    rows = 120
    st, _ = head.hidden(rows, seed=51)
    y = targets_for_rows(rows, seed=52)
    plain, dp = clients(head, 32)
    with plain, dp:
        # a call given shared-memory regions uses them, not the data plane
        with dp.shared_memory_session() as s:
            region = s.create(st.nbytes)
            h = region.ndarray(st.shape, st.dtype)
            h[...] = st
            lp, _ = dp.score(h, y, hidden_region=region)
        np.testing.assert_array_equal(lp, plain.score(st, y)[0])
        assert dp._data_plane.session is None


@pytest.mark.parametrize("streams", [1, 2])
def test_weight_gradient_accumulation_over_the_data_plane(dp_heads, streams):
    """A request that accumulates dW goes over the data plane too (it kept to the gRPC bytes until the
    server accumulated dW from every road), split or not, deferred or not: the same d_hidden as the bytes
    path's, bit for bit (the same chunks), and the same dW (bit for bit on one stream; split, the parts add
    to one buffer in the order their chunks come, so to fp32 rounding)."""
    head = dp_heads["fp32"]
    rows = 120
    st, _ = head.hidden(rows, seed=51)
    y = targets_for_rows(rows, seed=52)
    plain, dp = clients(head, 32, streams=streams, min_rows=48)
    with plain, dp:
        assert len(dp._plan_parts(rows, ROW_BYTES["fp32"], 32, None)) == streams
        plain.zero_grad()
        r0 = plain.forward_backward(st, y, accumulate_weight_grad=True)
        g0 = plain.get_grad()
        dp.zero_grad()
        r1 = dp.forward_backward(st, y, accumulate_weight_grad=True)
        g1 = dp.get_grad()
        assert dp._data_plane.session is not None  # it went over the data plane
        np.testing.assert_array_equal(r1.d_hidden, r0.d_hidden)

        def same_dw(got):
            if streams == 1:
                np.testing.assert_array_equal(got, g0)
            else:
                np.testing.assert_allclose(got, g0, rtol=1e-5, atol=1e-6 * np.abs(g0).max())

        same_dw(g1)
        assert np.abs(g0).max() > 0
        dp.zero_grad()
        d = dp.forward_backward(st, y, accumulate_weight_grad=True, defer_weight_grad=True)
        assert len(d.pending_grads) == 1 and not np.any(dp.get_grad())
        dp.commit_grad(d.pending_grads, scale=1.0)
        same_dw(dp.get_grad())
        dp.zero_grad()


def test_server_without_a_data_plane_is_a_clear_error(server_factory):
    srv = server_factory([f"--seed-head={VOCAB}x{HIDDEN}", "--head-dtype=fp32", "--data-port=-1"], name="no_dp")
    rows = 10
    st = np.random.default_rng(61).standard_normal((rows, HIDDEN)).astype(np.float32)
    y = targets_for_rows(rows, seed=62)
    with lce_client.Client(srv.target, timeout=30, data_plane=True) as c:
        assert c.data_plane
        assert c.info().data_port == 0
        for call in (lambda: c.score(st, y), lambda: c.forward_backward(st, y),
                     lambda: c.forward_backward(st, y, accumulate_weight_grad=True)):
            with pytest.raises(lce_client.LceError) as ei:
                call()
            assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION, ei.value
            assert "--data-port" in ei.value.details, ei.value
        # server memory is refused as well
        with c.shared_memory_session() as s:
            with pytest.raises(lce_client.LceError) as ei:
                s.allocate_server_memory(4096)
            assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION, ei.value
            assert "--data-port" in ei.value.details
        # requests that do not use the data plane still work on such a server
        c.zero_grad()
        assert not np.any(c.get_grad())
    with lce_client.Client(srv.target, timeout=30) as plain:
        assert plain.score(st, y)[0].shape == (rows,)


@pytest.mark.parametrize("bad", [0, -1, 17, 100, 2.5, "4", True, None])
def test_data_plane_sockets_out_of_range(bad):
    with pytest.raises(ValueError, match="data_plane_sockets"):
        lce_client.Client("127.0.0.1:1", data_plane=True, data_plane_sockets=bad)
    with pytest.raises(ValueError, match="data_plane_sockets"):  # checked whether or not the data plane is on
        lce_client.Client("127.0.0.1:1", data_plane_sockets=bad)


@pytest.mark.parametrize("good", [1, 16, np.int64(8)])
def test_data_plane_sockets_in_range(good):
    c = lce_client.Client("127.0.0.1:1", data_plane=True, data_plane_sockets=good)
    assert c.data_plane and c.data_plane_sockets == int(good)
    c.close()
    assert not lce_client.Client("127.0.0.1:1").data_plane


def test_target_host():
    assert dpm.target_host("127.0.0.1:50051") == "127.0.0.1"
    assert dpm.target_host("dns:///example.org:443") == "example.org"
    assert dpm.target_host("ipv4:10.0.0.2:7") == "10.0.0.2"
    assert dpm.target_host("[::1]:50051") == "::1"
    assert dpm.target_host("localhost:1") == "localhost"


# ----------------------------------------------------------------------------------- the protocol
def raw_connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = s.recv(n - len(out))
        assert b, f"connection closed after {len(out)} of {n} bytes"
        out += b
    return bytes(out)


def raw_transfer(s: socket.socket, op: int, key, region: int, offset: int, length: int,
                 payload: bytes = b""):
    """One transfer by hand, `key` the session's (id, secret); returns (code, message, bytes read)."""
    s.sendall(struct.pack("<4sI32s32sQqq", b"LCE2", op, key[0].encode(), key[1].encode(), region, offset, length)
              + payload)
    code, n = struct.unpack("<iI", recv_exactly(s, 8))
    msg = recv_exactly(s, n).decode() if n else ""
    data = recv_exactly(s, length) if op == 2 and code == 0 else b""
    return code, msg, data


def read_until_closed(s: socket.socket) -> bytes:
    out = bytearray()
    while True:
        b = s.recv(4096)
        if not b:
            return bytes(out)
        out += b


def test_transfers_are_checked_and_a_refusal_leaves_the_connection_working(dp_heads):
    head = dp_heads["fp32"]
    with head.client() as c:
        port = c.info().data_port
        assert port > 0
        a, other = c.shared_memory_session(), c.shared_memory_session()
        try:
            mine = a.allocate_server_memory(4096, "mine")
            theirs = other.allocate_server_memory(4096, "theirs")
            shm = a.create(4096)
            sid = a.session_id
            assert len(sid) == dpm.SESSION_ID_BYTES and len(a.secret) == dpm.SECRET_BYTES
            key = (sid, a.secret)

            data = bytes((i * 7 + 3) & 0xFF for i in range(1000))
            s = raw_connect(port)
            assert raw_transfer(s, 1, key, mine, 96, len(data), data)[:2] == (0, "")
            code, msg, back = raw_transfer(s, 2, key, mine, 96, len(data))
            assert code == 0 and back == data

            refusals = [
                ((1, key, mine, 3500, len(data), data), 3, "does not fit"),        # out of bounds
                ((2, key, mine, -1, len(data)), 3, "does not fit"),
                ((1, key, theirs, 0, len(data), data), 7, "another session"),      # PERMISSION_DENIED
                ((2, key, theirs, 0, len(data)), 7, "another session"),
                ((1, key, shm.id, 0, len(data), data), 3, "not server memory"),
                ((1, key, 999999, 0, len(data), data), 5, "not registered"),       # NOT_FOUND
                ((9, key, mine, 0, 0), 3, "unknown op"),
            ]
            for args, want, says in refusals:
                code, msg, _ = raw_transfer(s, *args)
                assert code == want and says in msg, (args[:5], code, msg)
            # after every refusal the connection still carries transfers
            code, _, back = raw_transfer(s, 2, key, mine, 96, len(data))
            assert code == 0 and back == data
            s.close()

            # issue 22: the id alone is no capability. A first transfer with another session's secret,
            # or none, is refused PERMISSION_DENIED and the connection closed; the server goes on.
            for bad in ((sid, other.secret), (sid, "0" * 32), (other.session_id, a.secret)):
                s = raw_connect(port)
                code, msg, _ = raw_transfer(s, 2, bad, mine, 0, 16)
                assert code == 7 and "secret" in msg, (code, msg)
                assert read_until_closed(s) == b""
                s.close()

            # the client's connection class: the same refusals as LceError, the connection usable after
            conn = dpm.DataPlaneConnection("127.0.0.1", port, a.secret)
            buf = bytearray(len(data))
            conn.write(sid, mine, 2000, memoryview(data))
            conn.read(sid, mine, 2000, memoryview(buf))
            assert bytes(buf) == data
            for fn, want in ((lambda: conn.write(sid, theirs, 0, memoryview(data)), grpc.StatusCode.PERMISSION_DENIED),
                             (lambda: conn.read(sid, mine, 3500, memoryview(buf)), grpc.StatusCode.INVALID_ARGUMENT),
                             (lambda: conn.write(sid, mine, 3500, memoryview(data)), grpc.StatusCode.INVALID_ARGUMENT),
                             (lambda: conn.read(sid, 999999, 0, memoryview(buf)), grpc.StatusCode.NOT_FOUND)):
                with pytest.raises(lce_client.LceError) as ei:
                    fn()
                assert ei.value.code == want, ei.value
                assert conn.usable
            with pytest.raises(lce_client.LceError) as ei:  # refused here: the server reads exactly 32 bytes
                conn.write(sid[:31], mine, 0, memoryview(data))
            assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and conn.usable
            conn.read(sid, mine, 96, memoryview(buf))
            assert bytes(buf) == data

            # a header without the magic: answered INVALID_ARGUMENT, then the connection is closed
            s = raw_connect(port)
            s.sendall(b"x" * dpm.HEADER.size)
            code = struct.unpack("<i", recv_exactly(s, 4))[0]
            assert code == 3
            rest = read_until_closed(s)
            assert len(rest) > 4 and b"magic" in rest
            s.close()

            # a write longer than any region may be: answered at once, its payload not waited for
            s = raw_connect(port)
            s.sendall(dpm.HEADER.pack(dpm.MAGIC, 1, sid.encode(), a.secret.encode(), mine, 0, 1 << 50))
            code = struct.unpack("<i", recv_exactly(s, 4))[0]
            assert code == 3
            read_until_closed(s)
            s.close()

            # the session's end frees its server memory and forgets its secret: transfers naming it are
            # PERMISSION_DENIED from then on
            a.close()
            code = None
            deadline = time.time() + 5
            while time.time() < deadline:
                with pytest.raises(lce_client.LceError) as ei:
                    conn.write(sid, mine, 0, memoryview(data))
                code = ei.value.code
                if code == grpc.StatusCode.PERMISSION_DENIED:
                    break
                time.sleep(0.02)
            assert code == grpc.StatusCode.PERMISSION_DENIED
            conn.close()
            assert not conn.usable
        finally:
            a.close()
            other.close()
        # the server still serves
        st, _ = head.hidden(8, seed=71)
        assert c.score(st, targets_for_rows(8, seed=72))[0].shape == (8,)


def test_a_failure_mid_request_is_the_calls_error_and_the_next_call_starts_afresh(dp_heads):
    head = dp_heads["bf16"]
    rows = 400
    st, _ = head.hidden(rows, seed=81)
    y = targets_for_rows(rows, seed=82)
    plain, dp = clients(head, 64, sockets=1)
    with plain, dp:
        want = plain.forward_backward(st, y)
        np.testing.assert_array_equal(dp.forward_backward(st, y).d_hidden, want.d_hidden)
        plane = dp._data_plane
        session = plane.session.session_id

        # the server refuses the request (a target out of the vocabulary): its error, as on the bytes path
        bad = y.copy()
        bad[100] = VOCAB + 5
        with pytest.raises(lce_client.LceError) as ei:
            dp.forward_backward(st, bad)
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert plane.session is None  # dropped, as the C++ client does after a failure
        np.testing.assert_array_equal(dp.forward_backward(st, y).d_hidden, want.d_hidden)
        assert plane.session.session_id != session

        # the upload socket breaks: the call fails UNAVAILABLE naming the data plane (not CANCELLED)
        plane.lanes[0].up[0]._sock.shutdown(socket.SHUT_WR)
        with pytest.raises(lce_client.LceError) as ei:
            dp.forward_backward(st, y)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE, ei.value
        assert "data plane" in ei.value.details
        # the download socket breaks
        dp.score(st, y)  # (a new session and sockets)
        plane.lanes[0].down[0]._sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(lce_client.LceError) as ei:
            dp.backward(st, y, np.ones(rows, np.float32))
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE, ei.value
        # and the next call works again
        np.testing.assert_array_equal(dp.forward_backward(st, y).d_hidden, want.d_hidden)
    assert wait_for(lambda: server_regions(head), 0) == 0


def test_progress_and_empty_batches_over_the_data_plane(dp_heads):
    head = dp_heads["fp16"]
    rows = 130
    st, _ = head.hidden(rows, seed=91)
    y = targets_for_rows(rows, seed=92)
    seen = []
    with head.client(data_plane=True, chunk_bytes=32 * ROW_BYTES["fp16"]) as c:
        r = c.forward_backward(st, y, progress=lambda done, total: seen.append((done, total)))
        assert seen[-1] == (rows, rows) and len(seen) == 5
        assert r.rows == rows
        e = c.forward_backward(st[:0], y[:0])
        assert e.rows == 0 and e.d_hidden.shape == (0, HIDDEN)


def test_messages_carry_no_hidden_bytes(dp_heads):
    """Over the data plane the chunks name slices of the session's server memory (and carry the
    session's id and secret in lce-session and lce-session-secret metadata), as co-located requests name
    shared memory."""
    from lce_client._proto import lce_pb2_grpc as pb_grpc
    from helpers import Recorder

    head = dp_heads["fp32"]
    rows, chunk_rows = 100, 30
    st, _ = head.hidden(rows, seed=101)
    y = targets_for_rows(rows, seed=102)
    rec = Recorder()
    with head.client(data_plane=True, chunk_bytes=chunk_rows * ROW_BYTES["fp32"]) as c:
        c._stub = pb_grpc.LceServiceStub(grpc.intercept_channel(c._channel, rec))
        c.forward_backward(st, y)
        plane = c._data_plane
        calls = [msgs for method, msgs in rec.calls if method.endswith("/ForwardBackward")]
        assert len(calls) == 1
        chunks = [m.chunk for m in calls[0] if m.WhichOneof("kind") == "chunk"]
        rb = ROW_BYTES["fp32"]
        assert [ch.hidden_region.offset for ch in chunks] == [r0 * rb for r0 in range(0, rows, chunk_rows)]
        for ch in chunks:
            assert len(ch.hidden) == 0
            assert ch.hidden_region.region_id == plane.hidden_region
            assert ch.d_hidden_region.region_id == plane.d_hidden_region
            assert ch.d_hidden_region.offset == ch.hidden_region.offset
            assert ch.hidden_region.byte_size == ch.d_hidden_region.byte_size == len(ch.targets) * ROW_BYTES["fp32"]


def test_calls_from_several_threads_take_turns(dp_heads):
    """One data-plane client shared by threads: the calls share its regions and sockets one at a time,
    and each gets its own answer."""
    import threading

    head = dp_heads["bf16"]
    batches = [(head.hidden(150 + 40 * i, seed=110 + i)[0], targets_for_rows(150 + 40 * i, seed=120 + i))
               for i in range(4)]
    plain, dp = clients(head, 32, streams=2, min_rows=64)
    with plain, dp:
        want = [plain.forward_backward(st, y) for st, y in batches]
        got, errors = [None] * len(batches), []

        def run(i):
            try:
                for _ in range(3):
                    got[i] = dp.forward_backward(*batches[i])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for g, w in zip(got, want):
            np.testing.assert_array_equal(as_bits(g.d_hidden), as_bits(w.d_hidden))
            np.testing.assert_array_equal(g.per_token_loss, w.per_token_loss)


# ------------------------------------------------------------------------------------ the uploaders
UPLOADER = re.compile(r"lce-dp\d+-up\d+$")


def uploader_threads():
    return [t for t in threading.enumerate() if UPLOADER.match(t.name)]


def lce_threads():
    return [t for t in threading.enumerate() if t.name.startswith("lce-")]


class UploadLog:
    """Wraps DataPlaneConnection.write: records each completed share (its thread, connection, offset,
    length) in order beside the messages the request streams send (Recorder tamper), optionally slows
    the writes of some connections or makes one fail."""

    def __init__(self, monkeypatch, slow=(), delay=0.0, fail=None):
        self.lock = threading.Lock()
        self.events = []    # ("share", conn id, offset, length, thread) / ("msg", offset, length)
        self.threads = []   # every thread that wrote (strong references: distinct objects are distinct threads)
        self.slow, self.delay, self.fail = set(slow), delay, fail
        orig = dpm.DataPlaneConnection.write
        log = self

        def write(conn, sid, region, offset, data):
            t = threading.current_thread()
            with log.lock:
                if t not in log.threads:
                    log.threads.append(t)
            if id(conn) in log.slow:
                time.sleep(log.delay)
            if log.fail is not None:
                log.fail(conn, offset)
            orig(conn, sid, region, offset, data)
            with log.lock:
                log.events.append(("share", id(conn), offset, memoryview(data).nbytes, t))

        monkeypatch.setattr(dpm.DataPlaneConnection, "write", write)

    def message(self, i, m):
        if m.WhichOneof("kind") == "chunk":
            with self.lock:
                self.events.append(("msg", m.chunk.hidden_region.offset, m.chunk.hidden_region.byte_size))
        return m


def recorded(client, streams, log):
    """Puts `log` on the request streams of the client's calls (each part's channel when split)."""
    from helpers import Recorder, intercept_parts

    if streams > 1:
        intercept_parts(client, streams, lambda i: Recorder(tamper=log.message))
    else:
        from lce_client._proto import lce_pb2_grpc as pb_grpc

        client._stub = pb_grpc.LceServiceStub(grpc.intercept_channel(client._channel, Recorder(tamper=log.message)))


def test_one_uploader_per_socket_no_barrier_per_chunk(dp_heads, monkeypatch):
    """Each stream uploads with one thread per socket (no thread per chunk), each moving its share of
    every chunk in turn: a slow socket does not hold the others back, and a chunk's message goes only
    once all of its shares are in."""
    head = dp_heads["fp32"]
    rows, chunk_rows, streams, sockets = 2400, 400, 2, 4  # 3 chunks of 75 KiB per stream, 4 shares each
    rb = ROW_BYTES["fp32"]
    st, _ = head.hidden(rows, seed=131)
    y = targets_for_rows(rows, seed=132)
    plain, dp = clients(head, chunk_rows, streams, sockets)
    with plain, dp:
        want = plain.forward_backward(st, y)
        np.testing.assert_array_equal(dp.forward_backward(st, y).d_hidden, want.d_hidden)  # lanes made
        lanes = dp._data_plane.lanes
        assert len(lanes) == streams
        slow = {id(lane.up[0]) for lane in lanes}  # the first socket of every stream lags
        log = UploadLog(monkeypatch, slow=slow, delay=0.15)
        recorded(dp, streams, log)
        got = dp.forward_backward(st, y)
        np.testing.assert_array_equal(as_bits(got.d_hidden), as_bits(want.d_hidden))
        np.testing.assert_array_equal(got.per_token_loss, want.per_token_loss)
        # the lanes' upload threads, one per socket, kept across calls
        assert len(uploader_threads()) == streams * sockets

        shares = [e for e in log.events if e[0] == "share"]
        msgs = [(i, e) for i, e in enumerate(log.events) if e[0] == "msg"]
        assert sum(e[3] for e in shares) == st.nbytes
        # one thread per socket of each stream (the lanes' kept ones), each on its own socket, none per chunk
        assert len(log.threads) == streams * sockets
        assert set(log.threads) <= set(uploader_threads())
        assert all(UPLOADER.match(t.name) for t in log.threads)
        by_thread = {}
        for e in shares:
            by_thread.setdefault(e[4], set()).add(e[1])
        assert all(len(conns) == 1 for conns in by_thread.values())
        assert len({c for conns in by_thread.values() for c in conns}) == streams * sockets
        # socket i's share of each chunk is SocketShare's (whole pages)
        for e in shares:
            chunk = e[2] // (chunk_rows * rb)
            lo, n = dpm.socket_share(chunk_rows * rb, sockets, [id(u) for u in lanes[chunk // 3].up].index(e[1]))
            assert (e[2] - chunk * chunk_rows * rb, e[3]) == (lo, n)
        # a chunk's message comes after every share of it
        assert len(msgs) == rows // chunk_rows
        for i, (_, off, size) in msgs:
            done = sum(e[3] for e in log.events[:i] if e[0] == "share" and off <= e[2] < off + size)
            assert done == size, (off, size, done)
        # no barrier: on each stream the fast sockets finish their shares of every chunk before the
        # slow one finishes its share of the first
        for lane in lanes:
            fast = {id(u) for u in lane.up[1:]}
            last_fast = max(i for i, e in enumerate(log.events) if e[0] == "share" and e[1] in fast)
            first_slow = min(i for i, e in enumerate(log.events) if e[0] == "share" and e[1] == id(lane.up[0]))
            assert last_fast < first_slow, log.events


@pytest.mark.parametrize("streams,sockets", [(1, 4), (2, 3)])
def test_an_uploader_failing_mid_request_is_the_calls_error(dp_heads, monkeypatch, streams, sockets):
    """One socket's write fails on the request's second chunk while the others upload: the call raises
    that error (not CANCELLED), every uploader is stopped and joined, and the next call works."""
    head = dp_heads["bf16"]
    rows, chunk_rows = 3000, 700  # 67 KiB chunks: split over the sockets
    st, _ = head.hidden(rows, seed=141)
    y = targets_for_rows(rows, seed=142)
    plain, dp = clients(head, chunk_rows, streams, sockets)
    with plain, dp:
        want = plain.forward_backward(st, y)
        np.testing.assert_array_equal(dp.forward_backward(st, y).d_hidden, want.d_hidden)
        plane = dp._data_plane
        victim = plane.lanes[-1].up[sockets - 1]
        writes = [0]

        def fail(conn, offset):
            if conn is victim:
                writes[0] += 1
                if writes[0] == 2:
                    raise lce_client.LceError(grpc.StatusCode.DATA_LOSS, "injected upload failure", "DataPlane")

        UploadLog(monkeypatch, fail=fail)
        for call in (lambda: dp.forward_backward(st, y), lambda: dp.score(st, y)):
            writes[0] = 0
            with pytest.raises(lce_client.LceError) as ei:
                call()
            assert ei.value.code == grpc.StatusCode.DATA_LOSS, ei.value
            assert "injected upload failure" in ei.value.details
            assert not uploader_threads()
            assert plane.session is None  # dropped, to start afresh
            victim = plane.lanes[-1].up[sockets - 1] if plane.lanes else None
            # the next call works (new session and sockets; `victim` is the new lane's, if any yet)
            np.testing.assert_array_equal(dp.forward_backward(st, y).d_hidden, want.d_hidden)
            victim = plane.lanes[-1].up[sockets - 1]
        # a socket that breaks mid-request: UNAVAILABLE naming the data plane
        monkeypatch.undo()
        victim = plane.lanes[0].up[1]
        writes[0] = 0

        def breaks(conn, offset):
            if conn is victim:
                writes[0] += 1
                if writes[0] == 2:
                    conn._sock.shutdown(socket.SHUT_RDWR)

        UploadLog(monkeypatch, fail=breaks)
        with pytest.raises(lce_client.LceError) as ei:
            dp.backward(st, y, np.ones(rows, np.float32))
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE and "data plane" in ei.value.details, ei.value
        assert not uploader_threads()
        np.testing.assert_array_equal(dp.forward_backward(st, y).d_hidden, want.d_hidden)
    assert not lce_threads()
    assert wait_for(lambda: server_regions(head), 0) == 0


def test_cancelled_and_closed_mid_upload_leave_no_threads(dp_heads, monkeypatch):
    """A call that stops while its uploaders are busy (the progress callback raises; the client is closed
    from another thread) joins them; close() leaves no thread of the client behind."""
    head = dp_heads["fp16"]
    rows, chunk_rows, streams, sockets = 2800, 700, 2, 2
    st, _ = head.hidden(rows, seed=151)
    y = targets_for_rows(rows, seed=152)
    plain, dp = clients(head, chunk_rows, streams, sockets)
    with plain:
        want = plain.forward_backward(st, y)
        np.testing.assert_array_equal(dp.forward_backward(st, y).d_hidden, want.d_hidden)
        slow = {id(lane.up[0]) for lane in dp._data_plane.lanes}
        UploadLog(monkeypatch, slow=slow, delay=0.1)

        class Stop(Exception):
            pass

        def progress(done, total):
            raise Stop()

        with pytest.raises(Stop):
            dp.forward_backward(st, y, progress=progress)
        assert not uploader_threads()
        np.testing.assert_array_equal(dp.forward_backward(st, y).d_hidden, want.d_hidden)

        # closed from another thread while a call uploads
        errors, started = [], threading.Event()

        def run():
            try:
                dp.forward_backward(st, y, progress=lambda d, t: started.set())
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)
            started.set()

        t = threading.Thread(target=run)
        t.start()
        assert started.wait(30)
        dp.close()
        t.join(30)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], (lce_client.LceError, ValueError)), errors
        assert not uploader_threads()
        assert not lce_threads(), lce_threads()
    assert wait_for(lambda: server_regions(head), 0) == 0


# --------------------------------------------------------------------------------- TLS (issue 22)
def test_tls_data_plane_carries_the_same_bytes_as_plain(server_factory, tls_files):
    """lce_server --data-plane-tls: the client wraps its data-plane sockets in TLS (the server's
    certificate checked against root_certificates) and gets the plain data plane's answers; a client
    that does not trust the certificate gets UNAVAILABLE naming the handshake."""
    d = tls_files
    ca = (d / "ca.pem").read_bytes()
    head = [f"--seed-head=40x{HIDDEN}", "--head-dtype=fp32", "--seed=9", "--data-port=0"]
    plain = server_factory(head, name="dp_plain")
    tls = server_factory(head + [f"--tls-cert={d / 'server.pem'}", f"--tls-key={d / 'server.key'}",
                                 "--data-plane-tls=true"], name="dp_tls")
    h = np.random.default_rng(5).standard_normal((300, HIDDEN)).astype(np.float32)
    y = np.random.default_rng(6).integers(0, 40, 300)
    kw = dict(timeout=60, chunk_bytes=64 * HIDDEN * 4, data_plane=True, data_plane_sockets=2)
    with lce_client.Client(plain.target, **kw) as p, lce_client.Client(tls.target, root_certificates=ca, **kw) as t:
        assert t.info().data_plane_tls and not p.info().data_plane_tls
        want, got = p.forward_backward(h, y), t.forward_backward(h, y)
        np.testing.assert_array_equal(got.d_hidden, want.d_hidden)
        np.testing.assert_array_equal(got.loss, want.loss)
        assert t._replicas[0].data_plane.tls is not None  # it did go over TLS

        # one connection's round trip: the bytes read back are those written
        with t.shared_memory_session() as s:
            rid = s.allocate_server_memory(1 << 20)
            conn = dpm.DataPlaneConnection("127.0.0.1", t.info().data_port, s.secret, dpm.tls_context(ca))
            data = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8)
            back = np.zeros_like(data)
            conn.write(s.session_id, rid, 0, memoryview(data))
            conn.read(s.session_id, rid, 0, memoryview(back))
            np.testing.assert_array_equal(back, data)
            conn.close()
            # a client that trusts another CA: the handshake fails, clearly
            with pytest.raises(lce_client.LceError) as ei:
                dpm.DataPlaneConnection("127.0.0.1", t.info().data_port, s.secret, dpm.tls_context(None))
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE and "TLS handshake failed" in ei.value.details
        assert t.score(h[:8], y[:8])[0].shape == (8,)  # still serving
