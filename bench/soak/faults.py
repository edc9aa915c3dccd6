"""The soak's fault lane: requests that must fail, each with the status it must fail with — cancelled
streams, expired deadlines, the server's own header and idle timeouts, messages over the size limit,
requests over the row limit, bytes that are no message, messages that break the protocol or the
header's rules, bad regions and sessions, garbage on the data plane and the metrics port. A fault
whose outcome may legitimately be success (a short deadline a fast server meets; a session closed
while its request runs) has that success's answer checked against the reference."""
from __future__ import annotations

import os
import socket
import threading
from typing import Callable, Dict, Tuple

import grpc
import numpy as np

import lce_client
from common import code_name
from lanes import Lane
from lce_client import _data_plane as D
from lce_client._proto import lce_pb2 as pb, lce_pb2_grpc as pb_grpc
from requests_ref import check, issue, make_request

_BIG = 1 << 30


class FaultLane(Lane):
    name = "faults"

    def __init__(self, ctx, seed):
        super().__init__(ctx, seed)
        self.channel = grpc.insecure_channel(ctx.target, options=[("grpc.max_send_message_length", _BIG),
                                                                  ("grpc.max_receive_message_length", _BIG)])
        self.stub = pb_grpc.LceServiceStub(self.channel)
        self.client = lce_client.Client(ctx.target, timeout=60, chunk_bytes=16 << 10)
        self.head = ctx.heads["default"]
        names = list(FAULTS)
        weights = np.array([FAULTS[n][2] for n in names], dtype=np.float64)
        self.names, self.p = names, weights / weights.sum()

    def step(self) -> None:
        name = str(self.rng.choice(self.names, p=self.p))
        expected, run, _ = FAULTS[name]
        try:
            outcome = run(self) or "OK"
        except (lce_client.LceError, grpc.RpcError) as e:
            outcome = code_name(e)
        self.ledger.fault(name, outcome, expected)

    def close(self) -> None:
        self.client.close()
        self.channel.close()

    # ----------------------------------------------------------------------------- helpers
    def header(self, **kw) -> pb.RequestHeader:
        d = dict(hidden_size=self.head.hidden, dtype=pb.DTYPE_FLOAT32)
        d.update(kw)
        return pb.RequestHeader(**d)

    def chunk(self, rows: int, **kw) -> pb.RowChunk:
        h = self.rng.standard_normal((rows, self.head.hidden)).astype(np.float32)
        d = dict(hidden=h.tobytes(), targets=self.rng.integers(0, self.head.vocab, rows).tolist())
        d.update(kw)
        return pb.RowChunk(**d)

    def send(self, rpc: str, header, chunks, *, timeout: float = 30, metadata=None) -> None:
        """Sends a request as a stream or, when it has one chunk, now and then as a Call; raises its error."""
        msgs = ([pb.StreamRequest(header=header)] if header is not None else []) + [pb.StreamRequest(chunk=c) for c in chunks]
        if header is not None and len(chunks) == 1 and self.rng.random() < 0.5:
            method = {"Score": pb.CALL_SCORE, "ForwardBackward": pb.CALL_FORWARD_BACKWARD,
                      "Backward": pb.CALL_BACKWARD, "PolicyLoss": pb.CALL_POLICY_LOSS}[rpc]
            self.stub.Call(pb.CallRequest(method=method, header=header, chunk=chunks[0]), timeout=timeout, metadata=metadata)
            return
        for _ in getattr(self.stub, rpc)(iter(msgs), timeout=timeout, metadata=metadata):
            pass

    def raw(self, rpc: str, payloads, timeout: float = 30) -> None:
        """Sends serialized bytes as they are (no protobuf check on the way)."""
        call = self.channel.stream_stream(f"/lce.v1.LceService/{rpc}", request_serializer=None, response_deserializer=None)
        for _ in call(iter(payloads), timeout=timeout):
            pass

    def stalled(self, msgs, *, cancel_after=None, timeout: float = 30, rpc: str = "ForwardBackward") -> None:
        """A stream that sends `msgs` and then nothing (until cancelled or timed out)."""
        gate = threading.Event()

        def gen():
            yield from msgs
            gate.wait(timeout + 5)

        call = getattr(self.stub, rpc)(gen(), timeout=timeout)
        if cancel_after is not None:
            threading.Timer(cancel_after, call.cancel).start()
        try:
            for _ in call:
                pass
        finally:
            gate.set()


# ------------------------------------------------------------------------ cancels and deadlines
def cancel_stream(f: FaultLane):
    msgs = [pb.StreamRequest(header=f.header(reduction=pb.REDUCTION_SUM))]
    msgs += [pb.StreamRequest(chunk=f.chunk(int(f.rng.integers(1, 100)))) for _ in range(int(f.rng.integers(0, 4)))]
    f.stalled(msgs, cancel_after=float(f.rng.uniform(0.0, 0.3)))


class _Abort(Exception):
    pass


def cancel_after_answers(f: FaultLane):
    """The client walks away from a many-chunk request once some answers came (lce_client cancels it)."""
    req = make_request(f.rng, f.head, str(f.rng.choice(["score", "forward_backward"])), rows=500)
    stop_at = int(f.rng.integers(1, 450))

    def progress(done, _total):
        if done >= stop_at:
            raise _Abort()

    try:
        res = issue(f.client, req, progress=progress)
    except _Abort:
        return "client_cancelled"
    return "OK" if check(f.ledger, "faults/cancel_after_answers", req, res) else "WRONG_ANSWER"


def deadline_stall(f: FaultLane):
    f.stalled([pb.StreamRequest(header=f.header(reduction=pb.REDUCTION_SUM)), pb.StreamRequest(chunk=f.chunk(10))],
              timeout=float(f.rng.uniform(0.05, 0.5)))


def deadline_short(f: FaultLane):
    """A deadline the request may or may not meet: the answer, if any, must be right."""
    req = make_request(f.rng, f.head, str(f.rng.choice(["score", "forward_backward", "backward"])), rows=500)
    with lce_client.Client(f.ctx.target, timeout=float(f.rng.uniform(0.001, 0.05)), chunk_bytes=16 << 10) as c:
        res = issue(c, req)
    return "OK" if check(f.ledger, "faults/deadline_short", req, res) else "WRONG_ANSWER"


def header_timeout(f: FaultLane):
    f.stalled([], timeout=30, rpc="Score")


def idle_timeout(f: FaultLane):
    f.stalled([pb.StreamRequest(header=f.header()), pb.StreamRequest(chunk=f.chunk(5))], timeout=30, rpc="Score")


# ------------------------------------------------------------------------ sizes and bytes
def oversized_message(f: FaultLane):
    rows = f.ctx.max_message_bytes // (4 * f.head.hidden) + 10
    f.send("Score", f.header(), [f.chunk(rows)])


def too_many_rows(f: FaultLane):
    per = f.ctx.max_rows // 3 + 1
    f.send("Score", f.header(), [f.chunk(per) for _ in range(4)])


def malformed_first(f: FaultLane):
    f.raw("Score", [bytes(f.rng.integers(0, 256, int(f.rng.integers(1, 64)), dtype=np.uint8).tobytes()) + b"\xff\xff\xff\xff\x0f"])


def malformed_call(f: FaultLane):
    call = f.channel.unary_unary("/lce.v1.LceService/Call", request_serializer=None, response_deserializer=None)
    call(b"\x0a\xff\xff\xff\xff\x0f" + bytes(int(f.rng.integers(0, 32))), timeout=30)


def garbage_after_header(f: FaultLane):
    f.raw("Score", [pb.StreamRequest(header=f.header()).SerializeToString(), b"\x12\xff\xff\xff\xff\x0f"])


def garbage_after_chunk(f: FaultLane):
    """A message that does not parse after a valid chunk: once answered OK with the rows before it."""
    f.raw("Score", [pb.StreamRequest(header=f.header()).SerializeToString(),
                    pb.StreamRequest(chunk=f.chunk(5)).SerializeToString(), b"\x12\xff\xff\xff\xff\x0f",
                    pb.StreamRequest(chunk=f.chunk(5)).SerializeToString()])


def empty_message(f: FaultLane):
    f.raw("Score", [pb.StreamRequest(header=f.header()).SerializeToString(), b""])


# ------------------------------------------------------------------------ the protocol and the header
def chunk_before_header(f: FaultLane):
    f.send("Score", None, [f.chunk(3)])


def repeated_header(f: FaultLane):
    for _ in f.stub.Score(iter([pb.StreamRequest(header=f.header()), pb.StreamRequest(header=f.header())]), timeout=30):
        pass


def wrong_hidden_size(f: FaultLane):
    f.send("Score", f.header(hidden_size=f.head.hidden + 1), [f.chunk(3)])


def wrong_dtype(f: FaultLane):
    f.send("Score", f.header(dtype=pb.DTYPE_BFLOAT16), [f.chunk(3)])


def bytes_mismatch(f: FaultLane):
    c = f.chunk(4)
    c.hidden = c.hidden[:-4]
    f.send("ForwardBackward", f.header(reduction=pb.REDUCTION_SUM), [c])


def nan_hidden(f: FaultLane):
    h = f.rng.standard_normal((6, f.head.hidden)).astype(np.float32)
    h[int(f.rng.integers(0, 6)), int(f.rng.integers(0, f.head.hidden))] = float(f.rng.choice([np.nan, np.inf]))
    f.send("Score", f.header(), [f.chunk(6, hidden=h.tobytes())])


def bad_target(f: FaultLane):
    c = f.chunk(8)
    c.targets[int(f.rng.integers(0, 8))] = int(f.rng.choice([f.head.vocab, -7, 1 << 30]))
    f.send("Score", f.header(), [f.chunk(5), c] if f.rng.random() < 0.5 else [c])


def bad_temperature(f: FaultLane):
    f.send("Score", f.header(temperature=float(f.rng.choice([0.0, -1.0, np.nan]))), [f.chunk(3)])


def mean_count_mismatch(f: FaultLane):
    f.send("ForwardBackward", f.header(reduction=pb.REDUCTION_MEAN, num_valid_tokens=3), [f.chunk(5)])


def bad_call_method(f: FaultLane):
    f.stub.Call(pb.CallRequest(header=f.header(), chunk=f.chunk(2)), timeout=30)


def bad_sequence_id(f: FaultLane):
    opts = pb.PolicyLossOptions(clip_low=0.2, clip_high=0.2, sequence_valid_tokens=[2, 2])
    c = f.chunk(4, old_logprobs=[-1.0] * 4, advantages=[1.0] * 4, sequence_ids=[0, 0, 1, 2])
    f.send("PolicyLoss", f.header(policy=opts), [c])


def unknown_head(f: FaultLane):
    f.send("Score", f.header(head="no-such-head"), [f.chunk(3)])


def stale_version(f: FaultLane):
    f.send("Score", f.header(head_version=f.head.latest()[0] + 1), [f.chunk(3)])


# ------------------------------------------------------------------------ regions and sessions
def region_without_session(f: FaultLane):
    c = pb.RowChunk(targets=[1, 2], hidden_region=pb.RegionSlice(region_id=int(f.rng.integers(1, 1 << 40)), offset=0,
                                                                    byte_size=2 * 4 * f.head.hidden))
    f.send("Score", f.header(), [c])


def _region_chunk(region, rows, hidden, offset=0):
    return pb.RowChunk(targets=[1] * rows, hidden_region=pb.RegionSlice(region_id=region.id, offset=offset,
                                                                       byte_size=rows * hidden * 4))


def region_of_another_session(f: FaultLane):
    with f.client.shared_memory_session() as a, f.client.shared_memory_session() as b:
        r = a.create(4096)
        f.send("Score", f.header(), [_region_chunk(r, 2, f.head.hidden)],
               metadata=(("lce-session", b.session_id), ("lce-session-secret", b.secret)))


def region_out_of_bounds(f: FaultLane):
    with f.client.shared_memory_session() as s:
        r = s.create(4096)
        rows = int(f.rng.integers(1, 4))
        off = 4096 - rows * f.head.hidden * 4 + int(f.rng.integers(4, 512)) // 4 * 4
        f.send("Score", f.header(), [_region_chunk(r, rows, f.head.hidden, offset=off)],
               metadata=(("lce-session", s.session_id), ("lce-session-secret", s.secret)))


def register_by_name(f: FaultLane):
    """Registration by shm name is off by default (--allow-shm-by-name): any name is refused. (An empty
    name names no memory at all: INVALID_ARGUMENT, not this fault.)"""
    with f.client.shared_memory_session() as s:
        s.register(str(f.rng.choice([f"/lce-soak-missing-{f.rng.integers(1 << 40)}", "no-slash", "/a/b",
                                     "/../etc/passwd"])), 4096)


def register_fd_wrong_secret(f: FaultLane):
    with f.client.shared_memory_session() as s:
        r = s.create(4096)
        s.secret = bytes(f.rng.integers(48, 58, 32, dtype=np.uint8)).decode()
        s.register_fd(r.fd, 4096)


def register_beyond_object(f: FaultLane):
    with f.client.shared_memory_session() as s:
        r = s.create(4096)
        s.register_fd(r.fd, 4096 + int(f.rng.integers(1, 1 << 20)))


def register_sparse_memfd(f: FaultLane):
    """A sparse memfd of a terabyte (free to the client) handed over the shm socket: refused before the
    server maps it (issue 35: 68 of them once took the server's address space)."""
    fd = os.memfd_create("lce-soak-sparse", os.MFD_CLOEXEC)
    try:
        size = (1 << 40) + int(f.rng.integers(0, 1 << 20)) * 4096
        os.ftruncate(fd, size)
        with f.client.shared_memory_session() as s:
            s.register_fd(fd, size)
    finally:
        os.close(fd)


def data_plane_idle_authenticated(f: FaultLane):
    """Authenticated data-plane connections left idle while the session's other traffic goes on: a few
    of them take no one else's place (per-session cap; issue 35) and the session's own transfers work."""
    with f.client.shared_memory_session() as s:
        rid = s.allocate_server_memory(4096)
        idle = [_dp_connection(f, s.secret) for _ in range(int(f.rng.integers(2, 6)))]
        try:
            for conn in idle:
                conn.write(s.session_id, rid, 0, memoryview(b"x" * 16))  # authenticated, then silent
            worker = _dp_connection(f, s.secret)
            try:
                worker.write(s.session_id, rid, 16, memoryview(b"y" * 64))
            finally:
                worker.close()
        finally:
            for conn in idle:
                conn.close()


def server_memory_over_cap(f: FaultLane):
    with f.client.shared_memory_session() as s:
        s.allocate_server_memory(f.ctx.data_plane_bytes_per_session + int(f.rng.integers(1, 1 << 20)))


def unregister_unknown(f: FaultLane):
    with f.client.shared_memory_session() as s:
        s.unregister(int(f.rng.integers(1, 1 << 40)))


def session_closed_midrequest(f: FaultLane):
    """The session that holds the request's region ends between its chunks: the request either finishes
    (right answers) or fails PERMISSION_DENIED from the first chunk that names the gone region (the
    secret it shows proves no session any more)."""
    s = f.client.shared_memory_session()
    try:
        req = make_request(f.rng, f.head, "score", rows=500)
        region = s.create(req.st.nbytes)
        h = region.ndarray(req.st.shape, req.st.dtype)
        h[...] = req.st
        res = issue(f.client, req, hidden=h, hidden_region=region, progress=lambda done, total: s.cancel())
    finally:
        s.close()
    return "OK" if check(f.ledger, "faults/session_closed_midrequest", req, res) else "WRONG_ANSWER"


# ------------------------------------------------------------------------ the data plane and metrics
def _dp_connection(f: FaultLane, secret: str = ""):
    return D.DataPlaneConnection("127.0.0.1", f.ctx.data_port, secret)


def data_plane_garbage(f: FaultLane):
    """Bytes that are no transfer header: an error reply (or the connection closed), nothing more."""
    with socket.create_connection(("127.0.0.1", f.ctx.data_port), timeout=30) as s:
        s.sendall(bytes(f.rng.integers(0, 256, D.HEADER.size, dtype=np.uint8)))
        head = s.recv(8)
    if len(head) < 8:
        return "closed"
    return grpc.StatusCode(D.status_code(int.from_bytes(head[:4], "little", signed=True))).name


def data_plane_unknown_region(f: FaultLane):
    conn = _dp_connection(f)
    try:
        conn.write(bytes(f.rng.integers(48, 58, 32, dtype=np.uint8)).decode(), int(f.rng.integers(1, 1 << 40)), 0,
                   memoryview(b"x" * int(f.rng.integers(1, 4096))))
    finally:
        conn.close()


def data_plane_out_of_bounds(f: FaultLane):
    with f.client.shared_memory_session() as s:
        rid = s.allocate_server_memory(8192)
        conn = _dp_connection(f, s.secret)
        try:
            conn.write(s.session_id, rid, 8192 - 100, memoryview(b"x" * 200))
        finally:
            conn.close()


def data_plane_truncated_write(f: FaultLane):
    """A write that announces more bytes than it sends, then hangs up."""
    with f.client.shared_memory_session() as s:
        rid = s.allocate_server_memory(1 << 20)
        with socket.create_connection(("127.0.0.1", f.ctx.data_port), timeout=30) as sock:
            sock.sendall(D.HEADER.pack(D.MAGIC, D.OP_WRITE, s.session_id.encode(), s.secret.encode(), rid, 0, 1 << 20))
            sock.sendall(b"x" * int(f.rng.integers(0, 1 << 19)))
    return "hung_up"


def metrics_garbage(f: FaultLane):
    with socket.create_connection(("127.0.0.1", f.ctx.metrics_port), timeout=30) as s:
        s.sendall(bytes(f.rng.integers(1, 256, int(f.rng.integers(1, 2000)), dtype=np.uint8)) + b"\r\n\r\n")
        answer = s.recv(64)
    return "closed" if not answer else ("http_4xx" if answer[9:10] == b"4" else answer[:12].decode("latin1"))


# name -> (expected outcomes, the fault, weight)
FAULTS: Dict[str, Tuple[set, Callable, float]] = {
    "cancel_stream": ({"CANCELLED"}, cancel_stream, 4),
    "cancel_after_answers": ({"client_cancelled"}, cancel_after_answers, 3),
    "deadline_stall": ({"DEADLINE_EXCEEDED"}, deadline_stall, 3),
    "deadline_short": ({"DEADLINE_EXCEEDED", "OK"}, deadline_short, 3),
    "header_timeout": ({"DEADLINE_EXCEEDED"}, header_timeout, 0.5),
    "idle_timeout": ({"DEADLINE_EXCEEDED"}, idle_timeout, 0.5),
    "oversized_message": ({"RESOURCE_EXHAUSTED"}, oversized_message, 2),
    "too_many_rows": ({"RESOURCE_EXHAUSTED"}, too_many_rows, 1),
    "malformed_first": ({"INVALID_ARGUMENT"}, malformed_first, 2),
    "malformed_call": ({"INVALID_ARGUMENT"}, malformed_call, 2),
    "garbage_after_header": ({"INVALID_ARGUMENT"}, garbage_after_header, 1),
    "garbage_after_chunk": ({"INVALID_ARGUMENT"}, garbage_after_chunk, 1),
    "empty_message": ({"INVALID_ARGUMENT"}, empty_message, 1),
    "chunk_before_header": ({"INVALID_ARGUMENT"}, chunk_before_header, 1),
    "repeated_header": ({"INVALID_ARGUMENT"}, repeated_header, 1),
    "wrong_hidden_size": ({"INVALID_ARGUMENT"}, wrong_hidden_size, 1),
    "wrong_dtype": ({"INVALID_ARGUMENT"}, wrong_dtype, 1),
    "bytes_mismatch": ({"INVALID_ARGUMENT"}, bytes_mismatch, 1),
    "nan_hidden": ({"INVALID_ARGUMENT"}, nan_hidden, 1),
    "bad_target": ({"INVALID_ARGUMENT"}, bad_target, 1),
    "bad_temperature": ({"INVALID_ARGUMENT"}, bad_temperature, 1),
    "mean_count_mismatch": ({"INVALID_ARGUMENT"}, mean_count_mismatch, 1),
    "bad_call_method": ({"INVALID_ARGUMENT"}, bad_call_method, 1),
    "bad_sequence_id": ({"INVALID_ARGUMENT"}, bad_sequence_id, 1),
    "unknown_head": ({"NOT_FOUND"}, unknown_head, 1),
    "stale_version": ({"FAILED_PRECONDITION"}, stale_version, 1),
    "region_without_session": ({"PERMISSION_DENIED"}, region_without_session, 1),
    "region_of_another_session": ({"PERMISSION_DENIED"}, region_of_another_session, 1),
    "region_out_of_bounds": ({"INVALID_ARGUMENT"}, region_out_of_bounds, 1),
    "register_by_name": ({"PERMISSION_DENIED"}, register_by_name, 1),
    "register_fd_wrong_secret": ({"PERMISSION_DENIED"}, register_fd_wrong_secret, 1),
    "register_beyond_object": ({"INVALID_ARGUMENT"}, register_beyond_object, 1),
    "server_memory_over_cap": ({"RESOURCE_EXHAUSTED"}, server_memory_over_cap, 1),
    "unregister_unknown": ({"NOT_FOUND"}, unregister_unknown, 1),
    "session_closed_midrequest": ({"OK", "PERMISSION_DENIED"}, session_closed_midrequest, 2),
    "register_sparse_memfd": ({"RESOURCE_EXHAUSTED"}, register_sparse_memfd, 1),
    "data_plane_idle_authenticated": ({"OK"}, data_plane_idle_authenticated, 1),
    "data_plane_garbage": ({"INVALID_ARGUMENT", "closed"}, data_plane_garbage, 1),
    "data_plane_unknown_region": ({"NOT_FOUND", "PERMISSION_DENIED", "UNAUTHENTICATED"}, data_plane_unknown_region, 1),
    "data_plane_out_of_bounds": ({"INVALID_ARGUMENT"}, data_plane_out_of_bounds, 1),
    "data_plane_truncated_write": ({"hung_up"}, data_plane_truncated_write, 1),
    "metrics_garbage": ({"http_4xx", "closed"}, metrics_garbage, 0.5),
}
