"""Megatron-Core's output layer with the loss head on lce-serve.

``LinearCrossEntropyModule`` has the interface of Megatron-LM's
``megatron.core.transformer.linear_cross_entropy.LinearCrossEntropyModule`` (a ``ColumnParallelLinear``
whose forward returns the loss instead of logits when asked). The PyPI release megatron-core 0.19.x has
no such module: there the GPT output layer is a plain ``ColumnParallelLinear`` and the loss is
``compute_language_model_loss`` (``vocab_parallel_cross_entropy`` or ``fused_vocab_parallel_cross_entropy``
on its logits); ``output_processor`` plugs this module into 0.19's ``GPTModel.forward`` in its place.

* ``forward(input_, weight=None, runtime_gather_output=None, output_cross_entropy_loss=False,
  labels=None, reduction="none", ignore_index=-100)``: without ``output_cross_entropy_loss``, the plain
  ``ColumnParallelLinear`` (local logits, e.g. for generation). With it: ``input_`` [s, b, h] (with
  sequence parallelism the rank's shard [s/tp, b, h]), ``labels`` [b, s] (the whole sequence on every
  rank, as Megatron's layer takes them), and the per-token loss [b, s] (Megatron's module and
  ``compute_language_model_loss`` return [b, s]; the server works on the [s, b] rows), or its sum /
  mean over the tokens whose label is not ``ignore_index``. Every rank of the TP group gets the whole
  loss, as from Megatron's layer.
* ``logprobs_and_entropy(input_, labels, temperature=1.0, weight=None)`` -> (logprobs, entropy), each
  [b, s]: what verl's Megatron actor computes with its fused kernel (``log_probs``, ``entropy``), for RL.
* Tensor parallelism: the group is the layer's ``tp_group``. Without sequence parallelism the ranks hold
  the same rows: the group's first rank sends them (one request a group) and every rank gets the
  answers and the whole d_hidden (what Megatron's column-parallel layer gives after its all-reduce).
  With ``config.sequence_parallel`` each rank sends the shard it holds (no gather first), gets its
  rows' d_hidden, and the per-token answers are gathered so that every rank has the whole [b, s].
* The weight: Megatron's vocab shard [V/tp, H] of this rank. The server holds the whole head [V, H]
  (load it once: ``serve_megatron_weight``). ``train_head``:
  ``None`` the head is frozen (the weight gets no gradient: set ``weight.requires_grad = False``);
  ``"server"`` dW accumulates on the server, committed with autograd's upstream gradient in the backward
  (docs/MATH.md, "When dW is committed"), once per group, and ``Client.optimizer_step`` steps it;
  ``"local"`` the weight gets this rank's rows of dW as its autograd gradient, so Megatron's DDP hook
  adds it into ``main_grad`` (``param.grad`` -> ``main_grad.add_``, as for any parameter whose
  gradient autograd returns) and Megatron's optimizer steps it; then ``serve_megatron_weight`` sends
  the new weight. ``"local"`` reads the whole dW back from the server (V·H·4 bytes a call and rank).
* Pipeline parallelism: only the last stage (``post_process``) has an output layer and calls this.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from .torch import get_default_client, remote_linear_cross_entropy, remote_logprobs

__all__ = ["LinearCrossEntropyModule", "remote_output_layer", "output_processor", "logprobs_output_processor",
           "serve_megatron_weight", "gather_shards"]

_TRAIN_HEAD = (None, "server", "local")


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, group, dim, sum_grads):
        ctx.group, ctx.dim, ctx.size, ctx.sum_grads = group, dim, shard.shape[dim], sum_grads
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_grads:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)  # with the slice below: a reduce-scatter (gloo has none)
        rank = dist.get_rank(ctx.group)
        return grad.narrow(ctx.dim, rank * ctx.size, ctx.size), None, None, None


def gather_shards(shard: torch.Tensor, group, dim: int = 0, sum_grads: bool = False) -> torch.Tensor:
    """The group's equal shards concatenated along `dim` in rank order, on every rank, differentiable:
    the backward gives each rank its slice of the upstream gradient, summed over the group first with
    ``sum_grads``. Megatron's ``gather_from_sequence_parallel_region`` is (dim 0, sum_grads=True; with
    ``tensor_parallel_output_grad=False``, sum_grads=False) and ``gather_from_tensor_model_parallel_region``
    (the last dim, sum_grads=False), on any backend (Megatron's own allocate on CUDA)."""
    return _Gather.apply(shard, group, dim, sum_grads)


class _WholeVocab(torch.autograd.Function):
    """A stand-in [V, H] for the rank's vocab shard [V/tp, H] (only its shape is read: the logits are the
    server's), whose gradient, the whole head's dW over this rank's tokens (sequence parallelism), is
    summed over the group and sliced to the shard's rows: the shard's gradient over all the tokens."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group, ctx.rows = group, shard.shape[0]
        return shard.new_zeros((shard.shape[0] * dist.get_world_size(group), shard.shape[1]))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


class LinearCrossEntropyModule(tensor_parallel.ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` output layer whose loss (and logprobs / entropy) come from
    the lce-serve head: the constructor is ``ColumnParallelLinear``'s plus the keywords ``client``,
    ``head`` and ``train_head``; see the module docstring."""

    def __init__(self, *args, client=None, head: Optional[str] = None, train_head: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        _configure(self, client, head, train_head)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None, output_cross_entropy_loss: bool = False,
                labels: Optional[torch.Tensor] = None, reduction: str = "none", ignore_index: int = -100):
        if not output_cross_entropy_loss:
            return super().forward(input_, weight, runtime_gather_output)
        if labels is None:
            raise ValueError("labels cannot be None when outputting cross-entropy loss")
        if reduction not in ("none", "sum", "mean"):
            raise ValueError(f"reduction must be none, sum or mean, got {reduction!r}")
        per_token = self._per_token(input_, weight, labels, ignore_index, None)[0]
        if reduction == "none":
            return per_token
        total = per_token.sum()
        if reduction == "sum":
            return total
        return total / (labels != ignore_index).sum().clamp(min=1).to(total.device)

    def logprobs_and_entropy(self, input_: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                             weight: Optional[torch.Tensor] = None, ignore_index: int = -100):
        """(logprobs, entropy) of labels [b, s] under softmax(logits / temperature), each [b, s] on every
        rank, differentiable w.r.t. input_ (and the weight with train_head="local")."""
        return self._per_token(input_, weight, labels, ignore_index, float(temperature))

    def _per_token(self, input_, weight, labels, ignore_index, temperature):
        """[b, s] answers: the loss (temperature None) or (logprobs, entropy)."""
        s_local, b, h = input_.shape
        group, size, rank = self.tp_group, self._lce["size"], self._lce["rank"]
        sp = self.sequence_parallel and size > 1
        if tuple(labels.shape) != (b, s_local * (size if sp else 1)):
            raise ValueError(f"labels {tuple(labels.shape)} for hidden states {tuple(input_.shape)}"
                             + (f" (a sequence-parallel shard of {size})" if sp else "") + ": want [b, s]")
        rows = s_local * b
        flat_labels = labels.transpose(0, 1).reshape(-1)  # [s, b] rows, as the hidden states
        if sp:
            flat_labels = flat_labels[rank * rows:(rank + 1) * rows]
        hidden = input_.reshape(rows, h)
        outs = self._remote(hidden, flat_labels, weight, ignore_index, temperature, None if sp else group)
        if sp:
            outs = tuple(gather_shards(o, group) for o in outs)  # the same upstream gradient on every rank
        return tuple(o.view(-1, b).transpose(0, 1) for o in outs)

    def _remote(self, hidden, labels, weight, ignore_index, temperature, row_group):
        """The server's per-row answers for rows that `row_group` (None: this rank alone) holds."""
        opts = self._lce
        client = opts["client"] or get_default_client()
        local = opts["train_head"] == "local"
        if temperature is None and not local:
            # One ForwardBackward: the loss and d_hidden (and a pending dW) together.
            loss = remote_linear_cross_entropy(hidden, labels, client, reduction="none", ignore_index=ignore_index,
                                               head=opts["head"], accumulate_weight_grad=opts["train_head"] == "server",
                                               process_group=row_group)
            return (loss,)
        w = self.weight if weight is None else weight
        rank = opts["rank"]
        if local and row_group is None and opts["size"] > 1:
            w, rank = _WholeVocab.apply(w, self.tp_group), 0
        lp, ent = remote_logprobs(hidden, labels, client, temperature=1.0 if temperature is None else temperature,
                                  ignore_index=ignore_index, head=opts["head"], weight=w if local else None,
                                  weight_rank=rank, process_group=row_group,
                                  accumulate_weight_grad=opts["train_head"] == "server")
        return (-lp,) if temperature is None else (lp, ent)


def _configure(layer, client, head, train_head) -> None:
    if train_head not in _TRAIN_HEAD:
        raise ValueError(f"train_head must be one of {_TRAIN_HEAD}, got {train_head!r}")
    if getattr(layer, "bias", None) is not None:
        raise ValueError("the output layer has a bias, which the service's heads do not have")
    group = layer.tp_group
    layer._lce = dict(client=client, head=head, train_head=train_head,
                      size=dist.get_world_size(group) if group is not None else 1,
                      rank=dist.get_rank(group) if group is not None else 0)


def remote_output_layer(layer: tensor_parallel.ColumnParallelLinear, client=None, head: Optional[str] = None,
                        train_head: Optional[str] = None) -> LinearCrossEntropyModule:
    """Turns a built model's output layer (``GPTModel.output_layer``) into a LinearCrossEntropyModule in
    place: the same object, Parameter, state-dict keys and hooks (Megatron's DDP and optimizer keep
    referring to them); only its class and the lce settings change."""
    if not isinstance(layer, tensor_parallel.ColumnParallelLinear):
        raise TypeError(f"a ColumnParallelLinear output layer is needed, got {type(layer).__name__}")
    layer.__class__ = LinearCrossEntropyModule
    _configure(layer, client, head, train_head)
    return layer


def output_processor(*, hidden_states, output_layer, output_weight=None, labels=None,
                     runtime_gather_output=None, scale_logits=None, config=None, **_unused):
    """``GPTModel.forward(..., output_processor=output_processor)`` (megatron-core 0.19): the loss [b, s]
    from the remote head where labels are given, else the logits [b, s, v] as GPTModel returns them. The
    model's output layer must be a LinearCrossEntropyModule (``remote_output_layer``)."""
    if labels is None:
        logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        if scale_logits is not None:
            logits = scale_logits(logits)
        return logits.transpose(0, 1).contiguous()
    if config is not None and getattr(config, "use_mup", False) and getattr(config, "mup_output_mult", 1.0) != 1.0:
        raise ValueError("MuP output scaling (mup_output_mult != 1) scales the logits; the service's heads do not")
    return output_layer(hidden_states, weight=output_weight, output_cross_entropy_loss=True, labels=labels)


def logprobs_output_processor(*, hidden_states, output_layer, output_weight=None, labels=None, input_ids=None,
                              context=None, **_unused):
    """``GPTModel.forward(..., output_processor=logprobs_output_processor,
    output_processor_context={"temperature": t})``: (logprobs, entropy) [b, s] of `labels`, or where none
    are given of the next tokens (``input_ids`` rolled left by one, the last position's label being the
    first token, as verl and AReaL roll them), instead of the logits that RL frameworks turn into them."""
    if labels is None:
        labels = torch.roll(input_ids, shifts=-1, dims=-1)
    temperature = (context or {}).get("temperature", 1.0)
    return output_layer.logprobs_and_entropy(hidden_states, labels, temperature=temperature, weight=output_weight)


def serve_megatron_weight(layer: tensor_parallel.ColumnParallelLinear, client, head: str, *,
                          load: bool = False) -> None:
    """Makes the server's head `head` the layer's whole weight: the TP group's shards are gathered in
    rank order and the group's first rank sends them (UpdateWeights; with ``load``, LoadHead of the
    head's shape and dtype first). Call it on every rank of the group: at the start, and after each
    optimizer step with train_head="local"."""
    weight = layer.weight.detach()
    group = layer.tp_group
    size = dist.get_world_size(group) if group is not None else 1
    parts = [torch.empty_like(weight) for _ in range(size)]
    if size > 1:
        dist.all_gather(parts, weight.contiguous(), group=group)
    else:
        parts = [weight]
    if size == 1 or dist.get_rank(group) == 0:
        full = torch.cat(parts).cpu().contiguous()
        if load:
            dtypes = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
            client.load_head(head, seeded=(full.shape[0], full.shape[1], 0, dtypes[full.dtype]))
        client.update_weights(full, head=head)
        if load:
            client.zero_grad(head=head)
    if size > 1:
        dist.barrier(group=group)
