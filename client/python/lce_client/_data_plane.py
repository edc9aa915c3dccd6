"""The data plane: hidden states and d_hidden over plain TCP beside gRPC (Client(data_plane=True)).

A remote client's gRPC messages carry every hidden-state and d_hidden byte through HTTP/2 framing,
flow control and protobuf copies. A server started with --data-port runs a plain-TCP data plane
(GetInfoResponse.data_port) instead: the client opens a session, has the server allocate regions
of its own memory (RegisterRegion.server_memory; GPU memory on a GPU server, pinned host memory
otherwise), writes each chunk's hidden states into one over several sockets at once, and sends the
usual streaming request whose chunks name slices of the regions, as co-located clients name slices
of shared memory. Each chunk's d_hidden is read back out of the other region as its answer arrives,
so transfers and compute overlap. This module mirrors the C++ client (client/data_plane_connection.cc,
LceClient::PrepareDataPlane / SplitTransfer in client/lce_client.cc).

Wire format (server/region_data_plane.h is authoritative), little-endian, one transfer after another
on a connection:
  request  64 bytes: b"LCE1", u32 op (1 write, 2 read), 32 bytes session id (ASCII hex),
           u64 region_id, i64 offset, i64 length; a write then sends `length` bytes;
  reply    i32 code (google.rpc.Code), u32 message length, the message; a read that succeeded then
           sends `length` bytes.
A refusal (wrong owner, out of bounds, not server memory...) leaves the connection usable: the
server reads a refused write's payload before it answers. A failure on the wire does not.

The session id is the capability and the data plane has no TLS: for trusted networks only.
"""
from __future__ import annotations

import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional

import grpc

MAGIC = b"LCE1"
OP_WRITE, OP_READ = 1, 2
HEADER = struct.Struct("<4sI32sQqq")  # 64 bytes
REPLY = struct.Struct("<iI")
SESSION_ID_BYTES = 32
# Below this, a transfer goes over one socket: splitting costs more than it saves (as in the C++ client).
SPLIT_MIN_BYTES = 1 << 16
PAGE = 4096
# Regions are sized in whole MiB so that batches of nearby sizes reuse them.
REGION_GRANULE = 1 << 20
MAX_SOCKETS = 16

assert HEADER.size == 64


def status_code(code: int) -> grpc.StatusCode:
    """grpc.StatusCode of a google.rpc.Code number (UNKNOWN for numbers it does not know)."""
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c
    return grpc.StatusCode.UNKNOWN


def _error(code: grpc.StatusCode, details: str, rpc: str = "DataPlane"):
    from ._client import LceError

    return LceError(code, details, rpc)


def target_host(target: str) -> str:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port", "ipv4:host:port"):
    the data plane listens on the gRPC server's address, on another port."""
    t = target
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            t = t[len(scheme):]
            break
    colon = t.rfind(":")
    host = t if colon < 0 else t[:colon]
    if len(host) >= 2 and host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
    return host


class DataPlaneConnection:
    """One TCP connection to a server's data plane. One transfer at a time (callers keep one
    connection per direction per stream, and split a chunk over several, so transfers proceed
    together). Transfers raise LceError: the server's code and message for a refusal (the connection
    stays usable), UNAVAILABLE when the connection broke (it is closed then: `usable` is False)."""

    def __init__(self, host: str, port: int, connect_timeout: Optional[float] = 30.0):
        # The server's data plane listens on IPv4 only; "localhost" may resolve to ::1 first.
        name = "127.0.0.1" if host == "localhost" else host
        self.where = f"{host}:{port}"
        try:
            sock = socket.create_connection((name, port), timeout=connect_timeout)
        except OSError as e:
            raise _error(grpc.StatusCode.UNAVAILABLE, f"data plane {self.where}: connect: {e}") from e
        sock.settimeout(None)  # transfers block as long as they take, as gRPC streams do
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and replies are small
        self._sock: Optional[socket.socket] = sock

    @property
    def usable(self) -> bool:
        """False once a transfer failed on the wire (or after close): the connection cannot be used again."""
        return self._sock is not None

    def write(self, session_id: str, region_id: int, offset: int, data: memoryview) -> None:
        """Copies `data` to [offset, offset + len) of region `region_id` of session `session_id`."""
        data = _bytes_view(data)
        sock, head = self._begin(OP_WRITE, session_id, region_id, offset, data.nbytes)
        try:
            # Header and payload in one system call where the socket takes them.
            sent = sock.sendmsg([head, data]) if data.nbytes else sock.send(head)
            if sent < len(head):
                sock.sendall(head[sent:])
                sock.sendall(data)
            elif sent - len(head) < data.nbytes:
                sock.sendall(data[sent - len(head):])
        except OSError as e:
            raise self._broken("sending", e) from e
        self._reply(sock)

    def read(self, session_id: str, region_id: int, offset: int, into: memoryview) -> None:
        """Copies [offset, offset + len(into)) of the region into the writable buffer `into`."""
        into = _bytes_view(into)
        if into.readonly:
            raise ValueError("data plane read: the destination buffer is read-only")
        sock, head = self._begin(OP_READ, session_id, region_id, offset, into.nbytes)
        try:
            sock.sendall(head)
        except OSError as e:
            raise self._broken("sending", e) from e
        self._reply(sock)
        try:
            self._recv_exactly(sock, into)
        except OSError as e:
            raise self._broken("receiving", e) from e

    def shutdown(self) -> None:
        """Ends the connection at once, waking a transfer blocked on it in another thread."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    # ------------------------------------------------------------------------------- internals
    def _begin(self, op: int, session_id: str, region_id: int, offset: int, length: int):
        sock = self._sock
        if sock is None:
            raise _error(grpc.StatusCode.UNAVAILABLE, f"data plane {self.where}: the connection was lost earlier")
        sid = session_id.encode("ascii") if isinstance(session_id, str) else bytes(session_id)
        if len(sid) != SESSION_ID_BYTES:  # the C++ client refuses these too: the server reads exactly 32
            raise _error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"session id must have {SESSION_ID_BYTES} characters, got {len(sid)}")
        return sock, HEADER.pack(MAGIC, op, sid, int(region_id), int(offset), int(length))

    def _reply(self, sock: socket.socket) -> None:
        head = bytearray(REPLY.size)
        try:
            self._recv_exactly(sock, memoryview(head))
            code, length = REPLY.unpack(head)
            msg = bytearray(length)
            if length:
                self._recv_exactly(sock, memoryview(msg))
        except OSError as e:
            raise self._broken("waiting for the reply", e) from e
        if code != 0:
            # A refusal leaves the connection usable: the server read a refused write's payload.
            raise _error(status_code(code), msg.decode("utf-8", "replace"))

    @staticmethod
    def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
        got, n = 0, view.nbytes
        while got < n:
            r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            if r == 0:
                raise ConnectionResetError("the server closed the connection")
            got += r

    def _broken(self, what: str, e: OSError):
        self.close()
        return _error(grpc.StatusCode.UNAVAILABLE, f"data plane connection to {self.where} lost while {what}: {e}")


def _bytes_view(buf) -> memoryview:
    """A flat, byte-format memoryview of a C-contiguous buffer (numpy array, bytes, memoryview)."""
    m = buf if isinstance(buf, memoryview) else memoryview(buf)
    if m.format != "B" or m.ndim != 1:
        m = m.cast("B")
    return m


def split_transfer(conns: List[DataPlaneConnection], pool: Optional[ThreadPoolExecutor], nbytes: int,
                   move: Callable[[DataPlaneConnection, int, int], None]) -> None:
    """Moves `nbytes` over the connections at once, an equal share each in whole 4 KiB pages (the
    last takes the rest): move(conn, offset, length), the first share in this thread, the others on
    `pool`. Returns once every share is done; raises the first share's error."""
    k = len(conns)
    if k == 1 or pool is None or nbytes < SPLIT_MIN_BYTES:
        move(conns[0], 0, nbytes)
        return

    def bounds(i: int):
        lo = nbytes * i // k // PAGE * PAGE
        hi = nbytes if i + 1 == k else nbytes * (i + 1) // k // PAGE * PAGE
        return lo, hi - lo

    futures = [pool.submit(move, conns[i], *bounds(i)) for i in range(1, k)]
    errors: List[BaseException] = []
    try:
        move(conns[0], *bounds(0))
    except BaseException as e:  # the others are still moving bytes on their sockets: wait for them
        errors.append(e)
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]


class Lane:
    """One stream's sockets: `sockets` per direction, and the threads that drive all but the first
    of them (each chunk's bytes are split over the sockets and move at once)."""

    def __init__(self, host: str, port: int, sockets: int, index: int):
        self.up: List[DataPlaneConnection] = []
        self.down: List[DataPlaneConnection] = []
        try:
            for _ in range(sockets):
                self.up.append(DataPlaneConnection(host, port))
                self.down.append(DataPlaneConnection(host, port))
        except BaseException:
            self.close()
            raise
        # Uploads (gRPC's request thread) and downloads (the answer-reading thread) run together:
        # a pool each, so that neither waits for the other's helpers.
        self._up_pool = self._down_pool = None
        if sockets > 1:
            self._up_pool = ThreadPoolExecutor(sockets - 1, thread_name_prefix=f"lce-dp{index}-up")
            self._down_pool = ThreadPoolExecutor(sockets - 1, thread_name_prefix=f"lce-dp{index}-down")

    @property
    def usable(self) -> bool:
        return all(c.usable for c in self.up + self.down)

    def write(self, session_id: str, region_id: int, offset: int, data: memoryview) -> None:
        data = _bytes_view(data)
        split_transfer(self.up, self._up_pool, data.nbytes,
                       lambda c, off, n: c.write(session_id, region_id, offset + off, data[off:off + n]))

    def read(self, session_id: str, region_id: int, offset: int, into: memoryview) -> None:
        into = _bytes_view(into)
        split_transfer(self.down, self._down_pool, into.nbytes,
                       lambda c, off, n: c.read(session_id, region_id, offset + off, into[off:off + n]))

    def shutdown(self) -> None:
        for c in self.up + self.down:
            c.shutdown()

    def close(self) -> None:
        for c in self.up + self.down:
            c.close()
        for p in (getattr(self, "_up_pool", None), getattr(self, "_down_pool", None)):
            if p is not None:
                p.shutdown(wait=False)


class Route:
    """Where one stream of one request moves its bytes: its lane, the session, and the regions (the
    whole request's; each stream uses the slices at its rows' offsets)."""

    def __init__(self, lane: Lane, session_id: str, hidden_region: int, d_hidden_region: Optional[int]):
        self.lane, self.session_id = lane, session_id
        self.hidden_region, self.d_hidden_region = hidden_region, d_hidden_region

    def upload(self, offset: int, data: memoryview) -> None:
        """Hidden-state bytes into the hidden region at `offset`."""
        self.lane.write(self.session_id, self.hidden_region, offset, data)

    def download(self, offset: int, into: memoryview) -> None:
        """d_hidden bytes at `offset` of the d_hidden region into `into`."""
        self.lane.read(self.session_id, self.d_hidden_region, offset, into)


class UploadState:
    """Ties a stream's uploads, made in gRPC's request-iterating thread, to its call: a failed upload
    cancels the call (its error is what the caller gets, not the CANCELLED that follows), and once
    the stream is over no further upload starts."""

    def __init__(self):
        self._lock = threading.Lock()
        self.error: Optional[BaseException] = None
        self.stopped = False
        self._call = None

    def attach(self, call) -> None:
        with self._lock:
            self._call = call
            failed = self.error is not None
        if failed:
            call.cancel()

    def fail(self, e: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = e
            call = self._call
        if call is not None:
            call.cancel()


class DataPlane:
    """The session, server-memory regions and sockets of Client(data_plane=True), made on first use and
    kept across requests. Requests over it take turns (`lock`, held by the request using it). After a
    failed request everything is dropped (`reset`): the server may have restarted, a socket may be
    mid-transfer; the next request starts afresh."""

    def __init__(self, target: str, sockets: int):
        self.lock = threading.Lock()
        self.host = target_host(target)
        self.sockets = int(sockets)
        self.session = None  # SharedMemorySession
        self.port = 0
        self.hidden_region = self.d_hidden_region = 0
        self.hidden_bytes = self.d_hidden_bytes = 0  # the regions' sizes (0: none yet)
        self.lanes: List[Optional[Lane]] = []  # by stream

    def prepare(self, data_port: Callable[[], int], open_session: Callable[[], object], parts: int,
                hidden_bytes: int, d_hidden: bool) -> List[Route]:
        """Makes the session (on first use), regions of at least `hidden_bytes` (a d_hidden one too
        with `d_hidden`) and `parts` lanes; returns a Route per part. Call with `lock` held."""
        if self.session is None:
            port = int(data_port())
            if port <= 0:
                raise _error(grpc.StatusCode.FAILED_PRECONDITION,
                             "Client(data_plane=True): the server has no data plane (start lce_server with "
                             "--data-port, e.g. --data-port=0 for any free port)")
            self.session = open_session()
            self.port = port
        self.hidden_region, self.hidden_bytes = self._ensure(self.hidden_region, self.hidden_bytes, hidden_bytes,
                                                             "data-plane-hidden")
        if d_hidden:
            self.d_hidden_region, self.d_hidden_bytes = self._ensure(self.d_hidden_region, self.d_hidden_bytes,
                                                                     hidden_bytes, "data-plane-d-hidden")
        while len(self.lanes) < parts:
            self.lanes.append(None)
        for i in range(parts):
            lane = self.lanes[i]
            if lane is None or not lane.usable:
                if lane is not None:
                    lane.close()
                self.lanes[i] = None
                self.lanes[i] = Lane(self.host, self.port, self.sockets, i)
        sid = self.session.session_id
        return [Route(self.lanes[i], sid, self.hidden_region, self.d_hidden_region if d_hidden else None)
                for i in range(parts)]

    def _ensure(self, region: int, size: int, needed: int, name: str):
        """A region of at least `needed` bytes: `region` if it is large enough, else a new one (the
        old one given back first, so that the session's limit counts only what is in use)."""
        if size >= needed:
            return region, size
        if size > 0:
            self.session.unregister(region)
        nbytes = -(-needed // REGION_GRANULE) * REGION_GRANULE
        return self.session.allocate_server_memory(nbytes, name), nbytes

    def reset(self) -> None:
        """Drops the session (the server frees its regions) and the sockets, waking transfers blocked
        on them. Call with `lock` held."""
        session, self.session = self.session, None
        lanes, self.lanes = self.lanes, []
        self.hidden_bytes = self.d_hidden_bytes = 0
        self.port = 0
        for lane in lanes:
            if lane is not None:
                lane.close()
        if session is not None:
            session.cancel()

    def close(self) -> None:
        """Ends the session cleanly (half-close; the server frees the regions) and closes the sockets.
        Waits for a request using the data plane to end."""
        with self.lock:
            self.close_locked()

    def close_locked(self) -> None:
        """close() with `lock` held by the caller."""
        session, self.session = self.session, None
        lanes, self.lanes = self.lanes, []
        self.hidden_bytes = self.d_hidden_bytes = 0
        self.port = 0
        for lane in lanes:
            if lane is not None:
                lane.close()
        if session is not None:
            session.close()
