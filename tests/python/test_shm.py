"""Co-located path over POSIX shared memory (OpenSession): registration, use (same answers as the bytes
path, d_hidden written in place), bounds violations, another session's region, unknown regions, and
release of a session's mappings when its stream ends or its client dies; the server keeps serving."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import types

import grpc
import numpy as np
import pytest

import lce_client
from lce_client._proto import lce_pb2 as pb
from conftest import HIDDEN, VOCAB

ROW_BYTES = {"fp32": HIDDEN * 4, "bf16": HIDDEN * 2, "fp16": HIDDEN * 2}
WIRE = {"fp32": pb.DTYPE_FLOAT32, "bf16": pb.DTYPE_BFLOAT16, "fp16": pb.DTYPE_FLOAT16}


def targets_for(rows, seed=0):
    y = np.random.default_rng(seed).integers(0, VOCAB, rows).astype(np.int64)
    y[1] = -100
    return y


def in_region(session, arr, extra=0):
    """A region holding a copy of `arr` after `extra` bytes; returns (region, the view)."""
    region = session.create(arr.nbytes + extra)
    view = region.ndarray(arr.shape, arr.dtype, offset=extra)
    view[...] = arr
    return region, view


def raw_score(client, session, dtype, rows, hidden_slice, d_slice=None, rpc="Score"):
    """A request built by hand (to send slices the client library would not). `session`: an open
    session (its id and secret go in the metadata), an id alone (no secret), or "" (neither)."""
    hdr = pb.RequestHeader(hidden_size=HIDDEN, dtype=WIRE[dtype])
    if rpc == "ForwardBackward":
        hdr.reduction = pb.REDUCTION_SUM
    chunk = pb.RowChunk(targets=[0] * rows, hidden_region=hidden_slice)
    if d_slice is not None:
        chunk.d_hidden_region.CopyFrom(d_slice)
    session_id, secret = (session.session_id, session.secret) if hasattr(session, "secret") else (session, "")
    md = (("lce-session", session_id), ("lce-session-secret", secret)) if session_id else None
    call = getattr(client._stub, rpc)(iter([pb.StreamRequest(header=hdr), pb.StreamRequest(chunk=chunk)]),
                                      metadata=md, timeout=30)
    return list(call)


def expect_error(fn, code, *needles):
    with pytest.raises((lce_client.LceError, grpc.RpcError)) as ei:
        fn()
    e = ei.value
    got = e.code if isinstance(e, lce_client.LceError) else e.code()
    details = e.details if isinstance(e, lce_client.LceError) else e.details()
    assert got == code, f"{got}: {details}"
    for n in needles:
        assert n in details, details
    return details


def maps_of(pid):
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def wait_until(pred, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_shm_answers_equal_bytes_path(heads, dtype):
    head = heads[dtype]
    rows = 37
    st, _ = head.hidden(rows, seed=7)
    y = targets_for(rows)
    gl = np.random.default_rng(3).standard_normal(rows).astype(np.float32)
    ge = np.random.default_rng(4).standard_normal(rows).astype(np.float32)
    # several chunks, so slices at offsets other than the region's start are exercised
    with head.client(chunk_bytes=10 * ROW_BYTES[dtype]) as c, c.shared_memory_session() as s:
        assert len(s.session_id) == 32 and int(s.session_id, 16) >= 0
        region, h = in_region(s, st, extra=ROW_BYTES[dtype] * 3 + 6)  # unaligned start inside the region
        out = s.create(st.nbytes + 64)

        lp0, ent0 = c.score(st, y, temperature=0.8)
        lp1, ent1 = c.score(h, y, temperature=0.8, hidden_region=region)
        np.testing.assert_array_equal(lp1, lp0)
        np.testing.assert_array_equal(ent1, ent0)

        r0 = c.forward_backward(st, y, return_logprobs=True)
        r1 = c.forward_backward(h, y, return_logprobs=True, hidden_region=region, d_hidden_region=out,
                                d_hidden_offset=64)
        assert r1.loss == r0.loss and r1.valid_tokens == r0.valid_tokens
        np.testing.assert_array_equal(r1.per_token_loss, r0.per_token_loss)
        np.testing.assert_array_equal(r1.logprobs, r0.logprobs)
        np.testing.assert_array_equal(r1.d_hidden, r0.d_hidden)
        # written in place: the region holds d_hidden, and the result is a view of it
        # bit patterns: with ml_dtypes installed d_hidden is typed bfloat16, the raw view here is not
        np.testing.assert_array_equal(out.ndarray(st.shape, st.dtype, offset=64).view(np.uint16),
                                      np.asarray(r0.d_hidden).view(np.uint16))
        assert np.shares_memory(r1.d_hidden, out.array)

        d0 = c.backward(st, y, gl, ge)
        d1 = c.backward(h, y, gl, ge, hidden_region=region, d_hidden_region=out, d_hidden_offset=64)
        np.testing.assert_array_equal(d1, d0)

        # hidden from the wire, d_hidden into a region (and the reverse) also work
        d2 = c.backward(st, y, gl, ge, d_hidden_region=out)
        np.testing.assert_array_equal(d2, d0)
        d3 = c.backward(h, y, gl, ge, hidden_region=region)
        np.testing.assert_array_equal(d3, d0)

        adv = np.random.default_rng(5).standard_normal(rows).astype(np.float32)
        p0 = c.policy_loss(st, y, r0.logprobs, adv)
        p1 = c.policy_loss(h, y, r0.logprobs, adv, hidden_region=region, d_hidden_region=out)
        assert p1.loss == p0.loss
        np.testing.assert_array_equal(p1.d_hidden, p0.d_hidden)


def test_shm_bounds_and_registration_errors(heads):
    head = heads["fp32"]
    rows, rb = 4, ROW_BYTES["fp32"]
    st, _ = head.hidden(rows, seed=8)
    y = targets_for(rows)
    with head.client() as c, c.shared_memory_session() as s:
        region, h = in_region(s, st)
        size = st.nbytes
        sid = s  # its id and secret
        # a slice past the region's end, a negative offset, a slice of the wrong size
        msg = expect_error(lambda: raw_score(c, sid, "fp32", rows, pb.RegionSlice(
            region_id=region.id, offset=rb, byte_size=rows * rb)), grpc.StatusCode.INVALID_ARGUMENT,
            f"offset {rb}", f"{rows * rb} bytes", f"has {size} bytes")
        assert "hidden_region" in msg
        expect_error(lambda: raw_score(c, sid, "fp32", rows, pb.RegionSlice(
            region_id=region.id, offset=-8, byte_size=rows * rb)), grpc.StatusCode.INVALID_ARGUMENT, "offset -8")
        expect_error(lambda: raw_score(c, sid, "fp32", rows, pb.RegionSlice(
            region_id=region.id, offset=0, byte_size=rows * rb - 4)), grpc.StatusCode.INVALID_ARGUMENT,
            f"{rows * rb - 4} bytes")
        # d_hidden past the end of its region
        small = s.create(rows * rb - 1)
        expect_error(lambda: raw_score(c, sid, "fp32", rows, pb.RegionSlice(region_id=region.id, offset=0,
                                                                             byte_size=rows * rb),
                                       pb.RegionSlice(region_id=small.id, offset=0, byte_size=rows * rb),
                                       rpc="ForwardBackward"),
                     grpc.StatusCode.INVALID_ARGUMENT, "d_hidden_region", f"has {rows * rb - 1} bytes")
        # Score has no d_hidden to place
        expect_error(lambda: raw_score(c, sid, "fp32", rows, pb.RegionSlice(region_id=region.id, offset=0,
                                                                             byte_size=rows * rb),
                                       pb.RegionSlice(region_id=region.id, offset=0, byte_size=rows * rb)),
                     grpc.StatusCode.INVALID_ARGUMENT, "Score")
        # d_hidden over the hidden states it is computed from
        expect_error(lambda: raw_score(c, sid, "fp32", rows, pb.RegionSlice(region_id=region.id, offset=0,
                                                                             byte_size=rows * rb),
                                       pb.RegionSlice(region_id=region.id, offset=0, byte_size=rows * rb),
                                       rpc="ForwardBackward"),
                     grpc.StatusCode.INVALID_ARGUMENT, "overlaps")
        # client side: an array outside the region
        with pytest.raises(ValueError):
            c.score(st, y, hidden_region=region)
        # registrations: too large for the object, by name (off by default); the session survives
        expect_error(lambda: s.register_fd(region.fd, size + 1), grpc.StatusCode.INVALID_ARGUMENT,
                     f"exceeds the object's size of {size}")
        expect_error(lambda: s.register_fd(region.fd, 16, offset=size), grpc.StatusCode.INVALID_ARGUMENT)
        expect_error(lambda: s.register("/lce-no-such-object-xyz", 16), grpc.StatusCode.PERMISSION_DENIED,
                     "--allow-shm-by-name")
        expect_error(lambda: s.unregister(987654321), grpc.StatusCode.NOT_FOUND)
        # a second registration of part of the same object, at an unaligned offset, works
        rid = s.register_fd(region.fd, rb, offset=rb * (rows - 1), name="last-row")
        lp_last = raw_score(c, sid, "fp32", 1, pb.RegionSlice(region_id=rid, offset=0, byte_size=rb))
        lp_ref, _ = c.score(st[-1:], np.zeros(1, np.int64))
        assert lp_last[0].chunk.logprobs[0] == lp_ref[0]
        # still serving, over the session and without it
        lp, _ = c.score(h, y, hidden_region=region)
        assert lp.shape == (rows,)


def test_shm_other_session_and_unknown_region(heads):
    head = heads["fp32"]
    rows, rb = 3, ROW_BYTES["fp32"]
    st, _ = head.hidden(rows, seed=9)
    y = targets_for(rows)
    with head.client() as c, c.shared_memory_session() as a, c.shared_memory_session() as b:
        assert a.session_id != b.session_id
        region, h = in_region(a, st)
        # B's session (id and secret) in the metadata, A's region: refused
        stolen = dataclasses.replace(region, session_id=b.session_id, session_secret=b.secret)
        expect_error(lambda: c.score(h, y, hidden_region=stolen), grpc.StatusCode.PERMISSION_DENIED,
                     "another session")
        expect_error(lambda: c.forward_backward(st, y, d_hidden_region=stolen), grpc.StatusCode.PERMISSION_DENIED)
        # no session in the metadata at all, and a made-up session id
        sl = pb.RegionSlice(region_id=region.id, offset=0, byte_size=rows * rb)
        expect_error(lambda: raw_score(c, "", "fp32", rows, sl), grpc.StatusCode.PERMISSION_DENIED, "lce-session")
        expect_error(lambda: raw_score(c, "0" * 32, "fp32", rows, sl), grpc.StatusCode.PERMISSION_DENIED)
        # issue 35, item 12: A's id alone (it travels in metadata), or with a wrong secret, opens nothing
        expect_error(lambda: raw_score(c, a.session_id, "fp32", rows, sl), grpc.StatusCode.PERMISSION_DENIED,
                     "lce-session-secret")
        forged = types.SimpleNamespace(session_id=a.session_id, secret=b.secret)
        expect_error(lambda: raw_score(c, forged, "fp32", rows, sl), grpc.StatusCode.PERMISSION_DENIED,
                     "do not name an open session")
        # B cannot unregister A's region either
        expect_error(lambda: b.unregister(region.id), grpc.StatusCode.PERMISSION_DENIED)
        # unknown region
        expect_error(lambda: raw_score(c, a, "fp32", rows,
                                       pb.RegionSlice(region_id=10 ** 12, offset=0, byte_size=rows * rb)),
                     grpc.StatusCode.NOT_FOUND, "not registered")
        # the owner still can
        lp, _ = c.score(h, y, hidden_region=region)
        lp0, _ = c.score(st, y)
        np.testing.assert_array_equal(lp, lp0)


@pytest.fixture
def own_server(server_factory):
    """A server of its own, so that its /proc/<pid>/maps shows only this test's regions."""
    return server_factory(["--seed-head=389x48", "--seed=3", "--head-dtype=fp32"], name="shm")


def test_shm_release_on_unregister_close_and_cancel(own_server):
    srv = own_server
    pid = srv.proc.pid
    rows = 5
    st = np.random.default_rng(1).standard_normal((rows, HIDDEN)).astype(np.float32)
    y = targets_for(rows)
    with lce_client.Client(srv.target, timeout=30) as c:
        lp0, _ = c.score(st, y)
        # unregister
        with c.shared_memory_session() as s:
            region, h = in_region(s, st)
            assert region.map_name in maps_of(pid)
            s.release(region)
            assert wait_until(lambda: region.map_name not in maps_of(pid))
            expect_error(lambda: c.score(h, y, hidden_region=region), grpc.StatusCode.NOT_FOUND)
        # close (half-close of the session stream)
        s = c.shared_memory_session()
        region, h = in_region(s, st)
        np.testing.assert_array_equal(c.score(h, y, hidden_region=region)[0], lp0)
        name = region.map_name
        assert name in maps_of(pid)
        s.close()
        assert wait_until(lambda: name not in maps_of(pid)), "the server kept the region mapped after close"
        assert region.fd == -1, "close() should close the client's memfds"
        # cancel (as a client going away): the region is released; naming it is PERMISSION_DENIED (the
        # session is gone, so its id and secret open nothing)
        s = c.shared_memory_session()
        region, h = in_region(s, st)
        np.testing.assert_array_equal(c.score(h, y, hidden_region=region)[0], lp0)
        assert region.map_name in maps_of(pid)
        s.cancel()
        assert wait_until(lambda: region.map_name not in maps_of(pid)), "not released after cancel"
        expect_error(lambda: c.score(h, y, hidden_region=region), grpc.StatusCode.PERMISSION_DENIED,
                     "do not name an open session")
        os.close(region.fd)
        # the server keeps serving
        np.testing.assert_array_equal(c.score(st, y)[0], lp0)
    assert srv.proc.poll() is None


CHILD = r"""
import sys, time
import numpy as np
import lce_client
c = lce_client.Client(sys.argv[1], timeout=30)
s = c.shared_memory_session()
r = s.create(5 * 48 * 4)
h = r.ndarray((5, 48), np.float32)
h[:] = 0.5
lp, _ = c.score(h, np.arange(5), hidden_region=r)
print(r.memfd_name, s.session_id, r.id, s.secret, flush=True)
time.sleep(600)
"""


def test_shm_release_when_client_process_dies(own_server):
    srv = own_server
    pid = srv.proc.pid
    child = subprocess.Popen([sys.executable, "-c", CHILD, srv.target], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        assert line, "the child client did not start"
        shm_name, region_id = f"/memfd:{line[0]} ", int(line[2])
        dead = types.SimpleNamespace(session_id=line[1], secret=line[3])
        assert shm_name in maps_of(pid)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert wait_until(lambda: shm_name not in maps_of(pid)), "the server kept a dead client's region mapped"
        with lce_client.Client(srv.target, timeout=30) as c:
            # its region is gone, even for a request that names the dead session with its secret
            expect_error(lambda: raw_score(c, dead, "fp32", 5,
                                           pb.RegionSlice(region_id=region_id, offset=0, byte_size=5 * 48 * 4)),
                         grpc.StatusCode.PERMISSION_DENIED, "do not name an open session")
            lp, _ = c.score(np.full((5, HIDDEN), 0.5, np.float32), np.arange(5))
            assert lp.shape == (5,)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert srv.proc.poll() is None


def test_shm_session_needs_the_scoring_token(server_factory, workdir):
    tok = workdir / "shm_token"
    tok.write_text("shm-token-0123456789\n")
    srv = server_factory([f"--seed-head=64x{HIDDEN}", "--head-dtype=fp32", f"--auth-token-file={tok}"],
                         name="shm_auth")
    with pytest.raises(lce_client.LceError) as ei:
        lce_client.Client(srv.target, timeout=30).shared_memory_session()
    assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED
    st = np.random.default_rng(2).standard_normal((3, HIDDEN)).astype(np.float32)
    y = np.array([1, 2, 3])
    with lce_client.Client(srv.target, timeout=30, token="shm-token-0123456789") as c, \
            c.shared_memory_session() as s:
        region, h = in_region(s, st)
        lp, _ = c.score(h, y, hidden_region=region)
        np.testing.assert_array_equal(lp, c.score(st, y)[0])


def test_shm_region_survives_until_a_request_using_it_ends(own_server):
    """Cancelling a session while requests use its region: they finish or fail cleanly (never a crash),
    and the mapping goes once they are done."""
    srv = own_server
    rows = 2000
    st = np.random.default_rng(6).standard_normal((rows, HIDDEN)).astype(np.float32)
    y = targets_for(rows)
    import threading

    with lce_client.Client(srv.target, timeout=60, chunk_bytes=HIDDEN * 4 * 50) as c:
        s = c.shared_memory_session()
        region, h = in_region(s, st)
        out = s.create(st.nbytes)
        results = []

        def run():
            try:
                results.append(c.forward_backward(h, y, hidden_region=region, d_hidden_region=out))
            except lce_client.LceError as e:
                results.append(e)

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        s.cancel()  # at once: some requests may be mid-way
        for t in threads:
            t.join()
        for r in results:
            # refused once the session is gone (its secret opens nothing) or its region unmapped
            assert not isinstance(r, lce_client.LceError) or r.code in (grpc.StatusCode.PERMISSION_DENIED,
                                                                        grpc.StatusCode.NOT_FOUND), r
        assert wait_until(lambda: region.map_name not in maps_of(srv.proc.pid))
        assert srv.proc.poll() is None
        np.testing.assert_array_equal(c.score(st[:4], y[:4])[0], c.score(st[:4], y[:4])[0])
        for r in (region, out):
            os.close(r.fd)


def test_shm_by_name_only_where_allowed_and_the_socket_checks_the_secret(server_factory):
    """Issue 22: memory goes to the server as a file descriptor (the clients' create() makes a memfd);
    the shm socket refuses a wrong secret and a descriptor that is not read-write shared memory; a
    client that cuts its memfd gets FAILED_PRECONDITION and the server keeps serving. Registration by
    name needs --allow-shm-by-name, and then checks the name."""
    args = [f"--seed-head=389x{HIDDEN}", "--head-dtype=fp32", "--seed=4"]
    srv = server_factory(args, name="shm_fd")
    named = server_factory(args + ["--allow-shm-by-name=true"], name="shm_named")
    rows = 40
    st = np.random.default_rng(11).standard_normal((rows, HIDDEN)).astype(np.float32)
    y = targets_for(rows)
    with lce_client.Client(srv.target, timeout=30) as c, c.shared_memory_session() as s, \
            c.shared_memory_session() as other:
        assert s.shm_socket and os.path.exists(s.shm_socket) and len(s.secret) == 32
        region, h = in_region(s, st)
        assert region.memfd_name and not os.path.exists("/dev/shm/" + region.memfd_name)
        lp0, _ = c.score(st, y)
        np.testing.assert_array_equal(c.score(h, y, hidden_region=region)[0], lp0)
        # another session's secret with this session's id: refused; the sessions go on
        real = s.secret
        s.secret = other.secret
        expect_error(lambda: s.register_fd(region.fd, 64), grpc.StatusCode.PERMISSION_DENIED, "secret")
        s.secret = real
        # another session cannot register the same memory, even holding its descriptor
        expect_error(lambda: other.register_fd(region.fd, 64), grpc.StatusCode.PERMISSION_DENIED, "another session")
        # not a regular file; not opened read-write
        r, w = os.pipe()
        expect_error(lambda: s.register_fd(w, 16), grpc.StatusCode.INVALID_ARGUMENT, "regular file")
        os.close(r)
        os.close(w)
        ro = os.open(f"/proc/self/fd/{region.fd}", os.O_RDONLY)
        expect_error(lambda: s.register_fd(ro, 16), grpc.StatusCode.INVALID_ARGUMENT, "read-write")
        os.close(ro)
        # by name: off here
        expect_error(lambda: s.register("/lce-anything", 16), grpc.StatusCode.PERMISSION_DENIED,
                     "--allow-shm-by-name")
        # the client cuts its memfd under the server's mapping: the SIGBUS guard turns it into an error
        cut, hc = in_region(s, st)
        os.ftruncate(cut.fd, 0)
        expect_error(lambda: c.score(hc, y, hidden_region=cut), grpc.StatusCode.FAILED_PRECONDITION, "shrunk")
        np.testing.assert_array_equal(c.score(h, y, hidden_region=region)[0], lp0)
    assert srv.proc.poll() is None
    with lce_client.Client(named.target, timeout=30) as c, c.shared_memory_session() as s:
        expect_error(lambda: s.register("/lce-no-such-object-xyz", 16), grpc.StatusCode.NOT_FOUND, "shm_open")
        expect_error(lambda: s.register("no-slash", 16), grpc.StatusCode.INVALID_ARGUMENT, "shm_name")
        path = f"/dev/shm/lce-named-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, st.nbytes)
            os.pwrite(fd, st.tobytes(), 0)
            rid = s.register(path[len("/dev/shm"):], st.nbytes)
            got = raw_score(c, s, "fp32", rows, pb.RegionSlice(region_id=rid, offset=0, byte_size=st.nbytes))
            want, _ = c.score(st, np.zeros(rows, np.int64))
            lp = np.array(got[0].chunk.logprobs, np.float32)
            np.testing.assert_array_equal(lp, want[:len(lp)])
        finally:
            os.close(fd)
            os.unlink(path)
