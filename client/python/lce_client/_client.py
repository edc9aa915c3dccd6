"""lce_client.Client: the gRPC client of lce.v1.LceService."""
from __future__ import annotations

import functools
import math
import numbers
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import _arrays as A
from ._proto import lce_pb2 as pb
from ._proto import lce_pb2_grpc as pb_grpc
from ._data_plane import MAX_SOCKETS as _MAX_DATA_PLANE_SOCKETS
from ._errors import LceError, _wrap
from ._data_plane import DataPlane, Route, UploadState
from ._shm import SESSION_METADATA_KEY, SESSION_SECRET_METADATA_KEY, Region, SharedMemorySession

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_MIN_STREAM_BYTES = 8 << 20
# Replies carry d_hidden of a whole request chunk; let them be as large as the server allows.
_MAX_RECV = 1 << 30

ProgressFn = Callable[[int, int], None]


def plan_chunks(rows: int, row_bytes: int, chunk_bytes: int, first_chunk_bytes: int = 0,
                last_chunk_bytes: int = 0, grow: bool = False) -> List[Tuple[int, int]]:
    """Plans the chunks of a batch (the C++ client's PlanChunks): [(first_row, rows), ...] of at most
    max(1, chunk_bytes // row_bytes) rows each, tiling range(rows) in order; with first_chunk_bytes > 0
    the first chunk holds at most max(1, first_chunk_bytes // row_bytes) rows, and with
    last_chunk_bytes > 0 the last one at most max(1, last_chunk_bytes // row_bytes) rows (where the
    batch has more rows than those two chunks). Neither is ever larger than a full chunk. With `grow`,
    each chunk after the first holds twice the rows of the one before, up to a full chunk, and once
    the rows left (before the last chunk) fit in a full chunk, one chunk takes them all."""
    rows, row_bytes, chunk_bytes = int(rows), int(row_bytes), int(chunk_bytes)
    per = max(1, chunk_bytes // row_bytes if row_bytes > 0 else rows)

    def edge(b: int) -> int:
        return min(per, max(1, b // row_bytes if row_bytes > 0 else rows)) if b > 0 else per

    first = edge(int(first_chunk_bytes))
    # A smaller last chunk only where the rows go past the first chunk and one more.
    last_cap = edge(int(last_chunk_bytes))
    last = last_cap if last_chunk_bytes > 0 and rows > first + last_cap else 0
    plan: List[Tuple[int, int]] = []
    r, size = 0, first
    while r < rows - last:
        # Growing: once what is left fits in a full chunk, one chunk takes it (one engine call fewer
        # than a doubling that would leave a small remainder).
        left = rows - last - r
        n = left if grow and r > 0 and left <= per else min(size, left)
        plan.append((r, n))
        r += n
        size = min(per, 2 * size) if grow else per
    if last > 0:
        plan.append((rows - last, last))
    return plan


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


@dataclass
class ForwardBackwardResult:
    """ForwardBackward's answer. `loss` is the reduced loss (mean or sum of loss_i, as a float);
    `per_token_loss` is fp32 per row (0 for ignored rows), `d_hidden` the gradient of the reduced
    loss (for reduction "none": of sum_i grad_loss_i * loss_i) w.r.t. hidden, in the caller's kind,
    dtype and device."""

    loss: float
    per_token_loss: Any
    d_hidden: Any
    valid_tokens: int
    rows: int
    head_version: int
    logprobs: Any = None
    entropy: Any = None
    # defer_weight_grad: the ids of the request's pending dW contributions (one a stream), for
    # Client.commit_grad.
    pending_grads: Tuple[int, ...] = ()
    # return_z_loss: the z-loss part of per_token_loss; argmax / top_k: as ScoreResult's.
    z_loss: Any = None
    argmax: Any = None
    top_tokens: Any = None
    top_logprobs: Any = None


@dataclass
class ScoreResult:
    """Client.score's answer when it ranks tokens (argmax=True or top_k > 0): per-row fp32 `logprobs`
    and `entropy` (None without entropy=True), `argmax` (int32, the most probable token), and with
    top_k the [..., k] `top_tokens` (int32, most probable first) and their `top_logprobs`. Unpacks as
    (logprobs, entropy), as score's plain answer does."""

    logprobs: Any
    entropy: Any
    argmax: Any = None
    top_tokens: Any = None
    top_logprobs: Any = None

    def __iter__(self):
        return iter((self.logprobs, self.entropy))


def token_accuracy(argmax, targets, ignore_index: int = -100) -> float:
    """The fraction of rows whose target is not ignore_index and whose argmax is their target (0.0 when
    every row is ignored): Liger's token accuracy."""
    a, t = np.asarray(_as_numpy(argmax)).reshape(-1), np.asarray(_as_numpy(targets)).reshape(-1)
    valid = t != ignore_index
    n = int(np.count_nonzero(valid))
    return float(np.count_nonzero((a == t) & valid)) / n if n else 0.0


def _as_numpy(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def _ranking_outputs(argmax: bool, top_k: int) -> list:
    if not isinstance(top_k, int) or not 0 <= top_k <= 64:
        raise ValueError(f"top_k must be an int in [0, 64], got {top_k!r}")
    return ([pb.OUTPUT_ARGMAX] if argmax or top_k else []) + ([pb.OUTPUT_TOP_K] if top_k else [])


def _rankings(res: dict, h, top_k: int):
    """(argmax, top_tokens, top_logprobs) in the caller's kind and row shape ([..., k] for top-k)."""
    am = A.to_caller_rows(res["argmax"], h)
    if not top_k:
        return am, None, None
    return am, A.to_caller_topk(res["top_tokens"], h), A.to_caller_topk(res["top_logprobs"], h)


@dataclass
class BackwardResult:
    """Client.backward's answer when it adds the head's dW: d_hidden, and with defer_weight_grad the
    ids of its pending contributions (Client.commit_grad, Client.get_grad(pending_grad=...))."""

    d_hidden: Any
    pending_grads: Tuple[int, ...] = ()


@dataclass
class PolicyLossResult:
    loss: float
    d_hidden: Any
    logprobs: Any
    entropy: Any
    valid_tokens: int
    clip_fraction: float
    approx_kl: float
    mean_entropy: float
    mean_ratio: float
    mean_kl: float
    head_version: int
    pending_grads: Tuple[int, ...] = ()


_REDUCTIONS = {"none": pb.REDUCTION_NONE, "sum": pb.REDUCTION_SUM, "mean": pb.REDUCTION_MEAN}
_AGGREGATIONS = {
    "token-mean": pb.AGGREGATION_TOKEN_MEAN,
    "seq-mean-token-sum": pb.AGGREGATION_SEQ_MEAN_TOKEN_SUM,
    "seq-mean-token-mean": pb.AGGREGATION_SEQ_MEAN_TOKEN_MEAN,
}
_KL = {"k1": pb.KL_ESTIMATOR_K1, "k3": pb.KL_ESTIMATOR_K3}


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


def call_answers(resp: pb.CallResponse) -> list:
    """A Call's answer as the stream's messages would have been: the chunk, then the summary if any."""
    answers = [pb.StreamResponse(chunk=resp.chunk)]
    if resp.HasField("summary"):
        answers.append(pb.StreamResponse(summary=resp.summary))
    return answers


class Client:
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
      options: extra grpc channel options.
      streams: split one score / forward_backward / backward / policy_loss call over up to this many
        concurrent streams, each on its own channel (TCP connection), when its hidden states are
        large: contiguous row ranges of at least `min_stream_bytes` each, sent as parts
        (RequestHeader.partial) and combined here. 1 (the default) never splits; each call may
        override it with `streams=`. Results equal the unsplit call's (the reduced loss up to
        float64 rounding of the parts' sum).
      min_stream_bytes: the least hidden-state bytes of one part (default 8 MiB).
      data_plane: remote clients: move hidden states and d_hidden over the server's data plane (plain
        TCP beside gRPC, on the port GetInfo names; lce_server --data-port) instead of inside the gRPC
        messages, which then name slices of server memory as co-located requests name slices of shared
        memory. HTTP/2 framing and protobuf copies of the bulk bytes go away; answers are the same. The
        first such call opens a session holding two server-memory regions sized to the batch (grown
        when a batch is larger, reused otherwise); each chunk is written before its message is sent and
        its d_hidden read as its answer arrives, so transfer and compute overlap. Calls over the data
        plane take turns. A server without one: LceError FAILED_PRECONDITION. Calls given
        hidden_region / d_hidden_region, and those that accumulate the weight gradient, do not use it.
        Every transfer shows the session's secret. A server started with --data-plane-tls gets TLS
        sockets, its certificate checked against root_certificates (else the system's roots).
      data_plane_sockets: sockets per direction per stream on the data plane, in [1, 16]: each chunk's
        bytes are split over them in page-aligned shares (below 64 KiB all on the first): each
        stream uploads with a thread per socket that moves its share of every chunk in turn, without
        waiting for the other sockets, and a chunk's message goes once all its shares are in.
    """

    def __init__(
        self,
        target: Union[str, Sequence[str]],
        *,
        timeout: Optional[float] = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        root_certificates: Optional[bytes] = None,
        private_key: Optional[bytes] = None,
        certificate_chain: Optional[bytes] = None,
        tls: Optional[bool] = None,
        token: Optional[str] = None,
        head: str = "",
        options: Sequence = (),
        streams: int = 1,
        min_stream_bytes: int = DEFAULT_MIN_STREAM_BYTES,
        data_plane: bool = False,
        data_plane_sockets: int = 4,
        first_chunk_bytes: int = 0,
        last_chunk_bytes: int = 0,
        grow_chunks: bool = False,
        load_balancing: Optional[str] = None,
        max_attempts: Optional[int] = None,
        retry_backoff: float = 0.05,
        admin_token: Optional[str] = None,
    ):
        targets = _replica_targets(target, load_balancing)
        if max_attempts is None:
            max_attempts = 3 if len(targets) > 1 or load_balancing else 1
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, numbers.Integral) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        if not retry_backoff >= 0:
            raise ValueError(f"retry_backoff must be >= 0, got {retry_backoff!r}")
        if data_plane and load_balancing:
            raise ValueError("data_plane needs the replicas listed in `target`, not a round_robin name (a "
                             "data-plane session lives on one server)")
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        for name, v in (("first_chunk_bytes", first_chunk_bytes), ("last_chunk_bytes", last_chunk_bytes)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0: off), got {v!r}")
        if int(streams) < 1:
            raise ValueError("streams must be >= 1")
        if min_stream_bytes < 0:
            raise ValueError("min_stream_bytes must be >= 0")
        if isinstance(data_plane_sockets, bool) or not isinstance(data_plane_sockets, numbers.Integral) or \
                not 1 <= data_plane_sockets <= _MAX_DATA_PLANE_SOCKETS:
            raise ValueError(f"data_plane_sockets must be an integer in [1, {_MAX_DATA_PLANE_SOCKETS}], "
                             f"got {data_plane_sockets!r}")
        self.targets = targets
        self.target = targets[0]  # the front (with round_robin: the name)
        self.load_balancing = load_balancing or None
        self.timeout = timeout
        self.max_attempts = int(max_attempts)
        self.retry_backoff = float(retry_backoff)
        self.chunk_bytes = int(chunk_bytes)
        self.first_chunk_bytes = int(first_chunk_bytes)
        self.last_chunk_bytes = int(last_chunk_bytes)
        self.grow_chunks = bool(grow_chunks)
        self.head = head
        self.streams = int(streams)
        self.min_stream_bytes = int(min_stream_bytes)
        self._options = [
            ("grpc.max_receive_message_length", _MAX_RECV),
            ("grpc.max_send_message_length", _MAX_RECV),
        ] + list(options)
        secure = tls if tls is not None else any(x is not None for x in (root_certificates, private_key, certificate_chain))
        self._creds = None
        self._root_certificates = _as_bytes(root_certificates)  # also for a TLS data plane
        if secure:
            self._creds = grpc.ssl_channel_credentials(
                root_certificates=_as_bytes(root_certificates),
                private_key=_as_bytes(private_key),
                certificate_chain=_as_bytes(certificate_chain),
            )
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._admin_metadata = (("authorization", f"Bearer {admin_token}"),) if admin_token else self._metadata
        self._info_cache: dict = {}
        self._version_checked = False  # info() warns once on another major version
        self._lock = threading.Lock()
        self.data_plane_sockets = int(data_plane_sockets)
        lb = [("grpc.lb_policy_name", "round_robin")] if load_balancing else []
        self._replicas = [_Replica(self, t, lb, data_plane) for t in targets]
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
                  clone_of: Optional[str] = None, seeded: Optional[tuple] = None) -> HeadInfo:
        """Adds or replaces a head: from a safetensors file on the server, a clone of another head, or
        a seeded random head `seeded=(vocab, hidden, seed, dtype)`."""
        req = pb.LoadHeadRequest(name=name, tensor=tensor)
        if safetensors_file is not None:
            req.safetensors_file = safetensors_file
        elif clone_of is not None:
            req.clone_of = clone_of
        elif seeded is not None:
            v, h, s, d = seeded
            req.seeded.CopyFrom(pb.SeededHead(vocab_size=v, hidden_size=h, seed=s, dtype=A.parse_dtype(d)))
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

    def get_grad(self, head: Optional[str] = None, pending_grad: Optional[int] = None) -> np.ndarray:
        """The head's accumulated fp32 gradient dW [vocab, hidden] as numpy; with `pending_grad`, that
        pending contribution's instead (it stays pending: commit or discard it after)."""
        out = None
        req = pb.GetGradRequest(head=self._head(head), pending_grad_id=int(pending_grad or 0))
        try:
            for c in self._front.stub.GetGrad(req, timeout=self.timeout,
                                              metadata=self._metadata if pending_grad else self._admin_metadata):
                if out is None:
                    out = np.zeros((c.rows_total, c.cols), dtype=np.float32)
                out[c.first_row:c.first_row + c.rows] = np.frombuffer(c.data, dtype="<f4").reshape(c.rows, c.cols)
        except grpc.RpcError as e:
            raise _wrap(e, "GetGrad") from e
        return out if out is not None else np.zeros((0, 0), dtype=np.float32)

    def optimizer_step(self, head: Optional[str] = None, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                       eps: float = 1e-8, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                       zero_grad: bool = True):
        """One AdamW step on the server's fp32 master weights. Returns (grad_norm, HeadInfo, step)."""
        r = self._unary("OptimizerStep", pb.OptimizerStepRequest(
            head=self._head(head), lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, zero_grad=zero_grad))
        return r.grad_norm, HeadInfo._from(r.head), r.step

    def update_weights(self, weight: Any, head: Optional[str] = None, expected_version: int = 0) -> HeadInfo:
        """Replaces the head's weight [vocab, hidden] (numpy or torch, of the head's dtype)."""
        w = A.host_hidden(weight)
        if len(w.lead_shape) != 1:
            raise ValueError("weight must be [vocab, hidden]")
        row_bytes = w.hidden_size * w.array.itemsize
        step = max(1, self.chunk_bytes // max(1, row_bytes))
        buf = w.byte_view()

        def gen():
            yield pb.UpdateWeightsRequest(header=pb.UpdateWeightsHeader(head=self._head(head),
                                                                        expected_version=expected_version))
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
    def score(self, hidden, targets, temperature: float = 1.0, softcap: Optional[float] = None,
              entropy: bool = True, ignore_index: int = -100, *, head: Optional[str] = None,
              head_version: int = 0, allow_tf32: bool = False, dtype=None,
              progress: Optional[ProgressFn] = None, tqdm: Union[bool, dict] = False,
              hidden_region: Optional[Region] = None, streams: Optional[int] = None,
              argmax: bool = False, top_k: int = 0):
        """Per-token logprob of the target and (if `entropy`) entropy of the softmax.

        hidden: [..., H] numpy or torch (bf16 / fp16 / fp32, the head's dtype); targets: [...] ints.
        Returns (logprobs, entropy_or_None), fp32, shaped like targets, numpy or torch on hidden's device.
        hidden_region: a shared-memory Region that `hidden` lies in (shared_memory_session()): the
        server reads the hidden states there instead of receiving them. For a CUDA region
        (session.register_cuda), `hidden` is the torch CUDA tensor in it (not copied).
        streams: overrides the client's `streams` for this call (a large request is split over that
        many concurrent streams; see Client).
        argmax / top_k (<= 64): also rank each row's tokens, in the same pass (no logits): the answer is
        then a ScoreResult. targets may be None when only the rankings are wanted (every row ignored).
        """
        outputs = [pb.OUTPUT_LOGPROBS] + ([pb.OUTPUT_ENTROPY] if entropy else []) + _ranking_outputs(argmax, top_k)
        h = self._hidden(hidden, dtype, hidden_region)
        if targets is None:
            targets = np.full(h.lead_shape, ignore_index, dtype=np.int32)
        t = A.host_rows(targets, h.rows, "targets", np.int32, h.lead_shape)
        hdr = self._header(h, head, head_version, temperature, softcap, ignore_index, outputs, allow_tf32)
        hdr.top_k = top_k
        def finish(res):
            lp = A.to_caller_rows(res["logprobs"], h)
            ent = A.to_caller_rows(res["entropy"], h) if entropy else None
            if not (argmax or top_k):
                return lp, ent
            return ScoreResult(lp, ent, *_rankings(res, h, top_k))

        return self._run("Score", h, t, hdr, {}, finish, want_dhidden=False, progress=progress, use_tqdm=tqdm,
                         hidden_region=hidden_region, streams=streams)

    def forward_backward(self, hidden, targets, reduction: str = "mean", ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, temperature: float = 1.0,
                         softcap: Optional[float] = None, grad_loss=None, *, head: Optional[str] = None,
                         class_weights=None, return_z_loss: bool = False, argmax: bool = False, top_k: int = 0,
                         head_version: int = 0, accumulate_weight_grad: bool = False,
                         defer_weight_grad: bool = False, return_logprobs: bool = False, return_entropy: bool = False, allow_tf32: bool = False,
                         dtype=None, progress: Optional[ProgressFn] = None,
                         tqdm: Union[bool, dict] = False, hidden_region: Optional[Region] = None,
                         d_hidden_region: Optional[Region] = None, d_hidden_offset: int = 0,
                         streams: Optional[int] = None) -> ForwardBackwardResult:
        """Loss and d_hidden in one round trip. reduction: "mean" (over non-ignored rows of the whole
        call; the client declares their count to the server), "sum", or "none" (with optional per-row
        upstream gradients `grad_loss`: d_hidden is then the gradient of sum_i grad_loss_i * loss_i).
        hidden_region / d_hidden_region (+ d_hidden_offset): co-located, as in score(); d_hidden is
        written in place into d_hidden_region at d_hidden_offset and returned as a view of it.
        accumulate_weight_grad: also add the loss's dW to the head's gradient when the call succeeds;
        with defer_weight_grad, keep it pending instead (result.pending_grads) until commit_grad adds it
        scaled by the upstream gradient the loss receives, or discards it (docs/MATH.md).
        class_weights: [V] per-class weights (PyTorch's CrossEntropyLoss(weight=)); reduction "mean" then
        divides by the sum of the non-ignored targets' weights, as PyTorch does. return_z_loss: also the
        z-loss part of each row's loss; argmax / top_k: rank each row's tokens (as score does)."""
        if defer_weight_grad and not accumulate_weight_grad:
            raise ValueError("defer_weight_grad needs accumulate_weight_grad=True")
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}")
        if grad_loss is not None and reduction != "none":
            raise ValueError("grad_loss applies to reduction='none' only")
        outputs = [pb.OUTPUT_LOSS] + _ranking_outputs(argmax, top_k)
        if return_logprobs:
            outputs.append(pb.OUTPUT_LOGPROBS)
        if return_entropy:
            outputs.append(pb.OUTPUT_ENTROPY)
        if return_z_loss:
            outputs.append(pb.OUTPUT_Z_LOSS)
        h = self._hidden(hidden, dtype, hidden_region)
        t = A.host_rows(targets, h.rows, "targets", np.int32, h.lead_shape)
        hdr = self._header(h, head, head_version, temperature, softcap, ignore_index, outputs, allow_tf32)
        hdr.top_k = top_k
        # A weighted mean divides by the targets' weights (PyTorch): asked as a sum, divided here.
        weight_sum = None
        if class_weights is not None:
            cw = np.ascontiguousarray(_as_numpy(class_weights), dtype=np.float32).reshape(-1)
            hdr.class_weights.extend(cw.tolist())
            if reduction == "mean":
                valid_t = t[t != ignore_index]
                weight_sum = float(cw[valid_t].astype(np.float64).sum()) if valid_t.size else 0.0
                reduction = "sum"
        hdr.reduction = _REDUCTIONS[reduction]
        hdr.label_smoothing = label_smoothing
        hdr.z_loss = z_loss
        hdr.accumulate_weight_grad = accumulate_weight_grad
        hdr.defer_weight_grad = defer_weight_grad
        valid = int(np.count_nonzero(t != ignore_index)) if reduction == "mean" else None
        if reduction == "mean":
            hdr.num_valid_tokens = valid
        per_row = {}
        if grad_loss is not None:
            per_row["grad_loss"] = A.host_rows(grad_loss, h.rows, "grad_loss", np.float32, h.lead_shape)
        elif weight_sum is not None:
            # d_hidden and dW of sum_i loss_i / W: every row's upstream gradient 1 / W (REDUCTION_NONE).
            hdr.reduction = pb.REDUCTION_NONE
            g = np.full(h.lead_shape, (1.0 / weight_sum) if weight_sum else 0.0, dtype=np.float32)
            per_row["grad_loss"] = A.host_rows(g, h.rows, "grad_loss", np.float32, h.lead_shape)
        def finish(res):
            s = res["summary"]
            if s is None:
                raise LceError(grpc.StatusCode.INTERNAL, "server ended ForwardBackward without a summary",
                               "ForwardBackward")
            ranks = _rankings(res, h, top_k) if (argmax or top_k) else (None, None, None)
            loss = float(s.loss)
            if weight_sum is not None:  # the summary's loss is the plain sum of loss_i (REDUCTION_NONE)
                loss = float(np.asarray(res["loss"], dtype=np.float64).sum() / weight_sum) if weight_sum else 0.0
            return ForwardBackwardResult(
                loss=loss,
                per_token_loss=A.to_caller_rows(res["loss"], h),
                d_hidden=A.to_caller_hidden(res["d_hidden"], h),
                valid_tokens=int(s.valid_tokens), rows=int(s.rows), head_version=int(s.head_version),
                logprobs=A.to_caller_rows(res["logprobs"], h) if return_logprobs else None,
                entropy=A.to_caller_rows(res["entropy"], h) if return_entropy else None,
                pending_grads=tuple(int(i) for i in s.pending_grad_ids),
                z_loss=A.to_caller_rows(res["z_loss"], h) if return_z_loss else None,
                argmax=ranks[0], top_tokens=ranks[1], top_logprobs=ranks[2],
            )

        return self._run("ForwardBackward", h, t, hdr, per_row, finish, want_dhidden=True, progress=progress,
                         use_tqdm=tqdm, hidden_region=hidden_region, d_hidden_region=d_hidden_region,
                         d_hidden_offset=d_hidden_offset, streams=streams, expect_valid=valid)

    def backward(self, hidden, targets, grad_logprob=None, grad_entropy=None, temperature: float = 1.0,
                 softcap: Optional[float] = None, ignore_index: int = -100, *, head: Optional[str] = None,
                 head_version: int = 0, accumulate_weight_grad: bool = False, defer_weight_grad: bool = False,
                 allow_tf32: bool = False, dtype=None,
                 progress: Optional[ProgressFn] = None, tqdm: Union[bool, dict] = False,
                 hidden_region: Optional[Region] = None, d_hidden_region: Optional[Region] = None,
                 d_hidden_offset: int = 0, streams: Optional[int] = None):
        """Generic backward: d_hidden from upstream grads of logprob and entropy (None: zeros).
        hidden_region / d_hidden_region: co-located, as in forward_backward(). accumulate_weight_grad
        (and defer_weight_grad): the head's dW of the same upstream grads, as in forward_backward(); the
        call then returns a BackwardResult (d_hidden and pending_grads) instead of d_hidden alone."""
        if defer_weight_grad and not accumulate_weight_grad:
            raise ValueError("defer_weight_grad needs accumulate_weight_grad=True")
        h = self._hidden(hidden, dtype, hidden_region)
        t = A.host_rows(targets, h.rows, "targets", np.int32, h.lead_shape)
        hdr = self._header(h, head, head_version, temperature, softcap, ignore_index, [], allow_tf32)
        hdr.accumulate_weight_grad = accumulate_weight_grad
        hdr.defer_weight_grad = defer_weight_grad
        per_row = {}
        if grad_logprob is not None:
            per_row["grad_logprob"] = A.host_rows(grad_logprob, h.rows, "grad_logprob", np.float32, h.lead_shape)
        if grad_entropy is not None:
            per_row["grad_entropy"] = A.host_rows(grad_entropy, h.rows, "grad_entropy", np.float32, h.lead_shape)
        def finish(res):
            d = A.to_caller_hidden(res["d_hidden"], h)
            if not accumulate_weight_grad:
                return d
            s = res["summary"]
            return BackwardResult(d_hidden=d, pending_grads=tuple(int(i) for i in s.pending_grad_ids) if s else ())

        return self._run("Backward", h, t, hdr, per_row, finish,
                         want_dhidden=True, progress=progress, use_tqdm=tqdm, hidden_region=hidden_region,
                         d_hidden_region=d_hidden_region, d_hidden_offset=d_hidden_offset, streams=streams)

    def policy_loss(self, hidden, targets, old_logprobs, advantages, *, sequence_ids=None,
                    ref_logprobs=None, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float = 0.0,
                    aggregation: str = "token-mean", entropy_coef: float = 0.0, kl_coef: float = 0.0,
                    kl_estimator: str = "k1", temperature: float = 1.0, softcap: Optional[float] = None,
                    ignore_index: int = -100, head: Optional[str] = None, head_version: int = 0,
                    accumulate_weight_grad: bool = False, defer_weight_grad: bool = False,
                    allow_tf32: bool = False, dtype=None,
                    progress: Optional[ProgressFn] = None, tqdm: Union[bool, dict] = False,
                    hidden_region: Optional[Region] = None, d_hidden_region: Optional[Region] = None,
                    d_hidden_offset: int = 0, streams: Optional[int] = None) -> PolicyLossResult:
        """Fused PPO/GRPO policy loss and its d_hidden (docs/MATH.md, "Policy loss").

        sequence_ids: per row, the row's sequence (default: for [B, T] hidden states, the batch index;
        otherwise one sequence). The client fills in each sequence's valid-token count.
        accumulate_weight_grad / defer_weight_grad: as in forward_backward."""
        if defer_weight_grad and not accumulate_weight_grad:
            raise ValueError("defer_weight_grad needs accumulate_weight_grad=True")
        if aggregation not in _AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {sorted(_AGGREGATIONS)}")
        if kl_estimator not in _KL:
            raise ValueError(f"kl_estimator must be one of {sorted(_KL)}")
        h = self._hidden(hidden, dtype, hidden_region)
        t = A.host_rows(targets, h.rows, "targets", np.int32, h.lead_shape)
        if sequence_ids is None:
            if len(h.lead_shape) >= 2:
                inner = int(np.prod(h.lead_shape[1:]))
                sequence_ids = np.repeat(np.arange(h.lead_shape[0], dtype=np.int32), inner)
            else:
                sequence_ids = np.zeros(h.rows, dtype=np.int32)
        seq = A.host_rows(sequence_ids, h.rows, "sequence_ids", np.int32, h.lead_shape)
        if seq.size and seq.min() < 0:
            raise ValueError("sequence_ids must be >= 0")
        nseq = int(seq.max()) + 1 if seq.size else 0
        counts = np.bincount(seq[t != ignore_index], minlength=nseq) if nseq else np.zeros(0, np.int64)
        hdr = self._header(h, head, head_version, temperature, softcap, ignore_index,
                           [pb.OUTPUT_LOGPROBS, pb.OUTPUT_ENTROPY], allow_tf32)
        hdr.accumulate_weight_grad = accumulate_weight_grad
        hdr.defer_weight_grad = defer_weight_grad
        hdr.policy.CopyFrom(pb.PolicyLossOptions(
            clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, aggregation=_AGGREGATIONS[aggregation],
            entropy_coef=entropy_coef, kl_coef=kl_coef, kl_estimator=_KL[kl_estimator],
            sequence_valid_tokens=[int(c) for c in counts]))
        per_row = {
            "old_logprobs": A.host_rows(old_logprobs, h.rows, "old_logprobs", np.float32, h.lead_shape),
            "advantages": A.host_rows(advantages, h.rows, "advantages", np.float32, h.lead_shape),
            "sequence_ids": seq,
        }
        if ref_logprobs is not None:
            per_row["ref_logprobs"] = A.host_rows(ref_logprobs, h.rows, "ref_logprobs", np.float32, h.lead_shape)
        def finish(res):
            s = res["summary"]
            if s is None:
                raise LceError(grpc.StatusCode.INTERNAL, "server ended PolicyLoss without a summary", "PolicyLoss")
            return PolicyLossResult(
                loss=float(s.loss), d_hidden=A.to_caller_hidden(res["d_hidden"], h),
                logprobs=A.to_caller_rows(res["logprobs"], h), entropy=A.to_caller_rows(res["entropy"], h),
                valid_tokens=int(s.valid_tokens), clip_fraction=s.clip_fraction, approx_kl=s.approx_kl,
                mean_entropy=s.mean_entropy, mean_ratio=s.mean_ratio, mean_kl=s.mean_kl,
                head_version=int(s.head_version), pending_grads=tuple(int(i) for i in s.pending_grad_ids))

        return self._run("PolicyLoss", h, t, hdr, per_row, finish, want_dhidden=True, progress=progress,
                         use_tqdm=tqdm, hidden_region=hidden_region, d_hidden_region=d_hidden_region,
                         d_hidden_offset=d_hidden_offset, streams=streams,
                         expect_valid=int(sum(hdr.policy.sequence_valid_tokens)))

    # ---------------------------------------------------------------------------------- internals
    def _run(self, rpc: str, h, targets, header, per_row: dict, finish, **kw):
        """A computation's call, its answers turned into the result by `finish` (lce_client.aio's
        Client runs the same on asyncio and returns a coroutine)."""
        return finish(self._stream(rpc, h, targets, header, per_row, **kw))

    def _head(self, head: Optional[str]) -> str:
        return self.head if head is None else head

    def _header(self, h, head, head_version, temperature, softcap, ignore_index, outputs,
                allow_tf32) -> pb.RequestHeader:
        if temperature is None:
            temperature = 1.0
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)):
            raise ValueError(f"temperature must be a finite number, got {temperature!r}")
        hdr = pb.RequestHeader(
            head=self._head(head), head_version=head_version, hidden_size=h.hidden_size, dtype=h.wire_dtype,
            temperature=float(temperature), softcap=float(softcap or 0.0), outputs=outputs,
            ignore_index=int(ignore_index), allow_tf32=allow_tf32)
        return hdr

    @staticmethod
    def _hidden(hidden, dtype, hidden_region: Optional[Region]):
        """The caller's hidden states: host memory (copied from a GPU if need be), or left on the GPU
        when the server reads them from a CUDA IPC region."""
        if hidden_region is not None and hidden_region.is_cuda:
            return A.device_hidden(hidden)
        return A.host_hidden(hidden, dtype)

    def _rows_per_chunk(self, h) -> int:
        row_bytes = h.hidden_size * h.itemsize
        return max(1, self.chunk_bytes // max(1, row_bytes))

    def _plan_part(self, rows: int, row_bytes: int, region_backed: bool,
                   d_hidden_back: bool = True) -> List[Tuple[int, int]]:
        """The chunks [(first_row, rows), ...] of one stream's `rows` rows (relative to the stream's
        first row). A request whose hidden states are in a shared-memory or CUDA region (not the data
        plane) carries no hidden bytes: it is cut at chunk_bytes alone, without the smaller first and
        last chunks (the C++ client, StreamPart, ignores them there too, sending up to 65536 rows a
        chunk instead). Elsewhere (bytes on the wire, the data plane) plan_chunks with the client's
        first_chunk_bytes and last_chunk_bytes; the smaller last chunk only where d_hidden comes back
        (d_hidden_back): a score's last answer is a few floats, its tail the last chunk's compute,
        which a smaller chunk does not shorten (one more engine call, as the C++ client)."""
        if region_backed:
            return plan_chunks(rows, row_bytes, self.chunk_bytes)
        return plan_chunks(rows, row_bytes, self.chunk_bytes, self.first_chunk_bytes,
                           self.last_chunk_bytes if d_hidden_back else 0, self.grow_chunks)

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

    def _requests(self, h, targets: np.ndarray, header: pb.RequestHeader, per_row: dict,
                  plan: Sequence[Tuple[int, int]], hidden_at=None, d_hidden_at=None,
                  uploads: Optional[UploadState] = None) -> Iterator[pb.StreamRequest]:
        """The request stream of one part, made lazily: a header, then one message per chunk of `plan`
        ([(first_row, rows), ...] in the request's rows), each built from a memoryview slice of the
        caller's (host) hidden states, or naming a slice of a registered region (at the rows' offset in
        it). Over the data plane (`uploads`), the part's uploaders write the chunks into the region
        meanwhile; a chunk's message is made once all its shares are in (this waits in gRPC's request
        thread, beside the answers being read). A failed upload cancels the call through `uploads`
        and ends the stream. Every message is sent without waiting for answers (header.sends_ahead:
        the server may then compute one chunk while it reads and stages the next)."""
        header.sends_ahead = True
        yield pb.StreamRequest(header=header)
        buf = h.byte_view() if hidden_at is None else None
        row_bytes = h.hidden_size * h.itemsize
        for c, (r0, rows) in enumerate(plan):
            r1 = r0 + rows
            if uploads is not None and not uploads.wait(c):
                return
            if hidden_at is None:
                chunk = pb.RowChunk(hidden=bytes(buf[r0 * row_bytes:r1 * row_bytes]), targets=targets[r0:r1].tolist())
            else:  # a slice of a region (shared memory, or server memory filled by the uploaders), no bytes
                chunk = pb.RowChunk(targets=targets[r0:r1].tolist(), hidden_region=pb.RegionSlice(
                    region_id=hidden_at[0], offset=hidden_at[1] + r0 * row_bytes, byte_size=rows * row_bytes))
            if d_hidden_at is not None:
                chunk.d_hidden_region.CopyFrom(pb.RegionSlice(
                    region_id=d_hidden_at[0], offset=d_hidden_at[1] + r0 * row_bytes, byte_size=rows * row_bytes))
            for name, arr in per_row.items():
                getattr(chunk, name).extend(arr[r0:r1].tolist())
            yield pb.StreamRequest(chunk=chunk)

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
        step = self._rows_per_chunk(h)
        n = h.rows
        out = {**A.new_outputs(n, int(header.top_k)),
               "d_hidden": None, "summary": None}
        metadata, hidden_at, d_hidden_at = self._metadata, None, None
        if d_hidden_region is not None and not want_dhidden:
            raise ValueError(f"{rpc} returns no d_hidden: d_hidden_region does not apply")
        cuda_regions = [r for r in (hidden_region, d_hidden_region) if r is not None and r.is_cuda]
        if hidden_region is not None or d_hidden_region is not None:
            sessions = {(r.session_id, r.session_secret) for r in (hidden_region, d_hidden_region) if r is not None}
            if len(sessions) != 1:
                raise ValueError("hidden_region and d_hidden_region must belong to one session")
            metadata = tuple(self._metadata or ()) + _session_metadata(*sessions.pop())
            if hidden_region is not None:
                hidden_at = (hidden_region.id, hidden_region.offset_of(
                    h.tensor if isinstance(h, A.DeviceArray) else h.array))
        if want_dhidden:
            if d_hidden_region is not None and d_hidden_region.is_cuda:
                out["d_hidden"] = d_hidden_region.tensor_view((n, h.hidden_size), A.torch_dtype(h.wire_dtype),
                                                              d_hidden_offset)
                d_hidden_at = (d_hidden_region.id, d_hidden_offset)
            elif d_hidden_region is not None:
                out["d_hidden"] = d_hidden_region.ndarray((n, h.hidden_size), A.storage_dtype(h.wire_dtype),
                                                          d_hidden_offset)
                d_hidden_at = (d_hidden_region.id, d_hidden_offset)
            else:
                out["d_hidden"] = A.new_hidden_out(n, h.hidden_size, h.wire_dtype)
        if n == 0:
            # The server refuses requests without rows; an empty batch has an empty answer (and a loss
            # of 0, as a mean over no valid tokens is defined to be), so answer it here without an RPC.
            out["summary"] = pb.RequestSummary(rows=0, valid_tokens=0, loss=0.0)
            return out
        if cuda_regions:
            # The server's GPU reads (and writes) this memory: the caller's queued work on it goes first.
            import torch

            for dev in {r.tensor.device for r in cuda_regions if r.tensor is not None}:
                torch.cuda.current_stream(dev).synchronize()
        row_bytes = h.hidden_size * h.itemsize
        dh_bytes = out["d_hidden"].reshape(-1).view(np.uint8) if want_dhidden and d_hidden_at is None else None
        parts = self._plan_parts(n, row_bytes, step, streams)
        # Over the data plane the bytes go through server memory and the messages name slices of it
        # (not for weight-gradient accumulation, which a GPU server does not do on its own memory yet).
        dp = replica.data_plane
        if dp is None or hidden_region is not None or d_hidden_region is not None or header.accumulate_weight_grad:
            dp = None
        routes: Optional[List[Route]] = None
        prog = _Progress(n, progress, use_tqdm, rpc) if (progress or use_tqdm) else None
        if dp is not None:
            dp.lock.acquire()  # calls over the data plane take turns: they share its regions and sockets
            try:
                routes = dp.prepare(lambda: self._data_port(replica), lambda: self._data_plane_session(replica),
                                    len(parts), n * row_bytes,
                                    want_dhidden)
            except BaseException:
                dp.reset()
                dp.lock.release()
                if prog is not None:
                    prog.close()
                raise
            metadata = tuple(self._metadata or ()) + _session_metadata(routes[0].session_id, routes[0].session_secret)
            hidden_at = (routes[0].hidden_region, 0)
            if want_dhidden:
                d_hidden_at = (routes[0].d_hidden_region, 0)
        args = (rpc, h, targets, per_row, hidden_at, d_hidden_at, metadata, out, dh_bytes)
        try:
            if len(parts) == 1:
                on_rows = (lambda r1, rows: prog.update(r1, rows)) if prog is not None else None
                out["summary"] = self._run_part(replica.stub, header, 0, n, on_rows, None, *args,
                                                route=routes[0] if routes else None)
            else:
                out["summary"] = self._run_parts(replica, parts, header, prog, expect_valid, *args, routes=routes)
        except BaseException:
            if dp is not None:
                dp.reset()  # the server may have gone, a socket be mid-transfer: start afresh next time
            raise
        finally:
            if dp is not None:
                dp.lock.release()
            if prog is not None:
                prog.close()
        return out

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
        end = begin + n
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
        expect, summary = 0, None
        try:
            for msg in answers:
                kind = msg.WhichOneof("kind")
                if kind == "summary":
                    summary = msg.summary
                    continue
                if kind != "chunk":
                    continue
                expect = self._place_chunk(msg.chunk, begin, n, expect, out, dh_bytes, row_bytes, rpc, header,
                                           route, d_hidden_at)
                if on_rows is not None:
                    on_rows(expect, int(msg.chunk.rows))
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
        if expect != n:
            raise LceError(grpc.StatusCode.INTERNAL, f"server answered {expect} of {n} rows", rpc)
        return summary

    @staticmethod
    def _place_chunk(c, begin, n, expect, out, dh_bytes, row_bytes, rpc, header, route=None, d_hidden_at=None) -> int:
        """One chunk's answers written into `out` at their rows (the part's rows start at `begin`; `expect`:
        the first row not yet answered); returns the next row expected."""
        r0, rows = int(c.first_row), int(c.rows)
        end = begin + n
        if r0 != expect or rows <= 0 or r0 + rows > n:
            raise LceError(grpc.StatusCode.INTERNAL,
                           f"server answered rows [{r0}, {r0 + rows}) where rows from {expect} of {n} "
                           "were expected" + (f" (in the part of rows {begin}..{end - 1})" if header.partial
                                              else ""), rpc)
        r1 = r0 + rows
        g0, g1 = begin + r0, begin + r1
        for name, (_, width) in A.ROW_OUTPUTS.items():
            vals = getattr(c, name)
            if len(vals):
                per_row = int(header.top_k) if width == "k" else 1
                if len(vals) != rows * per_row:
                    raise LceError(grpc.StatusCode.INTERNAL,
                                   f"server sent {len(vals)} {name} for a chunk of {rows} rows", rpc)
                out[name][g0:g1] = np.asarray(vals).reshape(out[name][g0:g1].shape)
        if route is not None and route.d_hidden_region is not None:
            # The server wrote the chunk's d_hidden into its memory before it answered.
            if len(c.d_hidden):
                raise LceError(grpc.StatusCode.INTERNAL, f"server sent {len(c.d_hidden)} bytes of d_hidden "
                               "in the answer of a chunk that named a d_hidden region", rpc)
            route.download(d_hidden_at[1] + g0 * row_bytes, memoryview(dh_bytes[g0 * row_bytes:g1 * row_bytes]))
        elif dh_bytes is not None:
            if len(c.d_hidden) != rows * row_bytes:
                raise LceError(grpc.StatusCode.INTERNAL,
                               f"server sent {len(c.d_hidden)} bytes of d_hidden for {rows} rows "
                               f"of {row_bytes} bytes", rpc)
            dh_bytes[g0 * row_bytes:g1 * row_bytes] = np.frombuffer(c.d_hidden, dtype=np.uint8)
        return r1

    def _call(self, stub, rpc, requests, metadata):
        """A request of one chunk as one Call (one message each way: no stream to set up, no round trip
        per message). Its answers as the stream's messages, or None where the server has no Call (then
        this stub streams from now on)."""
        header, chunk = next(requests).header, next(requests).chunk
        req = pb.CallRequest(method=_CALL_METHODS[rpc], header=header, chunk=chunk)
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
        events: "queue.Queue" = queue.Queue()
        lock = threading.Lock()
        calls: list = [None] * len(parts)
        stopping = [False]

        def cancel_all():
            with lock:
                stopping[0] = True
                live = [c for c in calls if c is not None]
            for c in live:
                c.cancel()

        def worker(i, r0, r1, stub, hdr):
            def on_call(call):
                with lock:
                    calls[i] = call
                    stop = stopping[0]
                if stop:
                    call.cancel()

            try:
                s = self._run_part(stub, hdr, r0, r1, lambda done, rows: events.put(("rows", rows)), on_call,
                                   rpc, *args, route=routes[i] if routes else None)
                events.put(("done", i, s))
            except BaseException as e:  # handed to the calling thread
                events.put(("error", i, e))

        threads = []
        for i, (r0, r1) in enumerate(parts):
            hdr = pb.RequestHeader()
            hdr.CopyFrom(header)
            hdr.partial = True
            t = threading.Thread(target=worker, args=(i, r0, r1, self._stream_stub(i, replica), hdr),
                                 name=f"lce-{rpc}-part{i}", daemon=True)
            threads.append(t)
        summaries: list = [None] * len(parts)
        error: Optional[BaseException] = None
        try:
            for t in threads:
                t.start()
            remaining, done = len(parts), 0
            while remaining:
                try:
                    ev = events.get(timeout=0.25)
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
                        cancel_all()
        except BaseException:  # e.g. KeyboardInterrupt, or the progress callback raised
            cancel_all()
            # The parts stop at once (their calls are cancelled); wait for them, so that none is still
            # using the data plane's sockets, or its uploaders, once the caller gets the error.
            for t in threads:
                if t.ident is not None:  # (started)
                    t.join()
            raise
        for t in threads:
            t.join()
        if error is not None:
            raise error
        if all(s is None for s in summaries):
            return None
        return _combine_summaries(rpc, parts, summaries, expect_valid)


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
                      data_port=r.data_port, data_plane_tls=r.data_plane_tls, invariant_across_batches=list(r.invariance.across_batches),
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
_CALL_METHODS = {"Score": pb.CALL_SCORE, "ForwardBackward": pb.CALL_FORWARD_BACKWARD, "Backward": pb.CALL_BACKWARD,
                 "PolicyLoss": pb.CALL_POLICY_LOSS}
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
                            pending_grad_ids=[i for s in summaries for i in s.pending_grad_ids])
    if rpc == "PolicyLoss":
        for name in _POLICY_STATS:
            val = math.fsum(getattr(s, name) * v for s, v in zip(summaries, valid)) / total if total else 0.0
            setattr(out, name, val)
    return out


def _as_bytes(x):
    if x is None or isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode()
    return bytes(x)
