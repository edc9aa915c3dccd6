"""lce_client.rl against the real lce_server (CPU engine) and float64 torch references from materialised
logits: verl's linear_cross_entropy contract (values, reductions, temperature, gradients, the weight's
check), TRL-style per_token_logps of a tiny Hugging Face model, and the fused policy loss as autograd."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lce_client  # noqa: E402
import lce_client.rl as rl  # noqa: E402
from conftest import HIDDEN, VOCAB, assert_close, reference, targets_for_rows  # noqa: E402


@pytest.fixture
def fp32(heads):
    return heads["fp32"]


def _inputs(head, rows=30, seed=3):
    _, h64 = head.hidden(rows, seed=seed)
    hidden = torch.tensor(h64, dtype=torch.float32).reshape(5, rows // 5, HIDDEN).requires_grad_()
    labels = torch.as_tensor(targets_for_rows(rows, seed=seed + 1)).reshape(5, rows // 5)
    return hidden, labels


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_verl_linear_cross_entropy_matches_reference(fp32, reduction):
    hidden, labels = _inputs(fp32)
    W = torch.tensor(fp32.w64, dtype=torch.float32)
    with fp32.client() as c:
        lp, ent = rl.linear_cross_entropy(hidden, W, labels, 0.8, reduction, client=c)
        ref = reference(fp32.w64, hidden.detach().double().reshape(-1, HIDDEN).numpy(), labels.reshape(-1),
                        temperature=0.8)
        valid = ref["valid"]
        assert ent.shape == (labels.numel(),)  # verl's kernel: per flattened token, whatever the reduction
        want_ent = ref["entropy"]
        if reduction == "none":
            assert lp.shape == (labels.numel(),)
            want_lp = ref["logprobs"]
            upstream = torch.linspace(-1, 1, labels.numel())
            (lp * upstream).sum().backward()
            (ref["logprobs"] * upstream.double()).sum().backward()
        else:
            assert lp.shape == ()
            n = valid.sum() if reduction == "mean" else 1
            want_lp = ref["logprobs"].sum() / n
            g_ent = torch.linspace(-0.5, 0.5, labels.numel())
            (lp - (0.1 * ent * g_ent).sum()).backward()
            (want_lp - (0.1 * ref["entropy"] * g_ent.double()).sum()).backward()
        assert_close(lp.detach(), want_lp.detach(), rtol=2e-6, atol=2e-5, what="logprobs")
        assert_close(ent.detach(), want_ent.detach(), rtol=2e-6, atol=2e-5, what="entropy")
        assert_close(hidden.grad.reshape(-1, HIDDEN), ref["h"].grad, rtol=1e-5, atol=1e-6, what="d_hidden")


def test_verl_weight_is_checked_by_shape_and_set_head_is_the_default(fp32):
    hidden, labels = _inputs(fp32)
    with fp32.client() as c:
        with pytest.raises(ValueError, match=f"not the served head 'default' {VOCAB}x{HIDDEN}"):
            rl.linear_cross_entropy(hidden, torch.zeros(VOCAB + 1, HIDDEN), labels, client=c)
        rl.set_head(c)
        try:
            a, _ = rl.linear_cross_entropy(hidden, None, labels)  # weight None: no check
            b, _ = rl.linear_cross_entropy(hidden, torch.zeros(VOCAB, HIDDEN), labels, impl_backend="triton")
        finally:
            rl.set_head(None)
    assert torch.equal(a, b)  # the weight's values are not used: the served head is


def test_trl_per_token_logps_of_a_hf_model(server_factory):
    transformers = pytest.importorskip("transformers")
    from lce_client.hf import apply_remote_head

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    srv = server_factory(["--seed-head=8x8", "--head-dtype=fp32"], name="trl")
    ids = torch.randint(0, 61, (3, 10))
    mask = torch.ones_like(ids)
    k, temp = 4, 0.7
    # TRL: logits[:, -k-1:-1] / temperature, selective_log_softmax, entropy_from_logits
    logits = model(ids, attention_mask=mask).logits[:, -k - 1:-1] / temp
    logp = logits.log_softmax(-1)
    want = logp.gather(-1, ids[:, -k:, None])[..., 0]
    want_ent = -(logp.exp() * logp).sum(-1)
    with lce_client.Client(srv.target, timeout=60) as c:
        rh = apply_remote_head(model, c, head="trl")
        got, ent = rl.per_token_logps(model, ids, mask, k, remote_head=rh, temperature=temp, compute_entropy=True,
                                      batch_size=2)
        assert got.shape == (3, k)
        assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-5, what="per-token logps")
        assert_close(ent.detach(), want_ent.detach(), rtol=1e-5, atol=1e-5, what="entropies")
        got.sum().backward()
        g = model.model.norm.weight.grad.clone()
        model.zero_grad()
        want.sum().backward()
        assert_close(g, model.model.norm.weight.grad, rtol=1e-4, atol=1e-6, what="grad through the body")


def test_remote_policy_loss_is_the_fused_loss_with_its_gradient(fp32):
    hidden, labels = _inputs(fp32, rows=40, seed=9)
    rng = np.random.default_rng(1)
    old = torch.tensor(rng.standard_normal(labels.shape) * 0.2 - 6, dtype=torch.float32)
    adv = torch.tensor(rng.standard_normal(labels.shape), dtype=torch.float32)
    with fp32.client() as c:
        loss, stats = rl.remote_policy_loss(hidden, labels, old, adv, c, clip_low=0.2, clip_high=0.28)
    (2 * loss).backward()
    # reference: token-mean clipped surrogate over the valid tokens (docs/MATH.md, "Policy loss")
    ref = reference(fp32.w64, hidden.detach().double().reshape(-1, HIDDEN).numpy(), labels.reshape(-1))
    valid = ref["valid"]
    r = torch.exp(ref["logprobs"] - old.reshape(-1).double())
    a = adv.reshape(-1).double()
    pg = torch.maximum(-a * r, -a * r.clamp(1 - 0.2, 1 + 0.28))
    want = (pg * valid).sum() / valid.sum()
    (2 * want).backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    assert_close(hidden.grad.reshape(-1, HIDDEN), ref["h"].grad, rtol=1e-5, atol=1e-6, what="d_hidden")
    assert stats.valid_tokens == int(valid.sum()) and 0 <= stats.clip_fraction <= 1
    assert stats.logprobs.shape == labels.shape
