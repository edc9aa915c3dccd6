"""RL training loops (verl, TRL, OpenRLHF style) with the loss head on lce-serve.

* ``linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)`` — verl's
  fused-kernel contract (``verl.utils.kernel.linear_cross_entropy``): per-token ``(logprobs, entropy)``
  of ``labels`` under ``softmax(hidden @ weight.T / temperature)``, differentiable w.r.t. ``hidden``.
  A verl user swaps one import::

      # from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
      from lce_client.rl import linear_cross_entropy
      lce_client.rl.set_head(client, head="policy")          # once: which server and head to use

  Shapes as verl's kernel: ``hidden`` [..., T, H] (verl: [1, T, H] or [T, H]) and ``labels`` [..., T] are
  flattened to the token dimension, so ``entropy`` is [N] (N = all tokens) whatever the reduction, and
  ``logprobs`` is [N] for ``reduction="none"`` and a scalar for "sum" / "mean"; the backward takes
  upstream gradients of those shapes (verl's test: ``g_logprobs``, ``g_entropy`` of shape [N]) and
  returns d_hidden shaped like ``hidden``. "mean" divides by the valid tokens (verl's kernel: by all
  tokens; the same where no label is ``ignore_index``, which verl's kernel has no notion of).

  The **weight argument is checked, not used**: the logits are those of the head the server serves. Its
  shape must be the served head's ``[vocab, hidden]`` (with a ``dist_process_group`` of k ranks: a
  vocab shard ``[vocab / k, hidden]``, verl's tensor-parallel layout), or a ValueError names both; its
  values are not compared (keep the server's head equal to it: ``Client.update_weights``, or
  ``lce_client.hf.apply_remote_head``). ``weight=None`` skips the check.
  **The weight's gradient** (verl's kernel returns ``d_weight``): a weight that requires grad is an input
  of the op, and the backward gives it the served head's dW of exactly this call's upstream gradients
  (the Backward RPC adds it to a pending contribution, which the client reads back with ``GetGrad`` and
  discards: V·H·4 bytes over the wire, so for tests and small heads; with a ``dist_process_group`` the
  rank's rows of it), so ``torch.autograd.grad(..., (hidden, weight))`` works as verl's test writes it.
  To train the head where it lives instead, pass ``accumulate_weight_grad`` to
  ``lce_client.torch.remote_logprobs`` (or use ``remote_policy_loss``) and step with
  ``Client.optimizer_step``. With ``dist_process_group`` (a tensor-parallel group whose ranks hold the
  same rows) the group's first rank makes the group's one request and the answers reach the others
  through torch.distributed: the server sees each hidden state once and adds dW once; every rank gets
  the whole logprobs and entropy, and d_hidden as verl's kernel gives it: a part a rank whose sum over
  the group is the whole (verl's kernel: the rank's vocab shard's part; its caller sums them, by an
  all-reduce or the reduce-scatter of Megatron's sequence-parallel gather): here the first rank's is
  the whole and the others' zeros.
  ``ignore_index`` (-100) rows get logprob 0 and are left out of "sum" / "mean" (their entropy is
  still computed).
* ``per_token_logps(model, input_ids, attention_mask, logits_to_keep, ...)`` — TRL's
  ``GRPOTrainer._get_per_token_logps_and_entropies``: the logprobs (and entropies) of the last
  ``logits_to_keep`` tokens of each sequence under a Hugging Face causal LM whose head is on the server,
  ``[B, logits_to_keep]``, without logits (TRL's ``selective_log_softmax`` / ``entropy_from_logits`` of
  the logits, computed by the server).
* ``remote_policy_loss(hidden, targets, old_logprobs, advantages, ...)`` — the fused PPO / GRPO loss
  (``Client.policy_loss``, docs/MATH.md) as a differentiable scalar: one PolicyLoss round trip returns the
  loss and d_hidden; the backward hands d_hidden to the body. With ``accumulate_weight_grad=True`` the
  server also accumulates the head's dW for ``Client.optimizer_step``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._client import Client
from .torch import PendingWeightGrad, _anchor, _trains_head, _wire_hidden, get_default_client, remote_logprobs

__all__ = ["linear_cross_entropy", "set_head", "per_token_logps", "remote_policy_loss", "PolicyLossStats"]

_default = {"client": None, "head": None}


def set_head(client: Optional[Client], head: Optional[str] = None) -> None:
    """The client and head that linear_cross_entropy uses when given none (default: the torch module's
    default client — set_default_client or $LCE_TARGET — and its default head)."""
    _default["client"], _default["head"] = client, head


def _check_weight(client: Client, head: Optional[str], weight, dist_process_group) -> None:
    if weight is None:
        return
    info = client.head_info(head)
    ranks = 1
    if dist_process_group is not None:
        import torch.distributed as dist

        ranks = dist.get_world_size(dist_process_group)
    want = (info.vocab_size // ranks if info.vocab_size % ranks == 0 else None, info.hidden_size)
    if tuple(weight.shape) != want:
        raise ValueError(f"weight of shape {tuple(weight.shape)} is not the served head "
                         f"{info.name!r} {info.vocab_size}x{info.hidden_size}"
                         + (f" split over {ranks} ranks" if ranks > 1 else "")
                         + ": the server computes with its own head; point set_head at the head this weight is")


def linear_cross_entropy(hidden: torch.Tensor, weight: Optional[torch.Tensor], labels: torch.Tensor,
                         temperature: Optional[float] = 1.0, reduction: Optional[str] = "none",
                         dist_process_group=None, *, client: Optional[Client] = None, head: Optional[str] = None,
                         softcap: Optional[float] = None, ignore_index: int = -100,
                         **_ignored) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's fused linear cross-entropy, served remotely: (logprobs, entropy) over the flattened tokens
    (entropy [N] always; logprobs [N], or a scalar for "sum" / "mean"). See the module docstring for the
    shapes, the weight (checked against the served head's shape, not used in the forward; a weight that
    requires grad gets the served head's gradient of this call, or its rank's rows of it, read back
    from the server in the backward) and the process group. Extra keywords of verl's function (e.g.
    impl_backend) are accepted and ignored."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    client = client or _default["client"] or get_default_client()
    head = head if head is not None else _default["head"]
    _check_weight(client, head, weight, dist_process_group)
    # verl's kernel views hidden as [N, H] and labels as [N] and answers per flattened token.
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_labels.shape[0] != flat_hidden.shape[0]:
        raise ValueError(f"labels of shape {tuple(labels.shape)} for hidden states {tuple(hidden.shape)}: "
                         f"{flat_labels.shape[0]} labels for {flat_hidden.shape[0]} tokens")
    rank = 0
    if dist_process_group is not None:
        import torch.distributed as dist

        rank = dist.get_rank(dist_process_group)
    lp, ent = remote_logprobs(flat_hidden, flat_labels, client,
                              temperature=1.0 if temperature is None else temperature, softcap=softcap,
                              ignore_index=ignore_index, head=head, weight=weight, weight_rank=rank,
                              process_group=dist_process_group, partial_d_hidden=True)
    if reduction == "none":
        return lp, ent
    # As verl's kernel: only the logprobs are reduced; the entropy stays per token.
    if reduction == "sum":
        return lp.sum(), ent
    n = (flat_labels != ignore_index).sum().clamp(min=1).to(lp.device)
    return lp.sum() / n, ent


def per_token_logps(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], logits_to_keep: int,
                    *, client: Optional[Client] = None, head: Optional[str] = None, temperature: float = 1.0,
                    compute_entropy: bool = False, batch_size: Optional[int] = None, remote_head=None):
    """TRL's per-token logprobs of the completion tokens: for [B, L] input_ids, the logprobs of the last
    `logits_to_keep` tokens, each under the logits of the position before it divided by `temperature`,
    [B, logits_to_keep] (and the entropies when compute_entropy; else None). The body runs here
    (model.base_model), the head on the server: `remote_head` (lce_client.hf.apply_remote_head's handle)
    or `client` + `head`; the model config's final_logit_softcapping applies. Differentiable w.r.t. the
    body's parameters (a Backward RPC in the backward). batch_size: rows of input_ids per body forward."""
    if remote_head is not None:
        client, head = remote_head.client, remote_head.head
    client = client or get_default_client()
    softcap = getattr(model.config, "final_logit_softcapping", None) or None
    step = batch_size or input_ids.shape[0]
    lps, ents = [], []
    for i in range(0, input_ids.shape[0], step):
        ids = input_ids[i:i + step]
        mask = attention_mask[i:i + step] if attention_mask is not None else None
        hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden = hidden[:, -logits_to_keep - 1:-1, :]
        lp, ent = remote_logprobs(hidden, ids[:, -logits_to_keep:], client, temperature=temperature,
                                  softcap=softcap, head=head)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if compute_entropy else None)


class PolicyLossStats(dict):
    """The statistics of a remote_policy_loss call: clip_fraction, approx_kl, mean_entropy, mean_ratio,
    mean_kl, valid_tokens, head_version, and the per-token logprobs / entropy (detached)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _RemotePolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, anchor, client, kw, stats):
        wire = _wire_hidden(client, hidden, kw.get("head"), True)
        trains = kw.pop("_trains")
        r = client.policy_loss(wire, targets, **dict(kw, accumulate_weight_grad=trains, defer_weight_grad=trains))
        ctx.d_hidden, ctx.hidden_dtype = r.d_hidden, hidden.dtype
        ctx.client, ctx.kw, ctx.pending = client, kw, (PendingWeightGrad(client, kw.get("head"), r.pending_grads)
                                                       if trains else None)
        if trains:
            ctx.save_for_backward(hidden, targets)
        stats.update(clip_fraction=r.clip_fraction, approx_kl=r.approx_kl, mean_entropy=r.mean_entropy,
                     mean_ratio=r.mean_ratio, mean_kl=r.mean_kl, valid_tokens=r.valid_tokens,
                     head_version=r.head_version, logprobs=r.logprobs, entropy=r.entropy)
        return torch.tensor(r.loss, dtype=torch.float32, device=hidden.device)

    @staticmethod
    def backward(ctx, grad_out):
        scale = float(grad_out)
        if ctx.pending is not None:
            if not ctx.pending.open:
                # A second backward of a retained graph: the same contribution again, made anew.
                hidden, targets = ctx.saved_tensors
                wire = _wire_hidden(ctx.client, hidden, ctx.kw.get("head"), True)
                r = ctx.client.policy_loss(wire, targets, **dict(ctx.kw, accumulate_weight_grad=True,
                                                                  defer_weight_grad=True))
                ctx.pending = PendingWeightGrad(ctx.client, ctx.kw.get("head"), r.pending_grads)
            ctx.pending.commit(scale)
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        d = ctx.d_hidden
        g = grad_out.to(device=d.device, dtype=torch.float32)
        return (d.to(torch.float32) * g).to(ctx.hidden_dtype), None, None, None, None, None


def remote_policy_loss(hidden: torch.Tensor, targets: torch.Tensor, old_logprobs, advantages,
                       client: Optional[Client] = None, **kw) -> Tuple[torch.Tensor, PolicyLossStats]:
    """The fused PPO / GRPO policy loss of Client.policy_loss (same keywords: ref_logprobs, sequence_ids,
    clip_low, clip_high, aggregation, entropy_coef, kl_coef, kl_estimator, temperature, softcap, head,
    accumulate_weight_grad, ...) as (loss, stats): the loss is a differentiable scalar whose backward
    returns the server's d_hidden (one PolicyLoss round trip in all). accumulate_weight_grad: the head's
    dW is held pending and added, times the loss's upstream gradient, by the backward; nothing under
    no_grad (see lce_client.torch.remote_linear_cross_entropy)."""
    client = client or get_default_client()
    stats = PolicyLossStats()
    trains = _trains_head(kw.pop("accumulate_weight_grad", False))
    kw.pop("defer_weight_grad", None)
    loss = _RemotePolicyLoss.apply(hidden, targets, _anchor(trains), client,
                                   dict(kw, old_logprobs=old_logprobs, advantages=advantages, _trains=trains), stats)
    return loss, stats
