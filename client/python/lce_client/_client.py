"""lce_client.Client: the gRPC client of lce.v1.LceService."""
from __future__ import annotations

import functools
import math
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import _arrays as A
from ._base import (_ClientBase, BackwardResult, ForwardBackwardResult, PolicyLossResult, ProgressFn,  # noqa: F401
                    ScoreResult, call_answers, client_options, plan_chunks, token_accuracy)
from ._data_plane import DataPlane, Route, UploadState
from ._errors import LceError, _wrap
from ._options import DEFAULT_CHUNK_BYTES, DEFAULT_MIN_STREAM_BYTES, ClientOptions  # noqa: F401
from ._proto import lce_pb2 as pb
from ._proto import lce_pb2_grpc as pb_grpc
from ._shm import SESSION_METADATA_KEY, SESSION_SECRET_METADATA_KEY, Region, SharedMemorySession


@dataclass(frozen=True)
class HeadInfo:
    name: str
    vocab_size: int
    hidden_size: int
    dtype: str          # "bf16" | "fp16" | "fp32"
    version: int
    has_bias: bool

    @classmethod
    def _from(cls, h: pb.HeadDescription) -> "HeadInfo":
        return cls(h.name, h.vocab_size, h.hidden_size, A.dtype_name(h.dtype), h.version, h.has_bias)


@dataclass(frozen=True)
class ServerInfo:
    head: HeadInfo
    heads: List[HeadInfo]
    backend: str
    tp_size: int
    max_message_bytes: int
    max_rows_per_request: int
    server_version: str
    data_port: int = 0  # the server's data plane (0: none; start it with --data-port)
    data_plane_tls: bool = False  # its sockets speak TLS (--data-plane-tls)
    # Per-row outputs that are the same bits whatever the batch around the row (and its chunking,
    # streams, transport), and whatever the TP group's size: GetInfo's `invariance`.
    invariant_across_batches: List[str] = field(default_factory=list)
    invariant_across_tp_sizes: List[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: backend, TP size, the head (shape, dtype, version) and the server's version."""
        h = self.head
        return (f"backend {self.backend}, tp_size {self.tp_size}, head '{h.name}' {h.vocab_size}x{h.hidden_size} "
                f"{h.dtype} version {h.version}, lce_server {self.server_version}")


class _Progress:
    """Calls the user's callback and/or drives a tqdm bar, in rows."""

    def __init__(self, total: int, callback: Optional[ProgressFn], use_tqdm: Union[bool, Any], desc: str):
        self.total, self.callback, self.bar = total, callback, None
        if use_tqdm:
            try:
                from tqdm.auto import tqdm
            except ImportError as e:  # pragma: no cover
                raise ImportError("progress bars need tqdm: pip install tqdm") from e
            kw = use_tqdm if isinstance(use_tqdm, dict) else {}
            self.bar = tqdm(total=total, unit="row", desc=desc, **kw)

    def update(self, done: int, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step)
        if self.callback is not None:
            self.callback(done, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Client(_ClientBase):
    """A connection to an lce_server, or to several replicas of one.

    Args:
      target: "host:port". Replicas (data-parallel groups serving one head, or any servers of the same
        heads): a list of targets, or one string of them, comma-separated ("a:50051,b:50051"). Scoring
        calls (score, backward, and forward_backward / policy_loss without accumulate_weight_grad) are
        spread over the replicas in turn; calls that read or change a head's training state (those with
        accumulate_weight_grad, load_head, zero_grad, get_grad, optimizer_step, update_weights,
        save_head), info() and shared-memory sessions (and the calls that name their regions) go to the
        front: the first target.
      load_balancing: None (default): one channel per target, spread by this client. "round_robin":
        `target` is one gRPC name whose resolver gives several addresses (dns:///fronts.ns.svc:50051, a
        Kubernetes headless Service; or ipv4:10.0.0.1:50051,10.0.0.2:50051), and gRPC's round_robin
        policy spreads the scoring calls over them; the front is a second channel with pick_first over
        the same name (its first address that answers). data_plane needs listed targets.
      max_attempts: scoring calls that fail with UNAVAILABLE (a replica died, or its group lost a rank)
        are sent again, whole, to the next replica: at most this many attempts in all (1: no retries;
        None, the default: 3 over replicas — several targets, or round_robin — and 1 for one server),
        attempt k+1 after retry_backoff * 2**(k-1) seconds (at most 1 s). They have no side effects,
        so a retry is safe; a replica that failed is passed over for a second. Calls to the front are
        not retried. A retried call's progress callback counts its rows again.
      retry_backoff: the first wait before a retry, in seconds (default 0.05).
      admin_token: bearer token sent instead of `token` on the training RPCs (load_head, zero_grad,
        get_grad, optimizer_step, update_weights, save_head), which need the server's admin token.
      timeout: deadline of each call, in seconds (None: no deadline).
      chunk_bytes: hidden-state bytes per streamed chunk (at least one row per chunk). Results do not
        depend on it.
      first_chunk_bytes: hidden-state bytes of each stream's first chunk (0, the default: chunk_bytes;
        never more than chunk_bytes, at least one row). The server computes a chunk once it has all of
        it; a smaller first chunk starts it earlier (a short pipeline fill).
      last_chunk_bytes: hidden-state bytes of each stream's last chunk (0, the default: what is left).
        Nothing overlaps the last chunk's compute and answer; a smaller one shortens that tail. It
        applies where a stream has more rows than its first chunk and such a last one, in calls that
        return d_hidden (a score's last answer is a few floats: a smaller last chunk only adds an
        engine call).
      grow_chunks: after a smaller first chunk, each chunk twice the one before, up to chunk_bytes (1, 2,
        4, 8, ... MiB), so that each arrives while the one before computes, and once what is left
        fits in chunk_bytes one chunk takes it (the C++ client's grow_chunks). Measured best for
        scores of 8192 x 4096 bf16 over the data plane on an H100: a 4 MiB first chunk and
        chunk_bytes of 36 MiB, four engine calls (bench/RESULTS.md).
        These apply to every stream of a request (see `streams`), each planned on its own rows
        (lce_client.plan_chunks), on the wire and over the data plane; requests whose hidden states
        are in a shared-memory or CUDA region (hidden_region) are chunked by chunk_bytes alone, as
        the C++ client also ignores both for them. Results do not depend on them beyond float
        rounding (the CPU engine may round a row differently in a chunk of another shape).
      root_certificates / private_key / certificate_chain: PEM bytes for TLS (mTLS with the last two);
        `tls=True` uses TLS with the system's roots.
      token: bearer token, sent as "authorization: Bearer <token>" metadata on every call.
      head: default head name for every call ("" = the server's default head).
      options: a ClientOptions holding these settings (the keyword arguments then change some of
        them); or, as before ClientOptions, a sequence of extra gRPC channel options
        (ClientOptions.channel_options).
      streams: split one score / forward_backward / backward / policy_loss call over up to this many
        concurrent streams, each on its own channel (TCP connection), when its hidden states are
        large: contiguous row ranges of at least `min_stream_bytes` each, sent as parts
        (RequestHeader.partial) and combined here. Default 4 (one connection carries ~1-2 GB/s on
        loopback); 1 never splits; each call may override it with `streams=`. Results equal the
        unsplit call's (the reduced loss up to float64 rounding of the parts' sum); the parts of a
        call that accumulates dW fill one contribution on the server (RequestHeader.split_id).
      min_stream_bytes: the least hidden-state bytes of one part (default 8 MiB).
      data_plane: remote clients: move hidden states and d_hidden over the server's data plane (plain
        TCP beside gRPC, on the port GetInfo names; lce_server --data-port) instead of inside the gRPC
        messages, which then name slices of server memory as co-located requests name slices of shared
        memory. HTTP/2 framing and protobuf copies of the bulk bytes go away; answers are the same. The
        first such call opens a session holding two server-memory regions sized to the batch (grown
        when a batch is larger, reused otherwise); each chunk is written before its message is sent and
        its d_hidden read as its answer arrives, so transfer and compute overlap. Calls over the data
        plane take turns. A server without one: LceError FAILED_PRECONDITION. Calls given
        hidden_region / d_hidden_region do not use it.
        Every transfer shows the session's secret. A server started with --data-plane-tls gets TLS
        sockets, its certificate checked against root_certificates (else the system's roots).
      data_plane_sockets: sockets per direction per stream on the data plane, in [1, 16]: each chunk's
        bytes are split over them in page-aligned shares (below 64 KiB all on the first): each
        stream uploads with a thread per socket that moves its share of every chunk in turn, without
        waiting for the other sockets, and a chunk's message goes once all its shares are in.
      data_plane_streams: streams a call over the data plane is split over, at most `streams` (a call's
        own `streams=` overrides both): 1 by default, one stream's chunks merging into the server's largest
        engine calls (bench/RESULTS.md, 2026-11-29 session 21: a 16384 x 4096 train request over 1 stream
        7-25% faster than over 4, on one GPU and a TP-4 group).
    """

    def __init__(self, target: Union[str, Sequence[str]], *, options: Optional[ClientOptions] = None, **kwargs):
        o = client_options(options, kwargs)
        targets = _replica_targets(target, o.load_balancing)
        o.check()
        super().__init__(targets, o)
        self._info_cache: dict = {}
        self._version_checked = False  # info() warns once on another major version
        self._lock = threading.Lock()
        lb = [("grpc.lb_policy_name", "round_robin")] if o.load_balancing else []
        self._replicas = [_Replica(self, t, lb, o.data_plane) for t in targets]
        self._front = _Replica(self, targets[0], [("grpc.lb_policy_name", "pick_first")], False) if lb \
            else self._replicas[0]
        self._next_replica = 0
        self._streams_only: set = set()  # ids of stubs whose server has no Call

    # The first replica's channel, stubs and data plane, as attributes of the client (tests replace
    # them with intercepted ones).
    @property
    def _channel(self):
        return self._replicas[0].channel

    @property
    def _stub(self):
        return self._replicas[0].stub

    @_stub.setter
    def _stub(self, stub) -> None:
        self._replicas[0].stub = stub

    @property
    def _part_channels(self) -> list:
        return self._replicas[0].part_channels

    @property
    def _part_stubs(self) -> list:
        return self._replicas[0].part_stubs

    @property
    def _data_plane(self) -> Optional[DataPlane]:
        return self._replicas[0].data_plane

    # ----------------------------------------------------------------------------------- plumbing
    def _new_channel(self, target: str, extra: Sequence = ()):
        opts = self._options + list(extra)
        if self._creds is not None:
            return grpc.secure_channel(target, self._creds, options=opts)
        return grpc.insecure_channel(target, options=opts)

    @property
    def data_plane(self) -> bool:
        """Whether calls move their bulk bytes over the server's data plane (Client(data_plane=True))."""
        return self._data_plane is not None

    def close(self) -> None:
        """Closes the channels, and the data planes' sockets and sessions (the servers free their regions)."""
        for r in {id(r): r for r in self._replicas + [self._front]}.values():
            r.close(self._lock)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unary(self, name: str, request, stub=None):
        """A unary call on the front (or `stub`); the training RPCs carry the admin token."""
        metadata = self._admin_metadata if name in _TRAINING_RPCS else self._metadata
        try:
            return getattr(stub or self._front.stub, name)(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as e:
            raise _wrap(e, name) from e

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the channel is connected (raises LceError UNAVAILABLE after `timeout`)."""
        try:
            grpc.channel_ready_future(self._front.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError as e:
            raise LceError(grpc.StatusCode.UNAVAILABLE, f"no server at {self.target} after {timeout}s") from e

    def shared_memory_session(self) -> SharedMemorySession:
        """Opens a co-located session (server on this host): `with client.shared_memory_session() as s:`,
        then `region = s.create(nbytes)` and pass `hidden_region=region` (hidden being an array inside
        it, e.g. `region.ndarray(shape, dtype)`) and `d_hidden_region=` to score / forward_backward /
        backward / policy_loss: hidden states are read and d_hidden written in place, with no bytes on
        the wire. `s.register_cuda(tensor)` registers GPU memory instead (CUDA IPC; servers with the
        CUDA backend). See lce_client._shm."""
        return SharedMemorySession(self._front.stub, self._metadata)

    # ------------------------------------------------------------------------------------- unary
    def info(self, head: Optional[str] = None) -> ServerInfo:
        """Describes the head (default: the client's head) and the server: the front, or where the front
        is UNAVAILABLE, the first replica that answers (they serve the same heads)."""
        req = pb.GetInfoRequest(head=self._head(head))
        others = [r for r in self._replicas if r is not self._front]
        for i, replica in enumerate([self._front] + others):
            try:
                info = _server_info(self._unary("GetInfo", req, replica.stub))
                break
            except LceError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE or i == len(others):
                    raise
        with self._lock:
            self._info_cache[self._head(head)] = info
            warn = not self._version_checked
            self._version_checked = True
        if warn:
            _warn_on_other_major(info.server_version)
        return info

    def replica_info(self, head: Optional[str] = None) -> List[Tuple[str, Union[ServerInfo, "LceError"]]]:
        """What this client's calls run on: [(target, GetInfo of it)] for each replica, the front first
        (with round_robin: the front's address, under the name). A replica that does not answer gives
        its LceError instead of a ServerInfo."""
        req = pb.GetInfoRequest(head=self._head(head))
        replicas = [self._front] if self.load_balancing else self._replicas
        out: List[Tuple[str, Union[ServerInfo, LceError]]] = []
        for replica in replicas:
            try:
                out.append((replica.target, _server_info(self._unary("GetInfo", req, replica.stub))))
            except LceError as e:
                out.append((replica.target, e))
        return out

    def describe(self, head: Optional[str] = None) -> str:
        """replica_info() as lines of text, one a replica ("  TARGET (front): backend ..., tp_size ..., head ...")."""
        return "\n".join(f"  {t}{'' if k else ' (front)'}: {i.summary() if isinstance(i, ServerInfo) else i}"
                         for k, (t, i) in enumerate(self.replica_info(head)))

    def head_info(self, head: Optional[str] = None, refresh: bool = False) -> HeadInfo:
        """The head's description, cached after the first call (refresh=True asks again)."""
        key = self._head(head)
        with self._lock:
            cached = self._info_cache.get(key)
        if cached is None or refresh:
            cached = self.info(head)
        return cached.head

    def load_head(self, name: str, *, safetensors_file: Optional[str] = None, tensor: str = "",
                  clone_of: Optional[str] = None, seeded: Optional[tuple] = None, bias: bool = False) -> HeadInfo:
        """Adds or replaces a head: from a safetensors file on the server, a clone of another head, or
        a seeded random head `seeded=(vocab, hidden, seed, dtype)` (with `bias`: and a zero fp32 bias,
        which update_weights(bias=...) sets and training trains)."""
        req = pb.LoadHeadRequest(name=name, tensor=tensor)
        if safetensors_file is not None:
            req.safetensors_file = safetensors_file
        elif clone_of is not None:
            req.clone_of = clone_of
        elif seeded is not None:
            v, h, s, d = seeded
            req.seeded.CopyFrom(pb.SeededHead(vocab_size=v, hidden_size=h, seed=s, dtype=A.parse_dtype(d), bias=bias))
        else:
            raise ValueError("load_head needs safetensors_file, clone_of or seeded")
        with self._lock:
            self._info_cache.pop(name, None)
        return HeadInfo._from(self._unary("LoadHead", req))

    def zero_grad(self, head: Optional[str] = None) -> None:
        self._unary("ZeroGrad", pb.ZeroGradRequest(head=self._head(head)))

    def commit_grad(self, pending_grads, scale: float = 1.0, head: Optional[str] = None,
                    discard: bool = False) -> None:
        """Adds the pending dW contributions `pending_grads` (ids from a deferred call's result) to the
        head's gradient, times `scale` (the upstream gradient of the call's reduced loss); or drops
        them (discard=True). Each id is committed once; an unknown, expired or stale one raises."""
        ids = [pending_grads] if isinstance(pending_grads, int) else list(pending_grads)
        for i in ids:
            req = pb.CommitGradRequest(head=self._head(head), pending_grad_id=int(i), discard=discard)
            if not discard:
                req.scale = float(scale)
            self._unary("CommitGrad", req, self._front.stub)

    def get_grad(self, head: Optional[str] = None, pending_grad: Optional[int] = None,
                 bias: bool = False) -> np.ndarray:
        """The head's accumulated fp32 gradient dW [vocab, hidden] as numpy; with `pending_grad`, that
        pending contribution's instead (it stays pending: commit or discard it after); with `bias`, the
        bias's gradient dB [vocab] (a head with a bias)."""
        out = None
        req = pb.GetGradRequest(head=self._head(head), pending_grad_id=int(pending_grad or 0), bias=bias)
        try:
            for c in self._front.stub.GetGrad(req, timeout=self.timeout,
                                              metadata=self._metadata if pending_grad else self._admin_metadata):
                if out is None:
                    out = np.zeros((c.rows_total, c.cols), dtype=np.float32)
                out[c.first_row:c.first_row + c.rows] = np.frombuffer(c.data, dtype="<f4").reshape(c.rows, c.cols)
        except grpc.RpcError as e:
            raise _wrap(e, "GetGrad") from e
        if out is None:
            return np.zeros((0,) if bias else (0, 0), dtype=np.float32)
        return out.reshape(-1) if bias else out

    def optimizer_step(self, head: Optional[str] = None, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                       eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                       zero_grad: bool = True):
        """One AdamW step on the server's fp32 master weights. Returns (grad_norm, HeadInfo, step)."""
        r = self._unary("OptimizerStep", pb.OptimizerStepRequest(
            head=self._head(head), lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, zero_grad=zero_grad))
        return r.grad_norm, HeadInfo._from(r.head), r.step

    def update_weights(self, weight: Any, head: Optional[str] = None, expected_version: int = 0,
                       bias: Any = None) -> HeadInfo:
        """Replaces the head's weight [vocab, hidden] (numpy or torch, of the head's dtype), and with
        `bias` [vocab] (a head with a bias) its bias; without, the bias stays."""
        b = None if bias is None else np.ascontiguousarray(
            bias.detach().to("cpu", copy=True).float().numpy() if hasattr(bias, "detach") else bias,
            dtype=np.float32).reshape(-1)
        w = A.host_hidden(weight)
        if len(w.lead_shape) != 1:
            raise ValueError("weight must be [vocab, hidden]")
        row_bytes = w.hidden_size * w.array.itemsize
        step = max(1, self.chunk_bytes // max(1, row_bytes))
        buf = w.byte_view()

        def gen():
            yield pb.UpdateWeightsRequest(header=pb.UpdateWeightsHeader(
                head=self._head(head), expected_version=expected_version, bias=[] if b is None else b.tolist()))
            for r0 in range(0, w.rows, step):
                r1 = min(w.rows, r0 + step)
                yield pb.UpdateWeightsRequest(chunk=pb.TensorChunk(
                    first_row=r0, rows=r1 - r0, cols=w.hidden_size, rows_total=w.rows, dtype=w.wire_dtype,
                    data=bytes(buf[r0 * row_bytes:r1 * row_bytes])))

        try:
            r = self._front.stub.UpdateWeights(gen(), timeout=self.timeout, metadata=self._admin_metadata)
        except grpc.RpcError as e:
            raise _wrap(e, "UpdateWeights") from e
        return HeadInfo._from(r)

    def save_head(self, directory: str, head: Optional[str] = None):
        r = self._unary("SaveHead", pb.SaveHeadRequest(head=self._head(head), directory=directory))
        return list(r.files), r.index_file

    # --------------------------------------------------------------------------------- streaming
    # ---------------------------------------------------------------------------------- internals
    def _run(self, rpc: str, h, targets, header, per_row: dict, finish, **kw):
        """A computation's call, its answers turned into the result by `finish` (lce_client.aio's
        Client runs the same on asyncio and returns a coroutine)."""
        return finish(self._stream(rpc, h, targets, header, per_row, **kw))

    def _stream_stub(self, i: int, replica: Optional["_Replica"] = None):
        """The stub of a replica's (default: the first's) i-th extra channel for the parts of split
        requests (made on first use). Each is its own TCP connection: the channels differ in an argument
        and use no shared subchannel."""
        r = replica or self._replicas[0]
        with self._lock:
            while len(r.part_stubs) <= i:
                k = len(r.part_stubs)
                ch = self._new_channel(r.target, r.channel_options + [("grpc.use_local_subchannel_pool", 1),
                                                                      ("lce.stream_channel", k)])
                r.part_channels.append(ch)
                r.part_stubs.append(pb_grpc.LceServiceStub(ch))
            return r.part_stubs[i]

    def _plan_parts(self, n: int, row_bytes: int, step: int, streams: Optional[int]) -> List[tuple]:
        """Contiguous row ranges [(r0, r1), ...] for the parts of a request: up to `streams`, each of
        at least min_stream_bytes of hidden states, cut at multiples of the chunk rows (`step`, from
        chunk_bytes alone, as the C++ client's PlanStreams) where the chunks allow it. Each part is then
        chunked on its own rows (_plan_part): with first_chunk_bytes / last_chunk_bytes every part has
        its own smaller first and last chunk. One range (no split) for small requests."""
        k = self.streams if streams is None else int(streams)
        if k < 1:
            raise ValueError(f"streams must be >= 1, got {streams!r}")
        total = n * row_bytes
        if self.min_stream_bytes > 0:
            k = min(k, total // self.min_stream_bytes)
        k = min(k, n)
        while k > 1:
            nchunks = -(-n // step)
            if nchunks >= k:
                # Whole chunks per part; the later parts take the spare ones (the last chunk may be short).
                base, extra = divmod(nchunks, k)
                bounds, c = [], 0
                for i in range(k):
                    c += base + (1 if i >= k - extra else 0)
                    bounds.append(min(n, c * step))
            else:  # chunks larger than a part: split the rows evenly
                bounds = [n * (i + 1) // k for i in range(k)]
            parts = list(zip([0] + bounds[:-1], bounds))
            if min(r1 - r0 for r0, r1 in parts) * row_bytes >= self.min_stream_bytes:
                return parts
            k -= 1
        return [(0, n)]

    def _stream(self, rpc: str, h, targets: np.ndarray, header: pb.RequestHeader, per_row: dict, **kw) -> dict:
        """A streaming call: on the front when it accumulates the weight gradient or names a session's
        regions; otherwise on the replicas in turn, sent again whole on UNAVAILABLE (max_attempts)."""
        call = functools.partial(self._stream_on, rpc=rpc, h=h, targets=targets, header=header, per_row=per_row, **kw)
        if header.accumulate_weight_grad or kw.get("hidden_region") is not None or \
                kw.get("d_hidden_region") is not None:
            return call(self._front)
        failed: set = set()
        backoff = self.retry_backoff
        with self._lock:
            start = self._next_replica
            self._next_replica += 1
        for attempt in range(1, self.max_attempts + 1):
            replica = self._pick_replica(start, failed)
            try:
                return call(replica)
            except LceError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE or attempt == self.max_attempts:
                    if attempt > 1:
                        e.annotate(f"{rpc} tried {attempt} times over {len(self._replicas)} replica(s)")
                    raise
                failed.add(id(replica))
                replica.failed_at = time.monotonic()
            time.sleep(backoff)
            backoff = min(2 * backoff, 1.0)
        raise AssertionError("unreachable")

    def _pick_replica(self, start: int, failed: set) -> "_Replica":
        """The replica for a scoring call's next attempt: from the call's turn `start` on, the first that
        has not failed this call (`failed`: ids), preferring one that has not failed any call in the last
        second; the call's own turn again once all have failed."""
        n = len(self._replicas)
        order = [self._replicas[(start + k) % n] for k in range(n)]
        fresh = [r for r in order if id(r) not in failed]
        now = time.monotonic()
        healthy = [r for r in fresh if now - r.failed_at >= _REPLICA_COOLDOWN]
        return (healthy or fresh or order)[0]

    def _stream_on(self, replica: "_Replica", want_dhidden: bool, progress, use_tqdm, *, rpc: str, h,
                   targets: np.ndarray, header: pb.RequestHeader, per_row: dict,
                   hidden_region: Optional[Region] = None, d_hidden_region: Optional[Region] = None,
                   d_hidden_offset: int = 0, streams: Optional[int] = None,
                   expect_valid: Optional[int] = None) -> dict:
        """One attempt of a computation on `replica`: where its answers go, its rows cut into parts, the
        data plane taken where the client has one, the parts sent and their answers placed."""
        if d_hidden_region is not None and not want_dhidden:
            raise ValueError(f"{rpc} returns no d_hidden: d_hidden_region does not apply")
        at = self._placement(h, int(header.top_k), want_dhidden, hidden_region, d_hidden_region, d_hidden_offset)
        n = h.rows
        if n == 0:
            # The server refuses requests without rows; an empty batch has an empty answer (and a loss
            # of 0, as a mean over no valid tokens is defined to be), so answer it here without an RPC.
            at.out["summary"] = pb.RequestSummary(rows=0, valid_tokens=0, loss=0.0)
            return at.out
        _wait_for_cuda_work(hidden_region, d_hidden_region)
        row_bytes = h.hidden_size * h.itemsize
        # Over the data plane the bytes go through server memory and the messages name slices of it.
        dp = replica.data_plane
        if hidden_region is not None or d_hidden_region is not None:
            dp = None
        if streams is None and dp is not None:
            streams = min(self.streams, self.data_plane_streams)
        parts = self._plan_parts(n, row_bytes, self._rows_per_chunk(h), streams)
        prog = _Progress(n, progress, use_tqdm, rpc) if (progress or use_tqdm) else None
        try:
            routes = self._take_data_plane(replica, dp, at, len(parts), n * row_bytes, want_dhidden)
        except BaseException:
            if prog is not None:
                prog.close()
            raise
        try:
            at.out["summary"] = self._send_parts(replica, parts, header, prog, expect_valid, routes,
                                                 (rpc, h, targets, per_row, at.hidden_at, at.d_hidden_at,
                                                  at.metadata, at.out, at.dh_bytes))
        except BaseException:
            if dp is not None:
                dp.reset()  # the server may have gone, a socket be mid-transfer: start afresh next time
            raise
        finally:
            if dp is not None:
                dp.lock.release()
            if prog is not None:
                prog.close()
        return at.out

    def _placement(self, h, top_k: int, want_dhidden: bool, hidden_region: Optional[Region],
                   d_hidden_region: Optional[Region], d_hidden_offset: int) -> "_Placement":
        """Where a request's hidden states are read and its answers written: the outputs (d_hidden in the
        caller's region, or a new array), and the regions' session in the metadata."""
        n = h.rows
        at = _Placement(out=self._new_outputs(n, top_k), metadata=self._metadata)
        if hidden_region is not None or d_hidden_region is not None:
            sessions = {(r.session_id, r.session_secret) for r in (hidden_region, d_hidden_region) if r is not None}
            if len(sessions) != 1:
                raise ValueError("hidden_region and d_hidden_region must belong to one session")
            at.metadata = tuple(self._metadata or ()) + _session_metadata(*sessions.pop())
            if hidden_region is not None:
                at.hidden_at = (hidden_region.id, hidden_region.offset_of(
                    h.tensor if isinstance(h, A.DeviceArray) else h.array))
        if not want_dhidden:
            return at
        if d_hidden_region is not None and d_hidden_region.is_cuda:
            at.out["d_hidden"] = d_hidden_region.tensor_view((n, h.hidden_size), A.torch_dtype(h.wire_dtype),
                                                             d_hidden_offset)
            at.d_hidden_at = (d_hidden_region.id, d_hidden_offset)
        elif d_hidden_region is not None:
            at.out["d_hidden"] = d_hidden_region.ndarray((n, h.hidden_size), A.storage_dtype(h.wire_dtype),
                                                         d_hidden_offset)
            at.d_hidden_at = (d_hidden_region.id, d_hidden_offset)
        else:
            at.out["d_hidden"] = A.new_hidden_out(n, h.hidden_size, h.wire_dtype)
            at.dh_bytes = at.out["d_hidden"].reshape(-1).view(np.uint8)
        return at

    def _take_data_plane(self, replica: "_Replica", dp: Optional[DataPlane], at: "_Placement", parts: int,
                         hidden_bytes: int, want_dhidden: bool) -> Optional[List[Route]]:
        """Takes the replica's data plane (`dp`; None: the bytes go in the messages) for a request: its
        lock (calls over the data plane take turns: they share its regions and sockets; the caller
        releases it), its regions sized, and `at` pointed at them. Returns the parts' routes."""
        if dp is None:
            return None
        dp.lock.acquire()
        try:
            routes = dp.prepare(lambda: self._data_port(replica), lambda: self._data_plane_session(replica),
                                parts, hidden_bytes, want_dhidden)
        except BaseException:
            dp.reset()
            dp.lock.release()
            raise
        at.metadata = tuple(self._metadata or ()) + _session_metadata(routes[0].session_id, routes[0].session_secret)
        at.hidden_at = (routes[0].hidden_region, 0)
        if want_dhidden:
            at.d_hidden_at = (routes[0].d_hidden_region, 0)
        return routes

    def _send_parts(self, replica: "_Replica", parts, header, prog, expect_valid, routes, args):
        """The request's parts sent: one on this thread, or several at once (_run_parts). Returns the
        request's summary."""
        n = parts[-1][1]
        if len(parts) == 1:
            on_rows = (lambda r1, rows: prog.update(r1, rows)) if prog is not None else None
            return self._run_part(replica.stub, header, 0, n, on_rows, None, *args,
                                  route=routes[0] if routes else None)
        return self._run_parts(replica, parts, header, prog, expect_valid, *args, routes=routes)

    def _data_port(self, replica: "_Replica") -> Tuple[int, bool]:
        """The replica's data-plane port (0: none), and whether it speaks TLS."""
        info = self._unary("GetInfo", pb.GetInfoRequest(), replica.stub)
        return int(info.data_port), bool(info.data_plane_tls)

    def _data_plane_session(self, replica: "_Replica") -> SharedMemorySession:
        """The session that holds a replica's data-plane regions: no deadline, it lives as long as the client."""
        return SharedMemorySession(replica.stub, self._metadata)

    def _run_part(self, stub, header, begin, end, on_rows, on_call, rpc, h, targets, per_row, hidden_at,
                  d_hidden_at, metadata, out, dh_bytes, route: Optional[Route] = None):
        """One stream: rows [begin, end) of the request, answers written into `out` at their rows.
        Returns the RequestSummary (or None). on_rows(done_in_part, rows) per answered chunk; on_call(call)
        once the call exists (to cancel it from elsewhere). With `route` (data plane) the hidden states
        are written into server memory by one thread per upload socket (UploadState), each chunk's
        message sent once its bytes are in, and each chunk's d_hidden is read out of it as the chunk's
        answer arrives. The uploaders are stopped and joined before this returns or raises."""
        n = end - begin
        row_bytes = h.hidden_size * h.itemsize
        plan = [(begin + r0, rows) for r0, rows in
                self._plan_part(n, row_bytes, region_backed=hidden_at is not None and route is None,
                                d_hidden_back=d_hidden_at is not None or dh_bytes is not None)]
        uploads = None
        if route is not None:
            buf = h.byte_view()
            uploads = UploadState(route, [(hidden_at[1] + r0 * row_bytes, buf[r0 * row_bytes:(r0 + rows) * row_bytes])
                                          for r0, rows in plan])
        failed = True
        try:
            summary = self._read_part(stub, header, begin, n, on_rows, on_call, rpc, h, targets, per_row, hidden_at,
                                      d_hidden_at, metadata, out, dh_bytes, route, plan, uploads)
            failed = False
            return summary
        finally:
            if uploads is not None:  # on failure the lane's upload sockets are shut down (it is dropped after)
                uploads.stop(abort=failed)

    def _read_part(self, stub, header, begin, n, on_rows, on_call, rpc, h, targets, per_row, hidden_at, d_hidden_at,
                   metadata, out, dh_bytes, route, plan, uploads):
        """_run_part's call: sends the part's requests and places its answers."""
        row_bytes = h.hidden_size * h.itemsize
        requests = self._requests(h, targets, header, per_row, plan, hidden_at, d_hidden_at, uploads)
        answers = None
        if len(plan) == 1 and uploads is None and on_call is None and id(stub) not in self._streams_only:
            answers = self._call(stub, rpc, requests, metadata)
        call = None
        if answers is None:
            if len(plan) == 1:  # the one-message path was refused: the stream gets messages made afresh
                requests = self._requests(h, targets, header, per_row, plan, hidden_at, d_hidden_at, uploads)
            call = getattr(stub, rpc)(requests, timeout=self.timeout, metadata=metadata)
            answers = call
        if uploads is not None:
            uploads.attach(call)
            uploads.start()
        if on_call is not None:
            on_call(call)
        try:
            summary, answered = self._place_answers(answers, begin, n, out, dh_bytes, row_bytes, rpc, header, route,
                                                    d_hidden_at, on_rows)
        except grpc.RpcError as e:
            if uploads is not None and uploads.error is not None:  # the CANCELLED is the failed upload's doing
                raise uploads.error from e
            raise _wrap(e, rpc) from e
        except BaseException:
            if call is not None:
                call.cancel()
            raise
        if uploads is not None and uploads.error is not None:
            raise uploads.error
        self._check_answered(answered, n, rpc)
        return summary

    def _call(self, stub, rpc, requests, metadata):
        """A request of one chunk as one Call (one message each way: no stream to set up, no round trip
        per message). Its answers as the stream's messages, or None where the server has no Call (then
        this stub streams from now on)."""
        req = self._call_request(rpc, next(requests).header, next(requests).chunk)
        try:
            resp = stub.Call(req, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older server; if the stream refuses too, it says why
                self._streams_only.add(id(stub))
                return None
            raise _wrap(e, rpc) from e
        return call_answers(resp)

    def _run_parts(self, replica, parts, header, prog, expect_valid, rpc, *args, routes: Optional[List[Route]] = None):
        """A request split over len(parts) streams (header.partial), one thread and one channel each.
        The first failing part cancels the others; its error is raised once all have stopped. Progress
        is reported from the calling thread. Returns the parts' summaries combined (or None)."""
        run = _Parts(len(parts))
        headers = _part_headers(header, len(parts))

        def worker(i, r0, r1, stub, hdr):
            try:
                s = self._run_part(stub, hdr, r0, r1, lambda done, rows: run.events.put(("rows", rows)),
                                   functools.partial(run.on_call, i), rpc, *args, route=routes[i] if routes else None)
                run.events.put(("done", i, s))
            except BaseException as e:  # handed to the calling thread
                run.events.put(("error", i, e))

        run.threads = [threading.Thread(target=worker, args=(i, r0, r1, self._stream_stub(i, replica), headers[i]),
                                        name=f"lce-{rpc}-part{i}", daemon=True)
                       for i, (r0, r1) in enumerate(parts)]
        try:
            for t in run.threads:
                t.start()
            summaries, error = run.collect(prog)
        except BaseException:  # e.g. KeyboardInterrupt, or the progress callback raised
            run.cancel_all()
            # The parts stop at once (their calls are cancelled); wait for them, so that none is still
            # using the data plane's sockets, or its uploaders, once the caller gets the error.
            run.join_started()
            raise
        run.join_started()
        if error is not None:
            raise error
        if all(s is None for s in summaries):
            return None
        return _combine_summaries(rpc, parts, summaries, expect_valid)


def _part_headers(header: pb.RequestHeader, n: int) -> List[pb.RequestHeader]:
    """Each part's header: partial, and where the request accumulates dW one split_id for all n, so that
    its parts fill one contribution on the server, added only when every part succeeds."""
    split_id = 0
    while header.accumulate_weight_grad and split_id == 0:
        split_id = secrets.randbits(64)
    headers = []
    for _ in range(n):
        hdr = pb.RequestHeader()
        hdr.CopyFrom(header)
        hdr.partial = True
        if split_id:
            hdr.split_id = split_id
            hdr.split_parts = n
        headers.append(hdr)
    return headers


class _Parts:
    """The streams of one split request (Client._run_parts): their threads, the events they send the
    calling thread ("rows", "done" or "error"), and their calls, cancelled together."""

    def __init__(self, n: int):
        self.events: "queue.Queue" = queue.Queue()
        self.threads: List[threading.Thread] = []
        self._lock = threading.Lock()
        self._calls: list = [None] * n
        self._stopping = False

    def on_call(self, i: int, call) -> None:
        """Part i's call has started: kept to cancel, or cancelled now if the request is stopping."""
        with self._lock:
            self._calls[i] = call
            stop = self._stopping
        if stop:
            call.cancel()

    def cancel_all(self) -> None:
        with self._lock:
            self._stopping = True
            live = [c for c in self._calls if c is not None]
        for c in live:
            c.cancel()

    def collect(self, prog) -> Tuple[list, Optional[BaseException]]:
        """The parts' events until every part has ended: their summaries and the first error (which
        cancels the others); rows done go to `prog` until then."""
        summaries: list = [None] * len(self._calls)
        error: Optional[BaseException] = None
        remaining, done = len(summaries), 0
        while remaining:
            try:
                ev = self.events.get(timeout=0.25)
            except queue.Empty:
                continue
            if ev[0] == "rows":
                done += ev[1]
                if prog is not None and error is None:
                    prog.update(done, ev[1])
            elif ev[0] == "done":
                remaining -= 1
                summaries[ev[1]] = ev[2]
            else:
                remaining -= 1
                if error is None:
                    error = ev[2]
                    self.cancel_all()
        return summaries, error

    def join_started(self) -> None:
        for t in self.threads:
            if t.ident is not None:  # (started)
                t.join()


@dataclass
class _Placement:
    """Where one request's bytes are read and its answers written (Client._placement)."""

    out: dict                                     # _ClientBase._new_outputs
    metadata: Optional[tuple]                     # the call's (with a session's id and secret)
    hidden_at: Optional[Tuple[int, int]] = None   # (region id, offset) of the hidden states
    d_hidden_at: Optional[Tuple[int, int]] = None  # (region id, offset) d_hidden is written to
    dh_bytes: Optional[np.ndarray] = None         # out["d_hidden"]'s bytes, where it comes in the answers


def _wait_for_cuda_work(*regions: Optional[Region]) -> None:
    """The server's GPU reads (and writes) CUDA regions: the caller's queued work on them goes first."""
    devices = {r.tensor.device for r in regions if r is not None and r.is_cuda and r.tensor is not None}
    if devices:
        import torch

        for dev in devices:
            torch.cuda.current_stream(dev).synchronize()


def _session_metadata(session_id: str, secret: str) -> tuple:
    """The metadata of a request that names a session's regions: the session's id and its secret (the
    server opens the regions to neither alone)."""
    return ((SESSION_METADATA_KEY, session_id), (SESSION_SECRET_METADATA_KEY, secret))


def _warn_on_other_major(server_version: str) -> None:
    """Warns (once a client) where the server's major version is not this package's: the API may
    differ (docs/API.md)."""
    from . import _version

    theirs, ours = _version.major(server_version), _version.major(_version.VERSION)
    if theirs and theirs != ours:
        import warnings

        warnings.warn(f"lce_server {server_version} is of another major version than lce_client {_version.VERSION}: "
                      "calls may be refused or answered differently", RuntimeWarning, stacklevel=3)


def _server_info(r: pb.GetInfoResponse) -> ServerInfo:
    return ServerInfo(head=HeadInfo._from(r.head), heads=[HeadInfo._from(h) for h in r.heads], backend=r.backend,
                      tp_size=r.tp_size, max_message_bytes=r.max_message_bytes,
                      max_rows_per_request=r.max_rows_per_request, server_version=r.server_version,
                      data_port=r.data_port, data_plane_tls=r.data_plane_tls,
                      invariant_across_batches=list(r.invariance.across_batches),
                      invariant_across_tp_sizes=list(r.invariance.across_tp_sizes))


class _Replica:
    """One server (or, with round_robin, one name): its channel and stub, the extra channels of split
    requests (made on first use), its data plane, and when a call on it last failed with UNAVAILABLE."""

    def __init__(self, client: Client, target: str, channel_options: list, data_plane: bool):
        self.target = target
        self.channel_options = list(channel_options)
        self.channel = client._new_channel(target, self.channel_options)
        self.stub = pb_grpc.LceServiceStub(self.channel)
        self.part_channels: list = []
        self.part_stubs: list = []
        self.data_plane: Optional[DataPlane] = (DataPlane(target, client.data_plane_sockets, client._root_certificates)
                                                if data_plane else None)
        self.failed_at = -math.inf

    def close(self, lock: threading.Lock) -> None:
        """Closes the channels, and the data plane's sockets and session (the server frees its regions)."""
        dp = self.data_plane
        if dp is not None and dp.lock.acquire(blocking=False):
            try:  # idle: end the session cleanly while its channel is still open
                dp.close_locked()
            finally:
                dp.lock.release()
            dp = None
        self.channel.close()
        with lock:
            chans, self.part_channels, self.part_stubs = self.part_channels, [], []
        for ch in chans:
            ch.close()
        if dp is not None:  # a call was using it: closing the channels ended that call, and it let go
            dp.close()


# How long a replica that failed with UNAVAILABLE is passed over by scoring calls (seconds).
_REPLICA_COOLDOWN = 1.0
_TRAINING_RPCS = frozenset({"LoadHead", "ZeroGrad", "GetGrad", "OptimizerStep", "UpdateWeights", "SaveHead"})


def _replica_targets(target, load_balancing: Optional[str]) -> List[str]:
    """The replicas' targets: a list, or a string split at commas (one name, unsplit, for round_robin)."""
    if load_balancing not in (None, "", "round_robin"):
        raise ValueError(f"load_balancing must be None or 'round_robin', got {load_balancing!r}")
    if isinstance(target, str):
        targets = [target] if load_balancing else target.split(",")
    else:
        targets = list(target)
    targets = [t.strip() if isinstance(t, str) else t for t in targets]
    if not targets or any(not isinstance(t, str) or not t for t in targets):
        raise ValueError(f"target must be 'host:port', several of them (a list or comma-separated), or a name; "
                         f"got {target!r}")
    if load_balancing and len(targets) != 1:
        raise ValueError("load_balancing='round_robin' takes one target name (e.g. dns:///fronts:50051), not a list")
    return targets


_POLICY_STATS = ("clip_fraction", "approx_kl", "mean_entropy", "mean_ratio", "mean_kl")


def _combine_summaries(rpc: str, parts, summaries, expect_valid: Optional[int]) -> pb.RequestSummary:
    """The RequestSummary of a split request from its parts': losses add up (each part's is its share of
    the whole request's), PolicyLoss statistics are means over each part's valid tokens. Checks that the
    parts' valid tokens add up to the declared count and that all ran on one head version."""
    for i, s in enumerate(summaries):
        if s is None:
            r0, r1 = parts[i]
            raise LceError(grpc.StatusCode.INTERNAL, f"server ended the part of rows {r0}..{r1 - 1} without a summary",
                           rpc)
    valid = [int(s.valid_tokens) for s in summaries]
    total = sum(valid)
    if expect_valid is not None and total != expect_valid:
        detail = ", ".join(f"rows {r0}..{r1 - 1}: {v}" for (r0, r1), v in zip(parts, valid))
        raise LceError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"the request was split over {len(parts)} streams whose valid tokens add up to {total} "
                       f"({detail}), but {expect_valid} were declared (num_valid_tokens / "
                       "sequence_valid_tokens); the loss and d_hidden are wrong, discard them", rpc)
    versions = sorted({int(s.head_version) for s in summaries})
    if len(versions) != 1:
        raise LceError(grpc.StatusCode.ABORTED,
                       f"the parts of the split request ran on different head versions {versions} (the head was "
                       "updated meanwhile); pin head_version or retry", rpc)
    out = pb.RequestSummary(rows=sum(int(s.rows) for s in summaries), valid_tokens=total,
                            loss=math.fsum(s.loss for s in summaries), head_version=versions[0],
                            pending_grad_ids=list(dict.fromkeys(i for s in summaries for i in s.pending_grad_ids)))
    if rpc == "PolicyLoss":
        for name in _POLICY_STATS:
            val = math.fsum(getattr(s, name) * v for s, v in zip(summaries, valid)) / total if total else 0.0
            setattr(out, name, val)
    return out
