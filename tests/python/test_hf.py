"""lce_client.hf against the real lce_server (CPU engine): tiny randomly initialised Llama, Qwen2 (tied
embeddings) and Gemma2 (tied, final-logit softcap) models from configs (no download). The patched model's
loss, per-token logprobs and entropy, and the gradients of every parameter equal the unpatched model's
within fp32 tolerance; a few AdamW steps of the patched model track the unpatched one (head trained
locally through the server's dW, or by the server's AdamW); generation still works; unsupported heads
are refused by name."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import lce_client  # noqa: E402
from lce_client.hf import apply_remote_head  # noqa: E402

V, H, B, T = 97, 32, 2, 12
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def make_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "llama":
        cfg = transformers.LlamaConfig(**COMMON, tie_word_embeddings=False)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    else:
        cfg = transformers.Gemma2Config(**COMMON, head_dim=8, final_logit_softcapping=2.0, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    if family == "gemma2":  # logits of a few units, so that the softcap at 2 bends them
        with torch.no_grad():
            model.lm_head.weight.mul_(40)
    return model.float()


FAMILIES = ["llama", "qwen2", "gemma2"]


@pytest.fixture
def client(server_factory):
    srv = server_factory(["--seed-head=8x8", "--head-dtype=fp32"], name="hf")
    with lce_client.Client(srv.target, timeout=60) as c:
        yield c


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -3:] = 0  # right padding of the second row
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 2] = -100
    return ids, mask, labels


def close(a, b, rtol=2e-5, atol=2e-6, what=""):
    a, b = a.detach().double(), b.detach().double()
    err = (a - b).abs().max().item()
    tol = atol + rtol * b.abs().max().item()
    assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol:.3g}"


def train_both(ref, opt_ref, model, opt, seed, after_backward, after_step):
    """Four steps of the unpatched model and the patched one on the same batches; their losses track."""
    for step in range(4):
        ids, mask, labels = batch(seed=seed + step)
        losses = []
        for m, o, hooks in ((ref, opt_ref, ()), (model, opt, (after_backward, after_step))):
            loss = m(ids, attention_mask=mask, labels=labels).loss
            o.zero_grad()
            loss.backward()
            if hooks:
                hooks[0]()
            o.step()
            if hooks:
                hooks[1]()
            losses.append(loss)
        close(losses[1], losses[0], rtol=1e-4, what=f"step {step} loss")


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_logprobs_entropy_and_gradients_equal_the_unpatched_model(client, family):
    torch.set_num_threads(1)
    ref = make_model(family)
    model = copy.deepcopy(ref)
    rh = apply_remote_head(model, client, head=f"hf-{family}", train_head="local")
    assert rh.tied == (family != "llama") and rh.softcap == (2.0 if family == "gemma2" else None)
    ids, mask, labels = batch()

    # The loss, and every parameter's gradient (the tied / untied head's through the server's dW).
    out_ref = ref(ids, attention_mask=mask, labels=labels)
    out_ref.loss.backward()
    out = model(ids, attention_mask=mask, labels=labels)
    assert out.logits is None
    close(out.loss, out_ref.loss, what="loss")
    out.loss.backward()
    rh.collect_grad()
    g_ref, g = grads(ref), grads(model)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        close(g[name], g_ref[name], rtol=1e-4, atol=1e-7, what=f"grad {name}")

    # Per-token logprobs and entropy of the next tokens, and the gradients of an RL-style loss of them.
    ref.zero_grad()
    model.zero_grad()
    logits = ref(ids, attention_mask=mask).logits
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    logp = torch.log_softmax(logits.float(), -1)
    valid = shifted != -100
    lp_ref = logp.gather(-1, shifted.clamp(min=0)[..., None])[..., 0] * valid
    ent_ref = -(logp.exp() * logp).sum(-1)
    out = model(ids, attention_mask=mask, labels=labels, return_logprobs=True, return_entropy=True)
    assert out.logprobs.shape == (B, T) and out.entropy.shape == (B, T)
    close(out.logprobs, lp_ref, what="logprobs")
    close(out.entropy, ent_ref, what="entropy")
    adv = torch.linspace(-1, 1, B * T).reshape(B, T)
    (-(lp_ref * adv).sum() / valid.sum() - 0.01 * ent_ref.mean()).backward()
    (-(out.logprobs * adv).sum() / valid.sum() - 0.01 * out.entropy.mean()).backward()
    g_ref, g = grads(ref), grads(model)
    for name in g_ref:
        if name == "lm_head.weight" or (rh.tied and name == "model.embed_tokens.weight"):
            continue  # the head's share of this loss stays on the server (Backward accumulates no dW)
        close(g[name], g_ref[name], rtol=1e-4, atol=1e-7, what=f"logprob-loss grad {name}")
    client.zero_grad(head=rh.head)  # (the loss of this forward accumulated dW there)


def test_num_items_in_batch_and_logits_to_keep(client):
    torch.set_num_threads(1)
    ref = make_model("llama", seed=3)
    model = copy.deepcopy(ref)
    apply_remote_head(model, client, head="hf-items")
    ids, mask, labels = batch(seed=4)
    n = torch.tensor(40)  # the valid tokens of a larger accumulated batch
    a = ref(ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    b = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    close(b.loss, a.loss, what="loss / num_items_in_batch")
    a.loss.backward()
    b.loss.backward()
    close(model.model.norm.weight.grad, ref.model.norm.weight.grad, rtol=1e-4, what="grad with num_items_in_batch")
    # logits_to_keep slices the hidden states as HF does (labels for the kept positions)
    k = 5
    a = ref(ids, attention_mask=mask, labels=labels[:, -k:], logits_to_keep=k)
    b = model(ids, attention_mask=mask, labels=labels[:, -k:], logits_to_keep=k)
    close(b.loss, a.loss, what="loss with logits_to_keep")


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_adamw_steps_track_the_unpatched_model_with_tied_embeddings(client, family):
    """train_head='local': dW from the server added into the tied Parameter's grad, one local AdamW over
    every parameter, the new weight pushed back: the same training as the unpatched model."""
    torch.set_num_threads(1)
    ref = make_model(family, seed=5)
    model = copy.deepcopy(ref)
    rh = apply_remote_head(model, client, head=f"hf-train-{family}", train_head="local")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_both(ref, opt_ref, model, opt, 10, rh.collect_grad, rh.push_weights)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    close(model.lm_head.weight, ref.lm_head.weight, rtol=1e-3, atol=1e-5, what="trained head")


def test_server_adamw_trains_the_head_like_local_adamw_and_pull_weights(client):
    """train_head='server' (untied Llama): the head's AdamW on the server, the body's here; the losses
    track the unpatched model trained by one local AdamW; pull_weights brings the head back."""
    torch.set_num_threads(1)
    ref = make_model("llama", seed=6)
    model = copy.deepcopy(ref)
    rh = apply_remote_head(model, client, head="hf-server-adamw", train_head="server")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.0)
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "lm_head.weight"], lr=3e-3,
                            weight_decay=0.0)
    train_both(ref, opt_ref, model, opt, 20, lambda: None, lambda: rh.optimizer_step(lr=3e-3, weight_decay=0.0))
    before = model.lm_head.weight.detach().clone()
    rh.pull_weights()
    assert not torch.equal(before, model.lm_head.weight)
    close(model.lm_head.weight, ref.lm_head.weight, rtol=1e-3, atol=1e-5, what="pulled head")
    # generation runs the original forward (local logits from the pulled head)
    ids = torch.randint(0, V, (1, 4))
    want = ref.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    rh.remove()
    assert model(ids, labels=ids).logits is not None  # the model's own forward again


def test_refusals(client):
    tied = make_model("qwen2")
    with pytest.raises(ValueError, match="tie is broken"):
        apply_remote_head(tied, client, head="hf-refused", train_head="server")
    scaled = make_model("llama")
    scaled.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="logit_scale"):
        apply_remote_head(scaled, client, head="hf-refused")
