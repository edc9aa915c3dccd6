"""PyTorch autograd through the remote loss head.

* ``RemoteLinearCrossEntropy(client, reduction=...)`` — an ``nn.Module``: ``loss = module(hidden, targets)``.
  Its forward makes ONE ForwardBackward RPC, which returns the loss and d_hidden together; the d_hidden
  (of the head's dtype, the size of ``hidden``) is kept on the autograd node and the backward returns it
  scaled by the upstream gradient. This is exact, not an approximation: the loss gradient of row i is
  linear in its upstream gradient g_i (docs/MATH.md), so for reduction "none" the server is asked for the
  gradient with g_i = 1 and the backward multiplies row i by grad_output[i]; for "sum" and "mean" the
  backward multiplies by the scalar grad_output (1 in the usual ``loss.backward()``). Only rounding
  differs from a server-side scaling (d_hidden is rounded to the head's dtype before the multiply).
  ``backward_mode="rpc"`` instead makes a second ForwardBackward RPC in the backward with grad_output
  sent as ``grad_loss`` (reduction "none" only): exact server-side scaling, at twice the traffic.
* ``remote_logprobs(hidden, targets, client=...)`` -> (logprobs, entropy): Score in the forward; the
  backward makes a Backward RPC with the upstream grads of logprobs and entropy, so any loss written in
  torch on top of them (PPO, GRPO, DPO, KL, ...) trains through the remote head.

Hidden states of another floating dtype than the head's are cast to the head's dtype for the wire
(``cast=True``, the default) and d_hidden comes back in the caller's dtype and device.

``cuda_session=client.shared_memory_session()`` (server with the CUDA backend on the same host): CUDA
hidden states are then not copied to the host and sent; for each RPC the (cast, contiguous) hidden states
and a fresh d_hidden buffer are registered as CUDA IPC regions of that session, the server reads and
writes them in place on the GPU, and the regions are released when the RPC returns. The session must be
one of the same server; CPU tensors take the usual path.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from ._client import Client
from ._weighted_mean import weighted_mean

__all__ = ["RemoteLinearCrossEntropy", "remote_logprobs", "remote_linear_cross_entropy", "serve_linear",
           "set_default_client", "get_default_client", "CrossEntropyOutput"]

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_default_client: Optional[Client] = None


def set_default_client(client: Optional[Client]) -> None:
    """The client that remote_logprobs / RemoteLinearCrossEntropy use when given none."""
    global _default_client
    _default_client = client


def get_default_client() -> Client:
    """The default client: set_default_client's, else one to $LCE_TARGET."""
    global _default_client
    if _default_client is None:
        target = os.environ.get("LCE_TARGET")
        if not target:
            raise RuntimeError("no lce client: pass client=..., call lce_client.torch.set_default_client, "
                               "or set LCE_TARGET=host:port")
        _default_client = Client(target)
    return _default_client


def _via_cuda_ipc(session, wire: torch.Tensor, want_dhidden: bool, call):
    """call(wire, region_kwargs): with CUDA IPC regions of `session` for the hidden states (and a new
    d_hidden buffer) when the session is given and the tensor is on a GPU; released afterwards."""
    if session is None or wire.device.type != "cuda" or wire.numel() == 0:
        return call(wire, {})
    wire = wire.contiguous()
    tensors = [wire] + ([torch.empty_like(wire)] if want_dhidden else [])
    regions = []
    try:
        for t in tensors:
            regions.append(session.register_cuda(t))
        kw = {"hidden_region": regions[0]}
        if want_dhidden:
            kw["d_hidden_region"] = regions[1]
        return call(wire, kw)
    finally:
        for r in regions:
            session.release(r)


def _wire_hidden(client: Client, hidden: torch.Tensor, head: Optional[str], cast: bool) -> torch.Tensor:
    want = _TORCH_DTYPES[client.head_info(head).dtype]
    if hidden.dtype == want:
        return hidden.detach()
    if not cast:
        raise TypeError(f"hidden is {hidden.dtype} but the head is {want} (pass cast=True to convert)")
    return hidden.detach().to(want)


class PendingWeightGrad:
    """A forward's weight-gradient contribution held pending on the server (ids of one call's streams),
    committed once by the first backward that reaches it, with autograd's upstream gradient, and
    discarded when its graph is freed without a backward (a dropped loss, an evaluation forward run
    with grad enabled). Later backwards of a retained graph recompute (_recompute)."""

    def __init__(self, client: Client, head: Optional[str], ids):
        self.client, self.head, self.ids = client, head, tuple(ids)
        self.open = bool(self.ids)

    def commit(self, scale: float) -> None:
        self.open = False
        if scale == 0.0:
            self.client.commit_grad(self.ids, head=self.head, discard=True)
        else:
            self.client.commit_grad(self.ids, scale=scale, head=self.head)

    def discard(self) -> None:
        if self.open:
            self.open = False
            try:
                self.client.commit_grad(self.ids, head=self.head, discard=True)
            except Exception:  # the server expires it anyway (--pending-grad-ttl-seconds)
                pass

    def __del__(self):
        self.discard()


def _trains_head(accumulate_weight_grad: bool) -> bool:
    """A forward adds to the head's dW only where a backward can follow: grad mode on (not no_grad,
    not inference_mode)."""
    return accumulate_weight_grad and torch.is_grad_enabled()


def _anchor(trains: bool):
    """A tensor that requires grad, as an extra input of a head-training op: autograd then calls its
    backward (which commits dW) even when the hidden states are detached (a frozen body)."""
    return torch.empty(0, requires_grad=True) if trains else None


def _row_group(process_group):
    """The tensor-parallel group whose ranks hold the same rows (lce_client._group), or None."""
    if process_group is None:
        return None
    from ._group import RowGroup

    return RowGroup(process_group)


def _uniform(g: torch.Tensor) -> Optional[float]:
    """The one value of a per-token upstream gradient when all its elements are equal (a sum or mean
    of a reduction="none" loss), else None."""
    flat = g.detach().reshape(-1)
    if flat.numel() == 0:
        return 0.0
    first = flat[0]
    return float(first) if bool((flat == first).all()) else None


class _RemoteLCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, anchor, client, opts):
        divisor, trains, group = opts["divisor"], opts["trains"], opts["group"]
        ctx.client, ctx.opts, ctx.hidden_dtype, ctx.backwards = client, opts, hidden.dtype, 0
        res = None
        if group is None or group.leader:  # a group's rows go to the server once
            wire = _wire_hidden(client, hidden, opts["head"], opts["cast"])
            # With a divisor: the sum's per-row upstream gradient 1 / divisor goes to the server (as grad_loss
            # of reduction "none"), so that d_hidden and a pending dW are those of sum / divisor.
            extras = opts["extras"]
            res = _via_cuda_ipc(opts["cuda_session"], wire, True, lambda w, kw: client.forward_backward(
                w, targets, reduction="none" if divisor is not None else opts["reduction"],
                ignore_index=opts["ignore_index"], label_smoothing=opts["label_smoothing"], z_loss=opts["z_loss"],
                temperature=opts["temperature"], softcap=opts["softcap"], head=opts["head"],
                grad_loss=torch.full(tuple(targets.shape), 1.0 / divisor) if divisor is not None else None,
                class_weights=opts["class_weights"], return_z_loss="z_loss" in extras, argmax="argmax" in extras,
                accumulate_weight_grad=trains, defer_weight_grad=trains, **kw))
            for name in extras:
                extras[name] = getattr(res, name)
        per_token, loss, ctx.d_hidden, ctx.valid_tokens = _shared_answers(group, res, hidden, targets)
        # The pending dW is the leader's to commit (the group's one contribution).
        ctx.pending = PendingWeightGrad(client, opts["head"], res.pending_grads) if trains and res is not None else None
        if opts["backward_mode"] == "rpc" or trains:
            ctx.save_for_backward(hidden, targets)
        if opts["reduction"] == "none":
            return per_token.to(hidden.device)
        if divisor is not None:
            total = torch.as_tensor(per_token).detach().to("cpu", torch.float64).sum().item()
            return torch.tensor(total / divisor, dtype=torch.float32, device=hidden.device)
        return torch.tensor(loss, dtype=torch.float32, device=hidden.device)

    @staticmethod
    def backward(ctx, grad_out):
        opts = ctx.opts
        per_token = opts["reduction"] == "none"
        scalar = _uniform(grad_out) if per_token else float(grad_out)
        ctx.backwards += 1
        if opts["backward_mode"] == "rpc" or (opts["trains"] and (scalar is None or ctx.backwards > 1)):
            # Per-token upstream gradients, or a second backward of a retained graph: the server computes
            # d_hidden and (training the head) dW again with them.
            d = _recompute(ctx, grad_out)
            return d, None, None, None, None
        if ctx.pending is not None:
            ctx.pending.commit(scalar)
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        d = ctx.d_hidden
        g = grad_out.to(device=d.device, dtype=torch.float32)
        if per_token:
            g = g.unsqueeze(-1)
        return (d.to(torch.float32) * g).to(ctx.hidden_dtype), None, None, None, None


def _shared_answers(group, res, hidden, targets):
    """(per_token_loss, loss, d_hidden, valid_tokens) of a ForwardBackward result, on every rank of a group
    (the leader's; the others pass None)."""
    if group is None:
        return res.per_token_loss, res.loss, res.d_hidden, res.valid_tokens
    lead = res is not None
    per_token = group.share(torch.as_tensor(res.per_token_loss) if lead else None, tuple(targets.shape),
                            torch.float32, hidden.device)
    d_hidden = group.share(torch.as_tensor(res.d_hidden) if lead else None, tuple(hidden.shape), torch.float32,
                           hidden.device)
    scalars = group.share(torch.tensor([res.loss, float(res.valid_tokens)], dtype=torch.float64) if lead else None,
                          (2,), torch.float64, hidden.device)
    return per_token, float(scalars[0]), d_hidden, int(scalars[1])


def _recompute(ctx, grad_out):
    """d_hidden (and, training the head, dW added at once) of sum_i g_i * loss_i with autograd's per-row
    upstream gradients g_i, from a second ForwardBackward (a group's leader's); the forward's pending dW
    is discarded."""
    opts, client, group = ctx.opts, ctx.client, ctx.opts["group"]
    hidden, targets = ctx.saved_tensors
    d = None
    if group is None or group.leader:
        if ctx.pending is not None:
            ctx.pending.discard()
        g = grad_out.detach().to("cpu", torch.float32)
        if opts["reduction"] != "none":
            valid = (targets != opts["ignore_index"]).to("cpu")
            per_row = 1.0 / opts["divisor"] if opts["divisor"] is not None else (
                1.0 / max(ctx.valid_tokens, 1) if opts["reduction"] == "mean" else 1.0)
            g = torch.where(valid, g * per_row, torch.zeros((), dtype=torch.float32)).to(torch.float32)
        wire = _wire_hidden(client, hidden, opts["head"], opts["cast"])
        res = _via_cuda_ipc(opts["cuda_session"], wire, True, lambda w, kw: client.forward_backward(
            w, targets, reduction="none", ignore_index=opts["ignore_index"],
            label_smoothing=opts["label_smoothing"], z_loss=opts["z_loss"], temperature=opts["temperature"],
            softcap=opts["softcap"], head=opts["head"], grad_loss=g.expand(tuple(targets.shape)).contiguous(),
            class_weights=opts["class_weights"], accumulate_weight_grad=opts["trains"], **kw))
        d = res.d_hidden
    if group is not None:
        d = group.share(None if d is None else torch.as_tensor(d), tuple(hidden.shape), torch.float32, hidden.device)
    if not ctx.needs_input_grad[0]:
        return None
    return torch.as_tensor(d).to(device=hidden.device, dtype=ctx.hidden_dtype)


def remote_linear_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, client: Optional[Client] = None, *,
                                reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                                z_loss: float = 0.0, temperature: float = 1.0, softcap: Optional[float] = None,
                                head: Optional[str] = None, cast: bool = True, accumulate_weight_grad: bool = False,
                                backward_mode: str = "scale", cuda_session=None,
                                divisor: Optional[float] = None, process_group=None,
                                sequence_parallel: bool = False, ce_weight=None, return_z_loss: bool = False,
                                return_token_accuracy: bool = False, return_predicted_tokens: bool = False):
    """Functional form of RemoteLinearCrossEntropy. divisor (reduction "sum" only): the loss is the sum
    divided by it (Hugging Face's num_items_in_batch: the valid tokens of a whole accumulated batch), and
    d_hidden and an accumulated dW are those of the quotient.

    accumulate_weight_grad: train the head on the server with autograd's gradient. The forward's dW is
    held pending on the server and added when the backward runs, scaled by the upstream gradient the
    loss receives (loss / k, weighted sums, a per-token grad_output of reduction "none": the latter
    recomputes); a forward under no_grad / inference_mode adds nothing, and one whose loss is dropped
    without a backward is discarded (docs/MATH.md, "When dW is committed").

    process_group: a tensor-parallel group whose ranks all hold these rows (Megatron's output layer
    without sequence parallelism): the group's first rank makes the one request, every rank gets the
    loss and the whole d_hidden through torch.distributed, and dW is added once. With
    sequence_parallel, each rank holds its own shard of the rows instead: each sends its shard (no
    gather), gets its rows' d_hidden (and per-token losses), and adds its rows' dW; a reduced loss is the
    group's (the mean over the group's valid tokens), the same on every rank.

    Liger-Kernel's options (liger_fused_linear_cross_entropy): ce_weight [V] class weights (PyTorch's
    cross_entropy(weight=); "mean" divides by the non-ignored targets' weights, and a z-loss by their count,
    as Liger does); return_z_loss, return_token_accuracy, return_predicted_tokens: the answer is then a
    CrossEntropyOutput (Liger's fields; the extra outputs are not differentiable)."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be none, sum or mean, got {reduction!r}")
    if divisor is not None and (reduction != "sum" or not divisor > 0):
        raise ValueError(f"divisor applies to reduction='sum' and must be > 0, got {divisor!r} with {reduction!r}")
    if backward_mode not in ("scale", "rpc"):
        raise ValueError("backward_mode must be 'scale' or 'rpc'")
    if backward_mode == "rpc" and reduction != "none":
        raise ValueError("backward_mode='rpc' applies to reduction='none' (sum and mean scale by a scalar)")
    client = client or get_default_client()
    if sequence_parallel and (ce_weight is not None or return_z_loss or return_token_accuracy
                              or return_predicted_tokens):
        raise ValueError("ce_weight and the return_* outputs are not available with sequence_parallel")
    if process_group is not None and sequence_parallel:
        return _sequence_parallel_loss(hidden, targets, client, process_group, reduction=reduction, divisor=divisor,
                                       ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                                       temperature=temperature, softcap=softcap, head=head, cast=cast,
                                       accumulate_weight_grad=accumulate_weight_grad, backward_mode=backward_mode,
                                       cuda_session=cuda_session)
    trains = _trains_head(accumulate_weight_grad)
    extras = {name: None for name, wanted in (("z_loss", return_z_loss),
                                              ("argmax", return_token_accuracy or return_predicted_tokens)) if wanted}
    if extras and process_group is not None:
        raise ValueError("return_z_loss / return_token_accuracy / return_predicted_tokens: not with a process_group")
    weights = _ClassWeights.of(ce_weight, targets, ignore_index, reduction, z_loss)
    if weights.divisor is not None:
        reduction, divisor, z_loss = "sum", weights.divisor, weights.z_loss
    opts = dict(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                temperature=temperature, softcap=softcap, head=head, cast=cast, trains=trains,
                backward_mode=backward_mode, cuda_session=cuda_session,
                divisor=None if divisor is None else float(divisor), group=_row_group(process_group),
                class_weights=weights.values, extras=extras)
    loss = _RemoteLCE.apply(hidden, targets, _anchor(trains), client, opts)
    if not extras:
        return loss
    return CrossEntropyOutput.of(loss, extras, targets, ignore_index, weights.original_reduction or reduction,
                                 weights.z_scale, return_z_loss, return_token_accuracy, return_predicted_tokens)


@dataclass
class CrossEntropyOutput:
    """Liger-Kernel's CrossEntropyOutput: the loss, and what return_z_loss / return_token_accuracy /
    return_predicted_tokens asked for (None otherwise), reduced as Liger reduces them: the z-loss and the
    accuracy per token for reduction "none", else the z-loss summed (divided by the valid tokens for
    "mean") and the accuracy over the valid tokens; predicted tokens are int64, -1 for ignored rows."""

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, loss, extras, targets, ignore_index, reduction, z_scale, want_z, want_acc, want_pred):
        dev = loss.device
        y = targets.detach().to("cpu")
        valid = y != ignore_index
        n = max(int(valid.sum()), 1)
        out = cls(loss)
        if want_z:
            zl = torch.as_tensor(extras["z_loss"]).to(torch.float32) * z_scale
            out.z_loss = (zl if reduction == "none" else zl.sum() / (n if reduction == "mean" else 1)).to(dev)
        if want_acc or want_pred:
            am = torch.as_tensor(extras["argmax"]).to(torch.int64)
            if want_acc:
                right = ((am == y) & valid).to(torch.float32)
                out.token_accuracy = (right if reduction == "none" else right.sum() / n).to(dev)
            if want_pred:
                out.predicted_tokens = torch.where(valid, am, torch.full_like(am, -1)).to(dev)
        return out


@dataclass
class _ClassWeights:
    """ce_weight as the op sends it: the values, and for a mean the WeightedMean's divisor, rescaled
    z-loss coefficient and z_scale (the one convention of both client paths: lce_client._weighted_mean)."""

    values: object = None
    divisor: Optional[float] = None
    z_loss: float = 0.0
    z_scale: float = 1.0
    original_reduction: Optional[str] = None

    @classmethod
    def of(cls, ce_weight, targets, ignore_index, reduction, z_loss):
        if ce_weight is None:
            return cls()
        w = torch.as_tensor(ce_weight).detach().to("cpu", torch.float32).reshape(-1).numpy()
        if reduction != "mean":
            return cls(values=w)
        wm = weighted_mean(w, targets.detach().to("cpu").numpy(), ignore_index, z_loss)
        return cls(values=w, divisor=wm.divisor, z_loss=wm.z_loss, z_scale=wm.z_scale, original_reduction="mean")


def _sequence_parallel_loss(hidden, targets, client, process_group, *, reduction, divisor, ignore_index, **kw):
    """A sequence-parallel rank's loss over its own rows (see remote_linear_cross_entropy): its request
    covers its shard; a mean divides by the group's valid tokens; the reduced loss's value is the
    group's, its gradient this rank's share (the other ranks' parts enter as constants)."""
    import torch.distributed as dist

    if reduction == "none":  # per-token losses stay with their rows
        return remote_linear_cross_entropy(hidden, targets, client, reduction="none", ignore_index=ignore_index, **kw)
    if reduction == "mean":
        valid = torch.tensor([float((targets != ignore_index).sum())], dtype=torch.float64, device=hidden.device)
        dist.all_reduce(valid, group=process_group)
        divisor = max(float(valid.item()), 1.0)
    local = remote_linear_cross_entropy(hidden, targets, client, reduction="sum", divisor=divisor,
                                        ignore_index=ignore_index, **kw)
    total = local.detach().to(torch.float64).reshape(1).clone()
    dist.all_reduce(total, group=process_group)
    return local + (total.to(local.dtype).reshape(()) - local.detach())


class RemoteLinearCrossEntropy(torch.nn.Module):
    """loss = RemoteLinearCrossEntropy(client)(hidden [..., H], targets [...]): cross-entropy of the
    server's LM head, like ``F.cross_entropy(hidden @ W.T, targets)`` with W on the server.

    reduction: "mean" (over non-ignored rows), "sum" or "none" (per-row loss, shaped like targets).
    label_smoothing, z_loss, temperature, softcap: as in docs/MATH.md. head: head name on the server.
    accumulate_weight_grad: train the head on the server: the backward adds autograd's dW to the head's
    gradient (for OptimizerStep); see remote_linear_cross_entropy.
    cuda_session: a shared-memory session of the same server (CUDA backend, same host): CUDA hidden
    states and d_hidden then stay on the GPU (CUDA IPC regions), see the module docstring.
    See the module docstring for how the backward gets d_hidden (one RPC per forward by default).
    """

    def __init__(self, client: Optional[Client] = None, *, reduction: str = "mean", ignore_index: int = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, temperature: float = 1.0,
                 softcap: Optional[float] = None, head: Optional[str] = None, cast: bool = True,
                 accumulate_weight_grad: bool = False, backward_mode: str = "scale", cuda_session=None):
        super().__init__()
        self.client = client
        self.kw = dict(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
                       z_loss=z_loss, temperature=temperature, softcap=softcap, head=head, cast=cast,
                       accumulate_weight_grad=accumulate_weight_grad, backward_mode=backward_mode)
        self.cuda_session = cuda_session

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return remote_linear_cross_entropy(hidden, targets, self.client, cuda_session=self.cuda_session, **self.kw)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.kw.items())


class _RemoteLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, weight, anchor, client, opts):
        group = opts["group"]
        lp = ent = None
        if group is None or group.leader:  # a group's rows go to the server once
            wire = _wire_hidden(client, hidden, opts["head"], opts["cast"])
            lp, ent = _via_cuda_ipc(opts["cuda_session"], wire, False, lambda w, kw: client.score(
                w, targets, temperature=opts["temperature"], softcap=opts["softcap"], entropy=True,
                ignore_index=opts["ignore_index"], head=opts["head"], **kw))
        if group is not None:
            lp, ent = (group.share(None if x is None else torch.as_tensor(x), tuple(targets.shape), torch.float32,
                                   hidden.device) for x in (lp, ent))
        ctx.client, ctx.opts, ctx.hidden_dtype = client, opts, hidden.dtype
        ctx.weight_meta = None if weight is None else (weight.shape, weight.dtype, weight.device)
        ctx.save_for_backward(hidden, targets)
        ctx.set_materialize_grads(False)
        return lp.to(hidden.device), ent.to(hidden.device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        wants_weight = ctx.weight_meta is not None and ctx.needs_input_grad[2]
        if g_lp is None and g_ent is None:
            return None, None, (_zeros(ctx) if wants_weight else None), None, None, None
        hidden, targets = ctx.saved_tensors
        opts, client, group = ctx.opts, ctx.client, ctx.opts["group"]
        trains = opts["trains"]
        # The head's dW of exactly these upstream gradients: added at once when the server trains the head;
        # kept pending and read back when a local weight wants it (then committed or discarded).
        accumulate = trains or wants_weight
        d, ids = None, ()
        if group is None or group.leader:  # a group's backward is one request, dW added once
            wire = _wire_hidden(client, hidden, opts["head"], opts["cast"])
            res = _via_cuda_ipc(opts["cuda_session"], wire, True, lambda w, kw: client.backward(
                w, targets, grad_logprob=g_lp, grad_entropy=g_ent, temperature=opts["temperature"],
                softcap=opts["softcap"], ignore_index=opts["ignore_index"], head=opts["head"],
                accumulate_weight_grad=accumulate, defer_weight_grad=wants_weight, **kw))
            d, ids = (res.d_hidden, res.pending_grads) if accumulate else (res, ())
        if group is not None:
            if opts["partial_d_hidden"]:  # verl's kernel: the group's sum is d_hidden (the leader's whole one)
                d = torch.as_tensor(d) if group.leader else torch.zeros(tuple(hidden.shape), dtype=torch.float32)
            else:
                d = group.share(None if d is None else torch.as_tensor(d), tuple(hidden.shape), torch.float32,
                                hidden.device)
            if wants_weight:
                ids = group.share_ids(ids, hidden.device)
        d_weight = _pending_weight_grad(ctx, ids) if wants_weight else None
        d_hidden = (torch.as_tensor(d).to(device=hidden.device, dtype=ctx.hidden_dtype) if ctx.needs_input_grad[0]
                    else None)
        return d_hidden, None, d_weight, None, None, None


def _pending_weight_grad(ctx, ids) -> torch.Tensor:
    """The local weight's gradient from the call's pending contributions (one a stream of a split
    request: their sum), read by every rank of a group; then the leader commits them (the server trains
    the head too) or discards them."""
    opts, client, group = ctx.opts, ctx.client, ctx.opts["group"]
    pending = PendingWeightGrad(client, opts["head"], ids if group is None or group.leader else ())
    try:
        parts = [torch.from_numpy(client.get_grad(head=opts["head"], pending_grad=i)) for i in ids]
    finally:
        if group is not None:
            group.barrier()  # every rank has read them
        if opts["trains"]:
            pending.commit(1.0)
        else:
            pending.discard()
    return _weight_rows(ctx, sum(parts[1:], parts[0])) if parts else _zeros(ctx)


def _zeros(ctx):
    shape, dtype, device = ctx.weight_meta
    return torch.zeros(shape, dtype=dtype, device=device)


def _weight_rows(ctx, full: torch.Tensor) -> torch.Tensor:
    """The local weight's gradient: the whole head's dW, or the rows of its shard (verl's vocabulary
    shard of a tensor-parallel rank: [V / k, H] at rank * V / k)."""
    shape, dtype, device = ctx.weight_meta
    rank = ctx.opts["weight_rank"]
    rows = shape[0]
    return full[rank * rows:(rank + 1) * rows].to(device=device, dtype=dtype)


def remote_logprobs(hidden: torch.Tensor, targets: torch.Tensor, client: Optional[Client] = None, *,
                    temperature: float = 1.0, softcap: Optional[float] = None, ignore_index: int = -100,
                    head: Optional[str] = None, cast: bool = True, cuda_session=None,
                    accumulate_weight_grad: bool = False, weight: Optional[torch.Tensor] = None,
                    weight_rank: int = 0, process_group=None, partial_d_hidden: bool = False):
    """(logprobs, entropy) of targets under the remote head, fp32, shaped like targets, differentiable
    w.r.t. hidden: the backward makes one Backward RPC with the upstream grads of both outputs.
    cuda_session: as in RemoteLinearCrossEntropy (CUDA IPC regions instead of bytes on the wire).
    accumulate_weight_grad: that Backward also adds the head's dW of those upstream grads on the server
    (autograd's gradient: nothing without a backward). weight: a local tensor equal to the served head (or
    the rows of rank `weight_rank`'s equal shard of it) that gets the head's gradient of this call, read
    back from the server (GetGrad of the call's pending contribution: V·H·4 bytes over the wire).
    process_group: a tensor-parallel group whose ranks all hold these rows (no sequence parallelism):
    its first rank makes the one Score (and Backward) and the answers reach every rank through
    torch.distributed; dW is added once; each rank gets the whole d_hidden (what Megatron's column-parallel
    layer gives after its all-reduce), or with partial_d_hidden a part whose sum over the group is the whole
    (verl's kernel: each rank's vocab shard's part, summed by the caller's all-reduce or sequence-parallel
    reduce-scatter): the first rank's is the whole, the others' zeros, and no d_hidden crosses the group."""
    client = client or get_default_client()
    trains = _trains_head(accumulate_weight_grad)
    group = _row_group(process_group)
    opts = dict(temperature=temperature, softcap=softcap, ignore_index=ignore_index, head=head, cast=cast,
                cuda_session=cuda_session, trains=trains, weight_rank=weight_rank, group=group,
                partial_d_hidden=partial_d_hidden)
    if weight is not None and not (weight.requires_grad and torch.is_grad_enabled()):
        weight = None
    return _RemoteLogprobs.apply(hidden, targets, weight, _anchor(trains), client, opts)


def serve_linear(linear: torch.nn.Linear, client: Optional[Client] = None, head: str = "lm-head", *,
                 train: bool = False, **loss_options) -> RemoteLinearCrossEntropy:
    """Serves an existing ``nn.Linear`` [vocab, hidden] (an LM head) as head `head` on the server (LoadHead
    of its shape and dtype, then UpdateWeights with its exact values; admin token where auth is on) and
    returns the loss module over it: ``loss = serve_linear(model.lm_head, client)(hidden, targets)``.
    train: the head trains on the server (autograd's gradient, see remote_linear_cross_entropy; step it
    with Client.optimizer_step). loss_options: RemoteLinearCrossEntropy's (reduction, label_smoothing, ...).
    A linear with a bias is served with it (fp32 on the server, trained with the weight; CPU engine)."""
    dtypes = {v: k for k, v in _TORCH_DTYPES.items()}
    weight = linear.weight.detach()
    if weight.dtype not in dtypes:
        raise TypeError(f"serve_linear: a {weight.dtype} weight; the service holds fp32, bf16 or fp16 heads")
    client = client or get_default_client()
    vocab, hidden = weight.shape
    client.load_head(head, seeded=(vocab, hidden, 0, dtypes[weight.dtype]), bias=linear.bias is not None)
    client.update_weights(weight.cpu().contiguous(), head=head, bias=linear.bias)
    client.zero_grad(head=head)
    return RemoteLinearCrossEntropy(client, head=head, accumulate_weight_grad=train, **loss_options)
