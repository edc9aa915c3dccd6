"""Server-side training of the head against PyTorch: the accumulated dW equals autograd's on the
materialised logits, and several OptimizerStep calls equal torch.optim.AdamW (with
clip_grad_norm_) applied to the same weight, step by step (the weight is read back with SaveHead)."""

import numpy as np
import pytest

import lce_client
import lce_client.local
from conftest import HIDDEN, requires_torch, write_safetensors

VOCAB = 211


@requires_torch
def test_adamw_steps_match_torch(server_factory, workdir):
    import torch

    rng = np.random.default_rng(7)
    w0 = (rng.standard_normal((VOCAB, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    path = workdir / "train_head.safetensors"
    write_safetensors(path, {"lm_head.weight": (w0, "F32")})
    srv = server_factory([f"--head-file={path}"], name="adamw")
    c = lce_client.Client(srv.target, timeout=60)

    W = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float32))
    opt = torch.optim.AdamW([W], lr=3e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    for step in range(1, 4):
        h = rng.standard_normal((64, HIDDEN)).astype(np.float32)
        y = rng.integers(0, VOCAB, 64)
        y[::9] = -100
        c.zero_grad()
        r = c.forward_backward(h, y, reduction="mean", accumulate_weight_grad=True)
        # Reference gradient: autograd through the materialised logits, in float64.
        W64 = torch.tensor(W.detach().numpy(), dtype=torch.float64, requires_grad=True)
        loss = torch.nn.functional.cross_entropy(torch.tensor(h, dtype=torch.float64) @ W64.T,
                                                 torch.tensor(y), ignore_index=-100, reduction="mean")
        loss.backward()
        assert r.loss == pytest.approx(loss.item(), rel=1e-5)
        g = c.get_grad()
        np.testing.assert_allclose(g, W64.grad.numpy(), rtol=1e-4, atol=1e-6)
        # The same step in torch, from the same gradient.
        opt.zero_grad()
        W.grad = torch.tensor(g)
        norm = torch.nn.utils.clip_grad_norm_([W], max_norm=0.05).item()
        opt.step()
        grad_norm, head, n = c.optimizer_step(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-7, weight_decay=0.05,
                                              max_grad_norm=0.05)
        assert n == step and head.version == 1 + step
        assert grad_norm == pytest.approx(norm, rel=1e-5)
        assert grad_norm > 0.05, "clipping must be exercised"
        _, index = c.save_head(str(workdir / f"adamw_step{step}"))
        np.testing.assert_allclose(lce_client.local.read_saved_head(index), W.detach().numpy(), rtol=1e-5, atol=1e-6)
