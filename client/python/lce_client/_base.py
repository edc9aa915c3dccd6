"""What lce_client.Client and lce_client.aio.Client share: their settings, the four computations'
arguments turned into a request (score, forward_backward, backward, policy_loss), the request's
messages, and the answers put together into the result. Each client adds its transport (`_run`)."""
from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from . import _arrays as A
from ._errors import LceError
from ._options import ClientOptions
from ._proto import lce_pb2 as pb
from ._data_plane import UploadState
from ._shm import Region
from ._weighted_mean import WeightedMean, weighted_mean

ProgressFn = Callable[[int, int], None]
# Replies carry d_hidden of a whole request chunk; let them be as large as the server allows.
_MAX_RECV = 1 << 30


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


def _class_weighted(hdr: pb.RequestHeader, t: np.ndarray, class_weights, reduction: str, ignore_index: int,
                    z_loss: float) -> Optional[WeightedMean]:
    """Puts class_weights and the z-loss coefficient into the header. The server takes no weighted mean:
    one is asked as the rows' sum (see _weighted_mean); returns its WeightedMean, None for no weights or
    another reduction."""
    hdr.z_loss = z_loss
    if class_weights is None:
        return None
    cw = np.ascontiguousarray(_as_numpy(class_weights), dtype=np.float32).reshape(-1)
    hdr.class_weights.extend(cw.tolist())
    if reduction != "mean":
        return None
    wm = weighted_mean(cw, t, ignore_index, z_loss)
    hdr.z_loss = wm.z_loss
    return wm


def _forward_backward_result(res, h, wm, top_k, return_logprobs, return_entropy, return_z_loss):
    """A ForwardBackward's answers as the caller's result (top_k None: no rankings asked)."""
    s = res["summary"]
    if s is None:
        raise LceError(grpc.StatusCode.INTERNAL, "server ended ForwardBackward without a summary", "ForwardBackward")
    ranks = _rankings(res, h, top_k) if top_k is not None else (None, None, None)
    loss = float(s.loss)
    if wm is not None:  # the summary's loss is the plain sum of the rows' (REDUCTION_NONE)
        loss = float(np.asarray(res["loss"], dtype=np.float64).sum() / wm.divisor)
    row_loss, row_z = _unscaled_rows(res, wm)
    return ForwardBackwardResult(
        loss=loss,
        per_token_loss=A.to_caller_rows(row_loss, h),
        d_hidden=A.to_caller_hidden(res["d_hidden"], h),
        valid_tokens=int(s.valid_tokens), rows=int(s.rows), head_version=int(s.head_version),
        logprobs=A.to_caller_rows(res["logprobs"], h) if return_logprobs else None,
        entropy=A.to_caller_rows(res["entropy"], h) if return_entropy else None,
        pending_grads=tuple(int(i) for i in s.pending_grad_ids),
        z_loss=A.to_caller_rows(row_z, h) if return_z_loss else None,
        argmax=ranks[0], top_tokens=ranks[1], top_logprobs=ranks[2],
    )


def _unscaled_rows(res: dict, wm: Optional[WeightedMean]):
    """(per-row loss, per-row z-loss) as the caller's options define them: a weighted mean's rows came
    back with the rescaled z-loss coefficient, brought back here (loss_i of docs/MATH.md)."""
    loss, z = res["loss"], res["z_loss"]
    if wm is None or wm.z_scale == 1.0:
        return loss, z
    z_srv = np.asarray(z, dtype=np.float64)
    z = (z_srv * wm.z_scale).astype(np.float32)
    return (np.asarray(loss, dtype=np.float64) - z_srv + z).astype(np.float32), z


def _rankings(res: dict, h, top_k: int):
    """(argmax, top_tokens, top_logprobs) in the caller's kind and row shape ([..., k] for top-k)."""
    am = A.to_caller_rows(res["argmax"], h)
    if not top_k:
        return am, None, None
    return am, A.to_caller_rows(res["top_tokens"], h), A.to_caller_rows(res["top_logprobs"], h)


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
_CALL_METHODS = {"Score": pb.CALL_SCORE, "ForwardBackward": pb.CALL_FORWARD_BACKWARD, "Backward": pb.CALL_BACKWARD,
                 "PolicyLoss": pb.CALL_POLICY_LOSS}


def call_answers(resp: pb.CallResponse) -> list:
    """A Call's answer as the stream's messages would have been: the chunk, then the summary if any."""
    answers = [pb.StreamResponse(chunk=resp.chunk)]
    if resp.HasField("summary"):
        answers.append(pb.StreamResponse(summary=resp.summary))
    return answers


def client_options(options, kwargs: dict) -> ClientOptions:
    """A client's settings from its arguments: a ClientOptions, keyword arguments, or both (the
    keywords win). `options` given as a sequence is the gRPC channel options (the argument's meaning
    before ClientOptions)."""
    if options is not None and not isinstance(options, ClientOptions):
        kwargs = {**kwargs, "channel_options": options}
        options = None
    base = options if options is not None else ClientOptions()
    return base.replace(**kwargs) if kwargs else base


class _ClientBase:
    """The settings, the computations' arguments and the answers' assembly of both clients."""

    def __init__(self, targets: List[str], o: ClientOptions):
        self.client_options = o
        self.targets = targets
        self.target = targets[0]  # the front (with round_robin: the name)
        self.load_balancing = o.load_balancing or None
        self.timeout = o.timeout
        self.max_attempts = o.attempts(len(targets))
        self.retry_backoff = float(o.retry_backoff)
        self.chunk_bytes = int(o.chunk_bytes)
        self.first_chunk_bytes = int(o.first_chunk_bytes)
        self.last_chunk_bytes = int(o.last_chunk_bytes)
        self.grow_chunks = bool(o.grow_chunks)
        self.head = o.head
        self.streams = int(o.streams)
        self.min_stream_bytes = int(o.min_stream_bytes)
        self.data_plane_sockets = int(o.data_plane_sockets)
        self.data_plane_streams = int(o.data_plane_streams)
        self._options = [("grpc.max_receive_message_length", _MAX_RECV),
                         ("grpc.max_send_message_length", _MAX_RECV)] + list(o.channel_options)
        self._creds = None
        self._root_certificates = _as_bytes(o.root_certificates)  # also for a TLS data plane
        if o.secure:
            self._creds = grpc.ssl_channel_credentials(root_certificates=_as_bytes(o.root_certificates),
                                                       private_key=_as_bytes(o.private_key),
                                                       certificate_chain=_as_bytes(o.certificate_chain))
        self._metadata = (("authorization", f"Bearer {o.token}"),) if o.token else None
        self._admin_metadata = (("authorization", f"Bearer {o.admin_token}"),) if o.admin_token else self._metadata

    # ------------------------------------------------------------------------- the computations
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
                         defer_weight_grad: bool = False, return_logprobs: bool = False, return_entropy: bool = False,
                         allow_tf32: bool = False,
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
        divides the cross-entropy by the sum of the non-ignored targets' weights, as PyTorch does, and the
        z-loss by their count, as Liger-Kernel does (docs/MATH.md, "Class weights"). return_z_loss: also
        the z-loss part of each row's loss; argmax / top_k: rank each row's tokens (as score does)."""
        if defer_weight_grad and not accumulate_weight_grad:
            raise ValueError("defer_weight_grad needs accumulate_weight_grad=True")
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {sorted(_REDUCTIONS)}, got {reduction!r}")
        if grad_loss is not None and reduction != "none":
            raise ValueError("grad_loss applies to reduction='none' only")
        # A weighted mean with a z-loss needs the rows' z-loss to give their loss_i (_unscaled_rows).
        want_z = return_z_loss or (class_weights is not None and reduction == "mean" and z_loss != 0)
        outputs = [pb.OUTPUT_LOSS] + _ranking_outputs(argmax, top_k) + \
            [o for o, asked in ((pb.OUTPUT_LOGPROBS, return_logprobs), (pb.OUTPUT_ENTROPY, return_entropy),
                                (pb.OUTPUT_Z_LOSS, want_z)) if asked]
        h = self._hidden(hidden, dtype, hidden_region)
        t = A.host_rows(targets, h.rows, "targets", np.int32, h.lead_shape)
        hdr = self._header(h, head, head_version, temperature, softcap, ignore_index, outputs, allow_tf32)
        hdr.top_k = top_k
        wm = _class_weighted(hdr, t, class_weights, reduction, ignore_index, z_loss)
        if wm is not None:
            reduction = "sum"
        hdr.reduction = _REDUCTIONS[reduction]
        hdr.label_smoothing = label_smoothing
        hdr.accumulate_weight_grad = accumulate_weight_grad
        hdr.defer_weight_grad = defer_weight_grad
        valid = int(np.count_nonzero(t != ignore_index)) if reduction == "mean" else None
        if reduction == "mean":
            hdr.num_valid_tokens = valid
        per_row = {}
        if grad_loss is not None:
            per_row["grad_loss"] = A.host_rows(grad_loss, h.rows, "grad_loss", np.float32, h.lead_shape)
        elif wm is not None:
            # d_hidden and dW of sum_i loss_i / divisor: every row's upstream gradient 1 / divisor.
            hdr.reduction = pb.REDUCTION_NONE
            g = np.full(h.lead_shape, 1.0 / wm.divisor, dtype=np.float32)
            per_row["grad_loss"] = A.host_rows(g, h.rows, "grad_loss", np.float32, h.lead_shape)
        def finish(res):
            return _forward_backward_result(res, h, wm, top_k if (argmax or top_k) else None,
                                            return_logprobs, return_entropy, return_z_loss)

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

    def _run(self, rpc: str, h, targets, header, per_row: dict, finish, **kw):
        """A computation's call on this client's transport, its answers turned into the result by
        `finish` (lce_client.aio's Client returns a coroutine)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------- requests
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

    def _fits_one_call(self, h, d_hidden_back: bool) -> bool:
        """Whether a request of `h` on the wire is one chunk (then it may go as one Call)."""
        return len(self._plan_part(h.rows, h.hidden_size * h.itemsize, False, d_hidden_back)) == 1

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

    @staticmethod
    def _call_request(rpc: str, header: pb.RequestHeader, chunk: pb.RowChunk) -> pb.CallRequest:
        """A request of one chunk as one Call: one message each way."""
        return pb.CallRequest(method=_CALL_METHODS[rpc], header=header, chunk=chunk)

    # ------------------------------------------------------------------------- answers
    @staticmethod
    def _new_outputs(n: int, top_k: int, d_hidden=None) -> dict:
        """The arrays a request's answers are placed in (the per-row outputs, _arrays.ROW_OUTPUTS; d_hidden
        where it comes back) and its summary: what a computation's `finish` turns into its result."""
        out = A.new_outputs(n, top_k)
        out.update(d_hidden=d_hidden, summary=None)
        return out

    def _place_answers(self, answers, begin, n, out, dh_bytes, row_bytes, rpc, header, route=None,
                       d_hidden_at=None, on_rows=None):
        """A part's answer messages placed into `out` (rows [begin, begin + n) of the request); returns
        its summary (or None) and how many of its rows were answered (_check_answered checks them).
        on_rows(done_in_part, rows) per answered chunk."""
        expect, summary = 0, None
        for msg in answers:
            kind = msg.WhichOneof("kind")
            if kind == "summary":
                summary = msg.summary
            elif kind == "chunk":
                expect = self._place_chunk(msg.chunk, begin, n, expect, out, dh_bytes, row_bytes, rpc, header,
                                           route, d_hidden_at)
                if on_rows is not None:
                    on_rows(expect, int(msg.chunk.rows))
        return summary, expect

    @staticmethod
    def _check_answered(answered: int, n: int, rpc: str) -> None:
        """INTERNAL where the server ended a part of n rows having answered fewer."""
        if answered != n:
            raise LceError(grpc.StatusCode.INTERNAL, f"server answered {answered} of {n} rows", rpc)

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


def _as_bytes(x):
    if x is None or isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode()
    return bytes(x)
