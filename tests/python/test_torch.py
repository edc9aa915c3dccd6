"""PyTorch autograd through the remote head: RemoteLinearCrossEntropy and remote_logprobs against the same
computation done locally in float64 torch (F.cross_entropy / materialised logits)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import GRAD_RTOL, HIDDEN, VOCAB, HAVE_TORCH, assert_close, reference

pytestmark = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (pip install torch)")

if HAVE_TORCH:
    import torch
    import torch.nn.functional as F

    from lce_client.torch import RemoteLinearCrossEntropy, remote_logprobs

TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _tensor(head, st):
    t = torch.from_numpy(st.view(np.int16)).view(torch.bfloat16) if head.dtype == "bf16" else torch.from_numpy(st)
    return t.clone()


def _targets(shape, seed, ignore_frac=0.15):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, VOCAB, shape, generator=g)
    y[torch.rand(shape, generator=g) < ignore_frac] = -100
    return y


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_remote_cross_entropy_matches_local(head, reduction):
    B, T = 3, 8
    st, h64 = head.hidden(B * T, seed=30, shape=(B, T))
    hidden = _tensor(head, st).requires_grad_(True)
    y = _targets((B, T), seed=31)
    upstream = torch.randn(B, T, generator=torch.Generator().manual_seed(32))
    with head.client(chunk_bytes=512) as c:
        mod = RemoteLinearCrossEntropy(c, reduction=reduction, label_smoothing=0.05)
        loss = mod(hidden, y)
        (loss * upstream).sum().backward() if reduction == "none" else (3.0 * loss).backward()
    assert loss.dtype == torch.float32
    assert loss.shape == ((B, T) if reduction == "none" else ())
    assert hidden.grad.dtype == hidden.dtype and hidden.grad.shape == hidden.shape

    # local reference: F.cross_entropy on materialised float64 logits
    h_ref = torch.tensor(h64, requires_grad=True)
    W = torch.tensor(head.w64)
    ref = F.cross_entropy(h_ref @ W.T, y.reshape(-1), reduction=reduction, label_smoothing=0.05)
    if reduction == "none":
        ref = ref.reshape(B, T)
        (ref * upstream.double()).sum().backward()
    else:
        (3.0 * ref).backward()
    assert_close(loss.detach(), ref.detach(), rtol=2e-6, atol=3e-5, what="loss")
    assert_close(hidden.grad.double().reshape(-1, HIDDEN), h_ref.grad, rtol=GRAD_RTOL[head.dtype], atol=1e-7,
                 what="hidden.grad")


def test_backward_mode_rpc_equals_scale(heads):
    head = heads["fp32"]
    st, _ = head.hidden(20, seed=33)
    y = _targets((20,), seed=34)
    g = torch.randn(20, generator=torch.Generator().manual_seed(35))
    grads = []
    with head.client() as c:
        for mode in ("scale", "rpc"):
            h = torch.from_numpy(st.copy()).requires_grad_(True)
            (RemoteLinearCrossEntropy(c, reduction="none", backward_mode=mode)(h, y) * g).sum().backward()
            grads.append(h.grad)
    assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-8, what="rpc vs scale")


def test_cast_fp32_trunk_to_bf16_head(heads):
    """A trunk in fp32 against a bf16 head: the wrapper casts for the wire, the grad comes back fp32."""
    head = heads["bf16"]
    st, h64 = head.hidden(16, seed=36)
    hidden = torch.from_numpy(h64.astype(np.float32)).requires_grad_(True)  # exactly representable in bf16
    y = _targets((16,), seed=37)
    with head.client() as c:
        loss = RemoteLinearCrossEntropy(c)(hidden, y)
        loss.backward()
        with pytest.raises(TypeError):
            RemoteLinearCrossEntropy(c, cast=False)(hidden, y)
    assert hidden.grad.dtype == torch.float32
    h_ref = torch.tensor(h64, requires_grad=True)
    ref = F.cross_entropy(h_ref @ torch.tensor(head.w64).T, y)
    ref.backward()
    assert_close(loss.detach(), ref.detach(), rtol=2e-6, atol=3e-5, what="loss")
    assert_close(hidden.grad, h_ref.grad, rtol=GRAD_RTOL["bf16"], atol=1e-7, what="grad")


@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.8, 6.0)])
def test_remote_logprobs_ppo_style_loss(head, temperature, softcap):
    """A PPO/GRPO-like loss written in torch on top of remote logprobs and entropy trains through the
    Backward RPC: the gradient matches autograd through materialised logits."""
    B, T = 2, 9
    st, h64 = head.hidden(B * T, seed=40, shape=(B, T))
    hidden = _tensor(head, st).requires_grad_(True)
    y = _targets((B, T), seed=41)
    gen = torch.Generator().manual_seed(42)
    adv = torch.randn(B, T, generator=gen)
    old = -torch.rand(B, T, generator=gen) * 6

    def ppo(lp, ent, mask):
        ratio = torch.exp(lp - old.to(lp.dtype))
        clipped = torch.clamp(ratio, 0.8, 1.2)
        a = adv.to(lp.dtype)
        pg = torch.maximum(-a * ratio, -a * clipped)
        return ((pg - 0.01 * ent) * mask).sum() / mask.sum()

    mask = (y != -100).float()
    with head.client(chunk_bytes=300) as c:
        lp, ent = remote_logprobs(hidden, y, c, temperature=temperature, softcap=softcap)
        assert lp.shape == (B, T) and lp.dtype == torch.float32
        ppo(lp, ent, mask).backward()

    ref = reference(head.w64, h64, y.numpy(), temperature=temperature, softcap=softcap or 0.0)
    assert_close(lp.detach().reshape(-1), ref["logprobs"].detach(), rtol=2e-6, atol=2e-5, what="logprobs")
    ppo(ref["logprobs"].reshape(B, T), ref["entropy"].reshape(B, T), mask.double()).backward()
    assert hidden.grad.dtype == hidden.dtype
    assert_close(hidden.grad.double().reshape(-1, HIDDEN), ref["h"].grad, rtol=GRAD_RTOL[head.dtype], atol=1e-7,
                 what="hidden.grad")


def test_remote_logprobs_only_logprobs_used(heads):
    head = heads["fp32"]
    st, h64 = head.hidden(10, seed=43)
    hidden = torch.from_numpy(st.copy()).requires_grad_(True)
    y = _targets((10,), seed=44)
    with head.client() as c:
        lp, _ = remote_logprobs(hidden, y, c)
        (-lp.sum()).backward()
    ref = reference(head.w64, h64, y.numpy())
    (-ref["logprobs"].sum()).backward()
    assert_close(hidden.grad, ref["h"].grad, rtol=GRAD_RTOL["fp32"], atol=1e-7, what="grad")


def test_default_client_from_env(heads, monkeypatch):
    import lce_client.torch as lt

    head = heads["fp32"]
    monkeypatch.setattr(lt, "_default_client", None)
    monkeypatch.setenv("LCE_TARGET", head.target)
    st, _ = head.hidden(4, seed=45)
    lp, ent = lt.remote_logprobs(torch.from_numpy(st.copy()), torch.tensor([1, 2, 3, -100]))
    assert lp.shape == (4,) and lp[3] == 0
    monkeypatch.setattr(lt, "_default_client", None)
