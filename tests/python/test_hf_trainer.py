"""A Hugging Face Trainer with the head on the server trains exactly as the same model with its local head.

A tiny randomly initialised Llama (no download), transformers.Trainer with gradient_accumulation_steps=4
(HF's num_items_in_batch: each micro-batch's loss is its sum over the accumulated batch's valid tokens),
eval_strategy="steps" every 2 steps (the evaluation loop runs the model under no_grad with labels) and
a linearly decaying learning rate; lce_client.hf.apply_remote_head(train_head="server" / "local") with
rh.trainer_callback(). Against the unpatched model trained by the same Trainer set-up: every logged
training and evaluation loss, the head's weights and the body's after the last step, within fp32
tolerance. Evaluation adding to the head's gradient, or a micro-batch's dW not scaled as autograd's,
moves the head (and the next losses) far past it."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install 'accelerate>=1.1', in "
                    "client/python/requirements-dev.txt)")

from conftest import own_server_client  # noqa: E402
from lce_client.hf import apply_remote_head  # noqa: E402

V, H, T = 97, 32, 12
STEPS, ACCUM, BATCH = 4, 4, 2


def make_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()


class Rows(torch.utils.data.Dataset):
    """Fixed-length rows with a varying number of ignored labels, so that micro-batches of one step hold
    different valid-token counts (a mean per micro-batch / k would then differ from HF's loss)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, V, (n, T), generator=g)
        self.labels = self.ids.clone()
        for i in range(n):
            self.labels[i, :int(torch.randint(0, T - 2, (1,), generator=g))] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(T, dtype=torch.long), "labels": self.labels[i]}


class HeadGrads(transformers.TrainerCallback):
    """Records the head's gradient at each optimizer step, as the optimizer is about to see it."""

    def __init__(self, read):
        self.read, self.grads = read, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(self.read())


def train(model, outdir, loss_kwargs, read_grad, callbacks=()):
    """loss_kwargs: the Trainer passes num_items_in_batch to the model (the loss is each micro-batch's sum
    over the accumulated batch's valid tokens, upstream gradient 1) or not (the micro-batch's mean,
    divided by the accumulation steps: upstream gradient 1/4)."""
    model.accepts_loss_kwargs = loss_kwargs
    args = transformers.TrainingArguments(
        output_dir=str(outdir), per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM, max_steps=STEPS, eval_strategy="steps", eval_steps=2, logging_steps=1,
        learning_rate=3e-3, lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=0.0,
        optim="adamw_torch", save_strategy="no", report_to=[], use_cpu=True, seed=7, data_seed=7,
        dataloader_num_workers=0, disable_tqdm=True)
    recorder = HeadGrads(read_grad)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(STEPS * ACCUM * BATCH, seed=1),
                                   eval_dataset=Rows(4, seed=2), callbacks=[*callbacks, recorder])
    trainer.train()
    losses = [(e["step"], k, e[k]) for e in trainer.state.log_history for k in ("loss", "eval_loss") if k in e]
    return trainer, losses, recorder.grads


_references = {}


def reference(loss_kwargs, outdir):
    """The unpatched model trained by the same Trainer set-up: its start, final weights, losses and head
    gradients (once per loss_kwargs)."""
    if loss_kwargs not in _references:
        model = make_model()
        start = copy.deepcopy(model)
        _, losses, grads = train(model, outdir, loss_kwargs, lambda: model.lm_head.weight.grad.detach().clone())
        _references[loss_kwargs] = (start, model, losses, grads)
    return _references[loss_kwargs]


@pytest.fixture(scope="module")
def client(workdir):
    yield from own_server_client(workdir, "hf_trainer")


def close(got, want, rtol, atol, what):
    got, want = torch.as_tensor(got).detach().double(), torch.as_tensor(want).detach().double()
    err = (got - want).abs().max().item()
    tol = atol + rtol * want.abs().max().item()
    assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("loss_kwargs", [True, False], ids=["num_items_in_batch", "loss_over_accumulation"])
@pytest.mark.parametrize("train_head", ["server", "local"])
def test_trainer_with_accumulation_and_evaluation_trains_the_head_as_autograd(client, tmp_path, train_head,
                                                                              loss_kwargs):
    torch.set_num_threads(1)
    start, ref, ref_losses, ref_grads = reference(loss_kwargs, tmp_path / "ref")
    model = copy.deepcopy(start)
    rh = apply_remote_head(model, client, head=f"trainer-{train_head}", train_head=train_head)
    read = ((lambda: torch.from_numpy(client.get_grad(head=rh.head))) if train_head == "server"
            else (lambda: model.lm_head.weight.grad.detach().clone()))
    trainer, losses, grads = train(model, tmp_path, loss_kwargs, read, [rh.trainer_callback()])
    # The head's gradient at every optimizer step: the sum over 4 micro-batches, scaled as HF scales
    # each, and nothing from the evaluation between steps 2 and 3 (Adam would hide a uniform scale
    # error in the weights; the gradient does not).
    assert len(grads) == len(ref_grads) == STEPS
    for step, (got, want) in enumerate(zip(grads, ref_grads), 1):
        close(got, want, rtol=1e-4, atol=1e-7, what=f"head gradient at step {step}")
    assert [(s, k) for s, k, _ in losses] == [(s, k) for s, k, _ in ref_losses]
    assert sum(k == "eval_loss" for _, k, _ in losses) == STEPS // 2
    for (step, kind, got), (_, _, want) in zip(losses, ref_losses):
        close(got, want, rtol=1e-4, atol=1e-6, what=f"{kind} at step {step}")
    if train_head == "server":
        rh.pull_weights()
    # Adam divides by the root of the second moment: fp32 differences in tiny gradients move a weight
    # by up to ~lr * steps relative; 1e-3 of the largest weight is far below one such move per element.
    close(model.lm_head.weight, ref.lm_head.weight, rtol=1e-3, atol=1e-5, what="head after training")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        close(p, ref_params[name], rtol=1e-3, atol=1e-5, what=name)
    # An evaluation after training adds nothing to the head's gradient (the Trainer runs it under no_grad).
    client.zero_grad(head=rh.head)
    trainer.evaluate()
    assert not np.any(client.get_grad(head=rh.head)), "evaluation trained the head"


def test_callback_refuses_clipping(client, tmp_path):
    """The Trainer clips before any callback sees the head's gradient: refused, not silently wrong."""
    model = make_model()
    rh = apply_remote_head(model, client, head="trainer-clip", train_head="local")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, max_grad_norm=1.0, report_to=[],
                                          use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(2, seed=3),
                                   callbacks=[rh.trainer_callback()])
    with pytest.raises(ValueError, match="max_grad_norm=1.0"):
        trainer.train()
