"""The data plane: hidden states and d_hidden over plain TCP beside gRPC (Client(data_plane=True)).

A remote client's gRPC messages carry every hidden-state and d_hidden byte through HTTP/2 framing,
flow control and protobuf copies. A server started with --data-port runs a plain-TCP data plane
(GetInfoResponse.data_port) instead: the client opens a session, has the server allocate regions
of its own memory (RegisterRegion.server_memory; GPU memory on a GPU server, pinned host memory
otherwise), writes the hidden states into one over several sockets at once (a thread per socket,
each moving its share of every chunk in turn), and sends the usual streaming request whose chunks
name slices of the regions, as co-located clients name slices of shared memory; a chunk's message
goes once all its shares are in. Each chunk's d_hidden is read back out of the other region as its
answer arrives, so transfers and compute overlap. This module mirrors the C++ client
(client/data_plane_connection.cc; LceClient::PrepareDataPlane, StreamPart, SocketShare and
SplitTransfer in client/lce_client.cc).

Wire format (proto/lce/v1/data_plane_wire.h is authoritative), little-endian, one transfer after another
on a connection:
  request  96 bytes: b"LCE2", u32 op (1 write, 2 read), 32 bytes session id (ASCII hex), 32 bytes the
           session's secret (SessionResponse.session_secret), u64 region_id, i64 offset, i64 length;
           a write then sends `length` bytes;
  reply    i32 code (google.rpc.Code), u32 message length, the message; a read that succeeded then
           sends `length` bytes.
A refusal (wrong owner, out of bounds, not server memory...) leaves the connection usable: the
server reads a refused write's payload before it answers. A failure on the wire does not.

Every transfer shows the session's secret (it went only to the session's authenticated OpenSession).
A server started with --data-plane-tls (GetInfoResponse.data_plane_tls) speaks TLS on every data-plane
socket: the client verifies its certificate against Client(root_certificates=...) (else the system's
roots) and the target's host. Without TLS the bytes and the secret cross the network in the clear.
"""
from __future__ import annotations

import queue
import socket
import ssl
import struct
import threading
from concurrent.futures import Future
from typing import Callable, List, Optional, Sequence, Tuple

import grpc

from ._errors import LceError

MAGIC = b"LCE2"
OP_WRITE, OP_READ = 1, 2
HEADER = struct.Struct("<4sI32s32sQqq")  # 96 bytes
REPLY = struct.Struct("<iI")
SESSION_ID_BYTES = SECRET_BYTES = 32
# Below this, a transfer goes over one socket: splitting costs more than it saves (as in the C++ client).
SPLIT_MIN_BYTES = 1 << 16
PAGE = 4096
# Regions are sized in whole MiB so that batches of nearby sizes reuse them.
REGION_GRANULE = 1 << 20
MAX_SOCKETS = 16

assert HEADER.size == 96


def status_code(code: int) -> grpc.StatusCode:
    """grpc.StatusCode of a google.rpc.Code number (UNKNOWN for numbers it does not know)."""
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c
    return grpc.StatusCode.UNKNOWN


def _error(code: grpc.StatusCode, details: str, rpc: str = "DataPlane"):
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

    def __init__(self, host: str, port: int, secret: str = "", tls: Optional[ssl.SSLContext] = None,
                 connect_timeout: Optional[float] = 30.0):
        """`secret`: the session's (SessionResponse.session_secret), sent with every transfer; `tls`: a
        client context (tls_context()) when the server's data plane speaks TLS."""
        # The server's data plane listens on IPv4 only; "localhost" may resolve to ::1 first.
        name = "127.0.0.1" if host == "localhost" else host
        self.where = f"{host}:{port}"
        self._secret = secret.encode("ascii") if isinstance(secret, str) else bytes(secret)
        try:
            sock = socket.create_connection((name, port), timeout=connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and replies are small
            if tls is not None:
                try:
                    sock = tls.wrap_socket(sock, server_hostname=host)  # the handshake, the name checked
                except BaseException:
                    sock.close()
                    raise
        except OSError as e:
            what = "TLS handshake failed" if isinstance(e, ssl.SSLError) else "connect"
            raise _error(grpc.StatusCode.UNAVAILABLE, f"data plane {self.where}: {what}: {e}") from e
        sock.settimeout(None)  # transfers block as long as they take, as gRPC streams do
        self._tls = tls is not None
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
            # Header and payload in one system call where the socket takes them (TLS: in two records).
            if self._tls:
                sock.sendall(head)
                sent = len(head)
            else:
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
        return sock, HEADER.pack(MAGIC, op, sid, self._secret, int(region_id), int(offset), int(length))

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

    def _recv_exactly(self, sock: socket.socket, view: memoryview) -> None:
        got, n = 0, view.nbytes
        flags = 0 if self._tls else socket.MSG_WAITALL  # an SSLSocket takes no flags
        while got < n:
            r = sock.recv_into(view[got:], n - got, flags)
            if r == 0:
                raise ConnectionResetError("the server closed the connection")
            got += r

    def _broken(self, what: str, e: OSError):
        self.close()
        return _error(grpc.StatusCode.UNAVAILABLE, f"data plane connection to {self.where} lost while {what}: {e}")


def tls_context(root_certificates: Optional[bytes]) -> ssl.SSLContext:
    """A client context for a TLS data plane: the server's certificate must chain to these PEM roots
    (None: the system's) and name the host the client connects to."""
    ctx = ssl.create_default_context(cadata=root_certificates.decode("ascii") if root_certificates else None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _bytes_view(buf) -> memoryview:
    """A flat, byte-format memoryview of a C-contiguous buffer (numpy array, bytes, memoryview)."""
    m = buf if isinstance(buf, memoryview) else memoryview(buf)
    if m.format != "B" or m.ndim != 1:
        m = m.cast("B")
    return m


def socket_share(nbytes: int, k: int, i: int) -> Tuple[int, int]:
    """Socket i's share (offset, length) of a transfer of `nbytes` over k sockets: equal shares in whole
    4 KiB pages (the last takes the rest); below 64 KiB all of it on socket 0 (the C++ client's
    SocketShare)."""
    if k == 1 or nbytes < SPLIT_MIN_BYTES:
        return 0, (nbytes if i == 0 else 0)
    lo = nbytes * i // k // PAGE * PAGE
    hi = nbytes if i + 1 == k else nbytes * (i + 1) // k // PAGE * PAGE
    return lo, hi - lo


def split_transfer(conns: List[DataPlaneConnection], workers: Sequence["_SocketWorker"], nbytes: int,
                   move: Callable[[DataPlaneConnection, int, int], None]) -> None:
    """Moves `nbytes` over the connections at once, a socket_share each: move(conn, offset, length),
    the first share in this thread, share i on workers[i - 1]. Returns once every share is done;
    raises the first share's error. (Downloads; uploads go through UploadState.)"""
    k = len(conns)
    if not workers or socket_share(nbytes, k, 0)[1] == nbytes:  # one share: no threads
        move(conns[0], 0, nbytes)
        return
    futures = [workers[i - 1].run(move, conns[i], *socket_share(nbytes, k, i)) for i in range(1, k)]
    errors: List[BaseException] = []
    try:
        move(conns[0], *socket_share(nbytes, k, 0))
    except BaseException as e:  # the others are still moving bytes on their sockets: wait for them
        errors.append(e)
    for f in futures:
        try:
            f.result()
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]


class _SocketWorker:
    """A thread kept for one socket of a lane: runs what it is given, one at a time."""

    def __init__(self, name: str):
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def run(self, fn, *args) -> Future:
        done: Future = Future()
        self._queue.put((fn, args, done))
        return done

    def stop(self) -> None:
        """Ends the thread once what it was given is done."""
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, done = item
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on `done`
                done.set_exception(e)


class Lane:
    """One stream's sockets: `sockets` per direction, and a thread kept across requests for each
    upload socket and each download socket but the first (a thread made and joined per request and
    socket lengthened each call's start and end). Uploads run on theirs (UploadState); downloads
    split each chunk over the download sockets, the first share on the caller's thread."""

    def __init__(self, host: str, port: int, sockets: int, index: int, secret: str = "",
                 tls: Optional[ssl.SSLContext] = None):
        self.index = index
        self.up: List[DataPlaneConnection] = []
        self.down: List[DataPlaneConnection] = []
        self.up_workers: List[_SocketWorker] = []
        self._down_workers: List[_SocketWorker] = []
        try:
            for _ in range(sockets):
                self.up.append(DataPlaneConnection(host, port, secret, tls))
                self.down.append(DataPlaneConnection(host, port, secret, tls))
        except BaseException:
            self.close()
            raise
        self.up_workers = [_SocketWorker(f"lce-dp{index}-up{i}") for i in range(sockets)]
        self._down_workers = [_SocketWorker(f"lce-dp{index}-down{i}") for i in range(1, sockets)]

    @property
    def usable(self) -> bool:
        return all(c.usable for c in self.up + self.down)

    def read(self, session_id: str, region_id: int, offset: int, into: memoryview) -> None:
        into = _bytes_view(into)
        split_transfer(self.down, self._down_workers, into.nbytes,
                       lambda c, off, n: c.read(session_id, region_id, offset + off, into[off:off + n]))

    def shutdown(self) -> None:
        for c in self.up + self.down:
            c.shutdown()

    def close(self) -> None:
        """Closes the sockets (waking transfers blocked on them) and stops the lane's threads."""
        for c in self.up + self.down:
            c.close()
        workers = self.up_workers + self._down_workers
        self.up_workers, self._down_workers = [], []
        for w in workers:
            w.stop()


class Route:
    """Where one stream of one request moves its bytes: its lane, the session, and the regions (the
    whole request's; each stream uses the slices at its rows' offsets)."""

    def __init__(self, lane: Lane, session_id: str, hidden_region: int, d_hidden_region: Optional[int],
                 session_secret: str = ""):
        self.lane, self.session_id, self.session_secret = lane, session_id, session_secret
        self.hidden_region, self.d_hidden_region = hidden_region, d_hidden_region

    def download(self, offset: int, into: memoryview) -> None:
        """d_hidden bytes at `offset` of the d_hidden region into `into`."""
        self.lane.read(self.session_id, self.d_hidden_region, offset, into)


class UploadState:
    """One stream's uploads, as the C++ client's StreamPart makes them: one task per upload socket
    of the route's lane, on the lane's upload threads, each writing its socket_share of every chunk into the hidden
    region in turn,
    without waiting for the other sockets (no barrier a chunk: a slow socket delays only the chunks
    whose share it has not finished). `uploaded` counts the leading chunks whose shares are all in;
    the request stream waits for a chunk there (`wait`) before it sends the chunk's message.

    A failed upload records its error (the call's error, not the CANCELLED that follows), cancels the
    call and ends the waits. `stop` ends the uploads and waits for the tasks; with abort=True (the call
    failed or was cancelled) it first shuts the upload sockets down, waking a write blocked on them
    (the lane is dropped afterwards), and closes them once the tasks are done."""

    def __init__(self, route: Route, chunks: Sequence[Tuple[int, memoryview]]):
        """chunks: per chunk of the plan, in order, (offset in the hidden region, its bytes)."""
        self._cv = threading.Condition()
        self._route = route
        self._chunks = [(int(off), _bytes_view(data)) for off, data in chunks]
        self._conns = list(route.lane.up)
        self._shares_done = [0] * len(self._chunks)
        self.uploaded = 0
        self.error: Optional[BaseException] = None
        self.stopped = False
        self._call = None
        self._tasks = []

    def start(self) -> None:
        workers = self._route.lane.up_workers
        self._tasks = [workers[i].run(self._upload, i) for i in range(len(self._conns))]

    def attach(self, call) -> None:
        """The call to cancel when an upload fails (at once if one failed already)."""
        with self._cv:
            self._call = call
            failed = self.error is not None
        if failed:
            call.cancel()

    def wait(self, chunk: int) -> bool:
        """Blocks until chunk `chunk` is uploaded (True), or the uploads failed or were stopped (False)."""
        with self._cv:
            self._cv.wait_for(lambda: self.stopped or self.uploaded > chunk)
            return not self.stopped

    def fail(self, e: BaseException) -> None:
        """Records the first error (unless the uploads were stopped: then it is their doing), ends the
        waits and cancels the call."""
        with self._cv:
            if self.stopped:
                return
            self.error = e
            self.stopped = True
            self._cv.notify_all()
            call = self._call
        if call is not None:
            call.cancel()

    def stop(self, abort: bool = False) -> None:
        """Ends the uploads (no further share starts) and joins the threads."""
        with self._cv:
            self.stopped = True
            self._cv.notify_all()
        if abort:
            for c in self._conns:
                c.shutdown()
        for t in self._tasks:
            t.exception()  # waits; _upload hands its errors to fail()
        if abort:
            for c in self._conns:
                c.close()

    def _upload(self, i: int) -> None:
        conn, k, r = self._conns[i], len(self._conns), self._route
        try:
            for c, (offset, data) in enumerate(self._chunks):
                lo, n = socket_share(data.nbytes, k, i)
                if self.stopped:
                    return
                if n:
                    conn.write(r.session_id, r.hidden_region, offset + lo, data[lo:lo + n])
                with self._cv:
                    if self.stopped:
                        return
                    self._shares_done[c] += 1
                    advanced = False
                    while self.uploaded < len(self._chunks) and self._shares_done[self.uploaded] == k:
                        self.uploaded += 1
                        advanced = True
                    if advanced:
                        self._cv.notify_all()
        except BaseException as e:  # handed to the reading thread, which raises it
            self.fail(e)


class DataPlane:
    """The session, server-memory regions and sockets of Client(data_plane=True), made on first use and
    kept across requests. Requests over it take turns (`lock`, held by the request using it). After a
    failed request everything is dropped (`reset`): the server may have restarted, a socket may be
    mid-transfer; the next request starts afresh."""

    def __init__(self, target: str, sockets: int, root_certificates: Optional[bytes] = None):
        self.lock = threading.Lock()
        self.host = target_host(target)
        self.sockets = int(sockets)
        self.root_certificates = root_certificates  # for a TLS data plane (None: the system's roots)
        self.session = None  # SharedMemorySession
        self.port = 0
        self.tls: Optional[ssl.SSLContext] = None
        self.hidden_region = self.d_hidden_region = 0
        self.hidden_bytes = self.d_hidden_bytes = 0  # the regions' sizes (0: none yet)
        self.lanes: List[Optional[Lane]] = []  # by stream

    def prepare(self, data_port: Callable[[], Tuple[int, bool]], open_session: Callable[[], object], parts: int,
                hidden_bytes: int, d_hidden: bool) -> List[Route]:
        """Makes the session (on first use), regions of at least `hidden_bytes` (a d_hidden one too
        with `d_hidden`) and `parts` lanes; returns a Route per part. `data_port()`: the server's data
        port and whether it speaks TLS. Call with `lock` held."""
        if self.session is None:
            port, tls = data_port()
            self.tls = tls_context(self.root_certificates) if tls else None
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
                self.lanes[i] = Lane(self.host, self.port, self.sockets, i, self.session.secret, self.tls)
        sid, secret = self.session.session_id, self.session.secret
        return [Route(self.lanes[i], sid, self.hidden_region, self.d_hidden_region if d_hidden else None, secret)
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
        self._drop(clean=False)

    def _drop(self, clean: bool) -> None:
        """Forgets the session and sockets: the sockets closed, the session ended cleanly (half-close)
        or cancelled."""
        session, self.session = self.session, None
        lanes, self.lanes = self.lanes, []
        self.hidden_bytes = self.d_hidden_bytes = 0
        self.port = 0
        for lane in lanes:
            if lane is not None:
                lane.close()
        if session is not None:
            session.close() if clean else session.cancel()

    def close(self) -> None:
        """Ends the session cleanly (half-close; the server frees the regions) and closes the sockets.
        Waits for a request using the data plane to end."""
        with self.lock:
            self.close_locked()

    def close_locked(self) -> None:
        """close() with `lock` held by the caller."""
        self._drop(clean=True)
