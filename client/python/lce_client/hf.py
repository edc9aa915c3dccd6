"""Hugging Face transformers: serve a causal LM's head from lce-serve, in one call.

    from transformers import AutoModelForCausalLM
    from lce_client import Client
    from lce_client.hf import apply_remote_head

    model = AutoModelForCausalLM.from_pretrained(...)
    rh = apply_remote_head(model, Client("gpu-host:50051"), head="my-model")   # uploads lm_head.weight
    out = model(input_ids, attention_mask=mask, labels=input_ids)              # out.loss from the server
    out.loss.backward()                                                         # d_hidden flows into the body
    out = model(input_ids, labels=labels, return_logprobs=True, return_entropy=True)
    out.logprobs, out.entropy                                                   # [B, T], differentiable

What `apply_remote_head` does:

* Puts the model's `lm_head.weight` on the server as the head `head` (LoadHead of a head of the same
  shape and dtype, then UpdateWeights with the exact weight); `upload=False` uses a head already there
  (its shape is checked).
* Patches the model instance's `forward` (the class is left alone; `rh.remove()` undoes it). With
  `labels` (or `shift_labels`), or `return_logprobs` / `return_entropy`, the forward runs the body
  (`model.base_model`), keeps `logits_to_keep` positions as HF does, and sends the final hidden states to
  the server: the loss is HF's `ForCausalLMLoss` (labels shifted left by one, `ignore_index=-100`, mean
  over the valid tokens, or the sum divided by `num_items_in_batch` when given), and `logprobs` /
  `entropy` [B, T] are those of each position's next token (of the shifted labels, or of `input_ids`
  when no labels are given; 0 logprob at ignored and last positions, entropy everywhere). No logits are
  computed locally: `out.logits` is None. Gradients reach the hidden states (and so the body) through
  autograd: the loss is one ForwardBackward RPC per forward (d_hidden comes back with the loss, and
  the backward needs no call); logprobs / entropy are one Score RPC in the forward and, only if a loss
  uses them, one Backward RPC in the backward (RL losses built on them train the body, and with
  `train_head` the head too: autograd's gradient of that loss).
  Without labels or those flags (inference, `model.generate`) the original forward runs and computes
  logits with the local `lm_head`: the server has no call that returns a whole vocabulary's logits.
* `final_logit_softcapping` (Gemma 2) is the server's `softcap` (z = c * tanh(a / c), docs/MATH.md).
  Heads with a bias, and configs that scale the logits otherwise (`logit_scale`, `logits_scaling`),
  are refused with a ValueError naming the attribute rather than answered wrongly.

Training the head (`train_head`):

* `None` (default): the head is frozen on the server; the local `lm_head.weight` gets no gradient.
* `"server"`: each loss forward accumulates dW on the server (`accumulate_weight_grad`); call
  `rh.optimizer_step(lr=...)` after `loss.backward()` (AdamW on the server's fp32 master copy). The local
  `lm_head.weight` is not updated: `rh.pull_weights(directory)` copies the server's weight back (SaveHead
  into `directory`, which this process must be able to read: same host or a shared file system), e.g.
  before `generate`.
* `"local"`: each loss forward accumulates dW on the server; after `loss.backward()` call
  `rh.collect_grad()`, which adds dW to `lm_head.weight.grad` (and zeroes the server's buffer); your
  optimizer then steps `lm_head.weight` with the rest of the model, and `rh.push_weights()` sends the new
  weight to the server (UpdateWeights) before the next forward. This trains exactly as the unpatched
  model does, tied embeddings included, at the price of moving dW and W each step.
* In a `transformers.Trainer`: `callbacks=[rh.trainer_callback()]` makes these calls at the Trainer's
  optimizer steps (gradient accumulation and evaluation loops included; see `RemoteHead.trainer_callback`).

Tied embeddings (`config.tie_word_embeddings`, `lm_head.weight is embed_tokens.weight`): the tie stays in
the local model (one Parameter), and the server holds a copy of it. The head's share of the tied
weight's gradient exists only on the server: with `train_head="local"` `collect_grad()` adds it to the
shared Parameter's grad (the same sum as unpatched), and `push_weights()` keeps the server's copy equal
to the embedding. With `train_head=None` the embedding still trains through its input use, and the
server's copy goes stale until `push_weights()`; with `"server"` the two copies train apart (the tie is
broken: the server's copy learns from the output side only, the embedding from the input side only), so
`"server"` is refused for tied models unless `untie=True` says that is meant.
"""
from __future__ import annotations

import functools
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ._client import Client
from .torch import remote_linear_cross_entropy, remote_logprobs

__all__ = ["apply_remote_head", "RemoteHead", "RemoteCausalLMOutput", "shift_labels"]

_HEAD_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Config attributes that change the logits in ways the server's head does not do (refused by name).
_UNSUPPORTED_SCALINGS = ("logit_scale", "logits_scaling", "output_multiplier_scale", "lm_head_multiplier")


@dataclass
class RemoteCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast (logits None) with the server's per-token logprobs and entropy [B, T]."""

    logprobs: Optional[torch.FloatTensor] = None
    entropy: Optional[torch.FloatTensor] = None


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF's causal shift: position t is scored on labels[t + 1]; the last position is ignored."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


_shift_left = shift_labels  # (the forward's argument of the same name hides it there)


def _check_supported(model) -> None:
    cfg = model.config
    for name in _UNSUPPORTED_SCALINGS:
        v = getattr(cfg, name, None)
        if v not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__}: config.{name}={v!r} scales the logits; lce_client.hf does not "
                             "serve such a head (only final_logit_softcapping is supported), refusing rather than "
                             "giving wrong answers")
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__}: the output embeddings are {type(head).__name__}, not nn.Linear")
    if head.bias is not None:
        raise ValueError(f"{type(model).__name__}: lm_head has a bias; lce_client.hf serves heads without one")


def _is_tied(model) -> bool:
    inp = model.get_input_embeddings()
    return inp is not None and model.get_output_embeddings().weight is inp.weight


class RemoteHead:
    """The handle apply_remote_head returns: the served head's name, and the calls that keep the local
    model and the server's head in step (see the module docstring)."""

    def __init__(self, model, client: Client, head: str, train_head: Optional[str], temperature: float):
        self.model, self.client, self.head = model, client, head
        self.train_head = train_head
        self.temperature = temperature
        self.softcap = getattr(model.config, "final_logit_softcapping", None) or None
        self.tied = _is_tied(model)
        self._orig_forward = model.__dict__.get("forward")  # an instance-level forward to restore, if any

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.model.get_output_embeddings().weight

    @property
    def dtype(self) -> str:
        return _HEAD_DTYPES[self.weight.dtype]

    def push_weights(self):
        """UpdateWeights: the server's head := the local lm_head.weight. Returns the HeadInfo."""
        return self.client.update_weights(self.weight.detach().cpu().contiguous(), head=self.head)

    def collect_grad(self) -> None:
        """train_head="local": adds the server's accumulated dW into lm_head.weight.grad and zeroes it there."""
        dw = torch.from_numpy(self.client.get_grad(head=self.head)).to(self.weight.device, self.weight.dtype)
        self.client.zero_grad(head=self.head)
        if self.weight.grad is None:
            self.weight.grad = dw
        else:
            self.weight.grad.add_(dw)

    def optimizer_step(self, *, lr: float, **adamw):
        """train_head="server": one AdamW step on the server (Client.optimizer_step; zeroes dW)."""
        return self.client.optimizer_step(self.head, lr=lr, **adamw)

    def pull_weights(self, directory: Optional[str] = None) -> None:
        """The server's weight into the local lm_head.weight (SaveHead into `directory`, read back here:
        the server's file system must be this one's there). Default: a temporary directory."""
        from .local import read_saved_head

        with tempfile.TemporaryDirectory(prefix="lce_pull_") if directory is None else _nullctx(directory) as d:
            _, index = self.client.save_head(str(Path(d).resolve()), head=self.head)
            w = read_saved_head(index)
        with torch.no_grad():
            self.weight.copy_(torch.from_numpy(w).to(self.weight.device, self.weight.dtype))

    def trainer_callback(self):
        """A ``transformers.TrainerCallback`` that drives ``train_head`` inside a ``Trainer``::

            rh = apply_remote_head(model, client, head="lm", train_head="server")   # or "local"
            trainer = Trainer(model, args, ..., callbacks=[rh.trainer_callback()])

        The Trainer's own steps then train the head as they train the local model: each micro-batch's
        backward commits its dW (scaled as HF scales the loss: ``/ num_items_in_batch`` or
        ``/ gradient_accumulation_steps``), evaluation batches (run under no_grad) add nothing, and at
        each optimizer step
          * ``"local"``: before ``optimizer.step()``, ``collect_grad()`` puts the server's dW into
            ``lm_head.weight.grad`` (the Trainer's optimizer steps it with the rest), after it
            ``push_weights()`` sends the new weight back;
          * ``"server"``: after ``optimizer.step()``, ``optimizer_step`` on the server with the learning rate
            and weight decay of the optimizer's parameter group that holds ``lm_head.weight`` (the
            scheduler's current lr) and the Trainer's ``adam_beta1/2`` and ``adam_epsilon``: AdamW on the
            server as the Trainer's AdamW (``optim="adamw_torch"``) would step the head.
        ``max_grad_norm > 0`` is refused at ``on_train_begin``: the Trainer clips the global norm before
        any callback runs, so the norm would leave the head's gradient out (set ``max_grad_norm=0``). The
        Trainer's logged ``grad_norm`` leaves it out too."""
        from transformers import TrainerCallback

        rh = self
        if rh.train_head is None:
            raise ValueError("trainer_callback drives train_head='server' or 'local'; this head is frozen "
                             "(train_head=None) and needs no callback")

        class RemoteHeadCallback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                if args.max_grad_norm and args.max_grad_norm > 0:
                    raise ValueError(f"max_grad_norm={args.max_grad_norm}: the Trainer clips before a callback "
                                     "can bring in the remote head's gradient, so the clipping norm would leave "
                                     "the head out; pass max_grad_norm=0 with lce_client.hf's train_head")

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                if rh.train_head == "local":
                    rh.collect_grad()

            def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
                if rh.train_head == "local":
                    rh.push_weights()
                    return
                group = _group_of(optimizer, rh.weight)
                rh.optimizer_step(lr=float(group["lr"]), beta1=args.adam_beta1, beta2=args.adam_beta2,
                                  eps=args.adam_epsilon, weight_decay=float(group.get("weight_decay", 0.0)))

        return RemoteHeadCallback()

    def remove(self) -> None:
        """Restores the model's own forward."""
        if self._orig_forward is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self._orig_forward


def _group_of(optimizer, param) -> dict:
    """The optimizer's parameter group that holds `param` (the Trainer puts lm_head.weight in its decay
    group even when it never gets a local gradient); the first group if none does."""
    if optimizer is None:
        raise ValueError("the Trainer passed no optimizer to the callback")
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    return optimizer.param_groups[0]


class _nullctx:
    def __init__(self, v):
        self.v = v

    def __enter__(self):
        return self.v

    def __exit__(self, *exc):
        return False


def apply_remote_head(model, client: Client, head: str = "hf-lm-head", *, upload: bool = True,
                      train_head: Optional[str] = None, untie: bool = False, temperature: float = 1.0,
                      return_logprobs: bool = False, return_entropy: bool = False) -> RemoteHead:
    """Serves `model`'s LM head from lce-serve and patches `model.forward` (see the module docstring).

    head: the head's name on the server. upload: put lm_head.weight there now (LoadHead + UpdateWeights;
    needs the admin token where the server has auth), else use the head already there. train_head: None,
    "server" or "local". untie: allow train_head="server" on a tied model (the copies then train apart).
    temperature: divides the logits (as the server's temperature) in every remote call. return_logprobs /
    return_entropy: the default of the forward's arguments of the same names."""
    if train_head not in (None, "server", "local"):
        raise ValueError(f"train_head must be None, 'server' or 'local', got {train_head!r}")
    _check_supported(model)
    rh = RemoteHead(model, client, head, train_head, temperature)
    if rh.weight.dtype not in _HEAD_DTYPES:
        raise ValueError(f"lm_head.weight is {rh.weight.dtype}: lce-serve serves fp32, bf16 and fp16 heads")
    if train_head == "server" and rh.tied and not untie:
        raise ValueError("train_head='server' on a model with tied embeddings trains the server's copy of the "
                         "weight apart from the embedding (the tie is broken); use train_head='local' to keep the "
                         "tie, or pass untie=True")
    V, H = rh.weight.shape
    if upload:
        client.load_head(head, seeded=(V, H, 0, rh.dtype))
        rh.push_weights()
    info = client.head_info(head, refresh=True)
    if (info.vocab_size, info.hidden_size) != (V, H):
        raise ValueError(f"the server's head {head!r} is {info.vocab_size}x{info.hidden_size}, the model's lm_head "
                         f"{V}x{H}")
    if train_head is not None:
        client.zero_grad(head=head)
    orig = model.forward
    model.forward = types.MethodType(functools.partial(_remote_forward, rh=rh, orig=orig,
                                                       default_lp=return_logprobs, default_ent=return_entropy), model)
    return rh


def _remote_forward(model, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, *, rh: RemoteHead, orig,
                    default_lp: bool, default_ent: bool, return_logprobs: Optional[bool] = None,
                    return_entropy: Optional[bool] = None, shift_labels: Optional[torch.Tensor] = None,
                    num_items_in_batch=None, ignore_index: int = -100, return_dict: Optional[bool] = None, **kwargs):
    want_lp = default_lp if return_logprobs is None else return_logprobs
    want_ent = default_ent if return_entropy is None else return_entropy
    if labels is None and shift_labels is None and not (want_lp or want_ent):
        # Inference / generation: logits, from the local head (the server returns no vocabulary-wide logits).
        return orig(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                    logits_to_keep=logits_to_keep, return_dict=return_dict, **kwargs)
    outputs = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                               **kwargs)
    hidden = outputs.last_hidden_state
    if logits_to_keep:  # HF's slice_logits_to_keep
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden = hidden[:, keep, :]
    shift_labels_given = shift_labels is not None
    if shift_labels is None:
        if labels is not None:
            shift_labels = _shift_left(labels, ignore_index)
        else:
            if input_ids is None:
                raise ValueError("return_logprobs / return_entropy without labels score input_ids: pass input_ids "
                                 "or labels")
            shift_labels = _shift_left(input_ids, ignore_index)
    targets = shift_labels.to(hidden.device)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"labels of shape {tuple(targets.shape)} for hidden states {tuple(hidden.shape[:-1])}")
    common = dict(temperature=rh.temperature, softcap=rh.softcap, ignore_index=ignore_index, head=rh.head)
    loss = logprobs = entropy = None
    if labels is not None or shift_labels_given:
        # HF's ForCausalLMLoss: the mean over valid tokens, or their sum / num_items_in_batch. One
        # ForwardBackward; with train_head it also accumulates dW of this loss on the server.
        divisor = None
        if num_items_in_batch is not None:
            divisor = float(num_items_in_batch.item() if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
        loss = remote_linear_cross_entropy(hidden, targets, rh.client, reduction="mean" if divisor is None else "sum",
                                           divisor=divisor, accumulate_weight_grad=rh.train_head is not None, **common)
    if want_lp or want_ent:
        # A Score now; a Backward in the backward only if a loss uses them.
        logprobs, entropy = remote_logprobs(hidden, targets, rh.client,
                                            accumulate_weight_grad=rh.train_head is not None, **common)
    out = RemoteCausalLMOutput(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                               hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                               logprobs=logprobs if want_lp else None, entropy=entropy if want_ent else None)
    if return_dict is False:
        return out.to_tuple()
    return out
