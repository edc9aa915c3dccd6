"""Liger-Kernel's fused linear cross-entropy test, case by case, against the remote head.

Source read: linkedin/Liger-Kernel, test/transformers/test_fused_linear_cross_entropy.py at ead96b618e5c
(last changed in 9ac26bb82226, "Fix wrong grad_weight/grad_bias ... reduction='none'"), its reference
CrossEntropyWithZLoss in test/transformers/test_cross_entropy.py and liger_fused_linear_cross_entropy's
signature in src/liger_kernel/transformers/functional.py (input, weight, target, bias, ce_weight,
ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss, accum_dtype,
use_token_scaling, return_token_accuracy, return_predicted_tokens; no temperature). Their file is not
vendored: each of their test functions has a counterpart here of the same name that builds their inputs
(torch.rand weights, randn inputs, random ignore_index rows), runs their ground truth (TorchLMHeadCE:
F.linear in the dtype, to fp32, softcap, CrossEntropyWithZLoss; restated below) and, where they call
Liger, calls lce_client.torch.remote_linear_cross_entropy with the server's head set to their weight
(Client.update_weights) and accumulate_weight_grad=True; their weight.grad is the server's dW
(Client.get_grad). Their tolerances, their element-wise check (assert_verbose_allclose: |ref - got| <=
atol + rtol * |got|).

Liger's mapping: lse_square_scale is our z_loss (added to the loss, as in CrossEntropyWithZLoss);
label_smoothing, ignore_index (any value, 42 included), softcap, reduction, ce_weight (class weights),
return_z_loss, return_token_accuracy and return_predicted_tokens are ours (the op's keywords, answers in
Liger's CrossEntropyOutput), and a bias (the server's head holds it in fp32 and trains it: their
bias.grad is the server's dB, Client.get_grad(bias=True)). Cases the service cannot express skip,
naming the feature: use_token_scaling. Their
large shape (B, T, H, V) = (8, 128, 1024, 4096) runs with LCE_LIGER_LARGE=1 (2-3 s a case on one
CPU thread; CI runs their "random shape" (4, 47, 31, 123)).
"""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from conftest import own_server_client, serve_weight  # noqa: E402
from lce_client.torch import CrossEntropyOutput, remote_linear_cross_entropy  # noqa: E402

HEAD = "liger"
LARGE = pytest.param(8, 128, 1024, 4096, marks=pytest.mark.skipif(
    not os.environ.get("LCE_LIGER_LARGE"), reason="Liger's large shape: 2-3 s a case on one CPU thread, about "
    "30 cases, too slow for CI; set LCE_LIGER_LARGE=1 to run it"))
SHAPES = [LARGE, (4, 47, 31, 123)]


@pytest.fixture(scope="module")
def client(workdir):
    yield from own_server_client(workdir, "liger")


def skip_unless(*missing):
    """Skips naming every feature in `missing` that a case needs (pairs of (needed, name))."""
    names = [name for needed, name in missing if needed]
    if names:
        pytest.skip("the service cannot express " + "; ".join(names))


def cross_entropy_with_z_loss(logits, targets, *, lse_square_scale=0.0, reduction="mean", ignore_index=-100,
                              label_smoothing=0.0, ce_weight=None, return_z_loss=False):
    """Liger's CrossEntropyWithZLoss (test/transformers/test_cross_entropy.py), same operations."""
    logits = logits.to(torch.float32)
    target_mask = targets != ignore_index
    ce_loss = F.cross_entropy(logits, targets, weight=ce_weight, reduction=reduction, label_smoothing=label_smoothing,
                              ignore_index=ignore_index)
    lse = torch.logsumexp(logits, dim=-1)
    z_loss = torch.where(targets != ignore_index, lse_square_scale * (lse ** 2), 0.0)
    if reduction == "mean":
        z_loss = z_loss.sum() / target_mask.sum()
    elif reduction == "sum":
        z_loss = z_loss.sum()
    total = ce_loss.to(torch.float32) + z_loss.to(torch.float32)
    return (total, z_loss.to(torch.float32)) if return_z_loss else total


def torch_lm_head_ce(x, weight, y, *, bias=None, softcap=None, **ce):
    """Liger's TorchLMHeadCE.forward: linear (with its bias) in the inputs' dtype, fp32, softcap, CE + z-loss."""
    logits = F.linear(x, weight, bias).to(torch.float32)
    if softcap is not None and softcap != 0.0:
        logits = softcap * torch.tanh(logits / softcap)
    return cross_entropy_with_z_loss(logits, y, **ce)


def remote_lm_head_ce(client, x, y, *, lse_square_scale=0.0, softcap=None, **kw):
    """Where Liger's test calls LigerFusedLinearCrossEntropyLoss(weight, x, y): the server's head."""
    return remote_linear_cross_entropy(x, y, client, z_loss=lse_square_scale, softcap=softcap, head=HEAD,
                                       accumulate_weight_grad=True, **kw)


def assert_verbose_allclose(ref, got, *, atol, rtol, what=""):
    """Liger's test.utils check: element-wise |ref - got| <= atol + rtol * |got| (in float64 here)."""
    ref, got = torch.as_tensor(ref).detach().double(), torch.as_tensor(got).detach().double()
    assert ref.shape == got.shape, f"{what}: shape {tuple(ref.shape)} != {tuple(got.shape)}"
    excess = (ref - got).abs() - (atol + rtol * got.abs())
    assert bool((excess <= 0).all()), f"{what}: {int((excess > 0).sum())} elements past atol={atol} rtol={rtol}, " \
                                      f"max |diff| {(ref - got).abs().max().item():.3g}"


def with_ignored(target, ignore_index, g):
    """Liger's 'some random number of elements as ignore_index'."""
    n = target.numel()
    k = int(torch.randint(1, n // 2, (1,), generator=g))
    target[torch.randperm(n, generator=g)[:k]] = ignore_index
    return target


def check_case(client, *, B, T, H, V, dtype, reduction, atol, rtol, seed, grad_output=None, weight=None,
               target=None, x=None, return_z_loss=False, bias=None, **opts):
    """Their fixture of one test: the same weight (and bias) in both heads, the same inputs, loss, input
    gradient, weight gradient (and bias gradient) compared; grad_output: the loss's upstream gradient
    (default ones_like)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.rand(V, H, generator=g, dtype=torch.float32).to(dtype) if weight is None else weight
    serve_weight(client, weight, HEAD, bias=bias)
    x = (torch.randn(B * T, H, generator=g, dtype=torch.float32).to(dtype)) if x is None else x
    if target is None:
        target = with_ignored(torch.randint(0, V, (B * T,), generator=g), opts.get("ignore_index", -100), g)
    x1, x2 = x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    w1 = weight.detach().clone().requires_grad_(True)
    b1 = bias.detach().clone().requires_grad_(True) if bias is not None else None
    output1 = torch_lm_head_ce(x1, w1, target, bias=b1, reduction=reduction, return_z_loss=return_z_loss, **opts)
    output2 = remote_lm_head_ce(client, x2, target, reduction=reduction, return_z_loss=return_z_loss, **opts)
    if return_z_loss:  # their check of the z-loss output (CrossEntropyOutput.z_loss)
        (output1, z_output1), output2, z_output2 = output1, output2.loss, output2.z_loss
        assert_verbose_allclose(z_output1, z_output2, atol=atol, rtol=rtol, what="z_loss")
    assert_verbose_allclose(output1, output2, atol=atol, rtol=rtol, what="loss")
    grad_output = torch.ones_like(output1) if grad_output is None else grad_output
    output1.backward(gradient=grad_output)
    output2.backward(gradient=grad_output)
    assert_verbose_allclose(x1.grad, x2.grad, atol=atol, rtol=rtol, what="input grad")
    assert_verbose_allclose(w1.grad, torch.from_numpy(client.get_grad(head=HEAD)), atol=atol, rtol=rtol,
                            what="weight grad (the server's dW)")
    if bias is not None:
        assert_verbose_allclose(b1.grad, torch.from_numpy(client.get_grad(head=HEAD, bias=True)), atol=atol,
                                rtol=rtol, what="bias grad (the server's dB)")


REDUCTIONS = [("mean", 1.0, torch.bfloat16, 5e-3, 5e-2), ("mean", 1.0, torch.float32, 1e-5, 5e-4),
              ("sum", 1.0, torch.bfloat16, 5e-0, 5e1), ("sum", 1.0, torch.float32, 1e-3, 5e-2)]
# Liger's two option rows (has_ce_weight, label_smoothing, ignore_index, lse_square_scale, softcap,
# return_z_loss, accum_dtype), and their second row without the two things the service lacks (class
# weights, the z-loss as its own output): label smoothing, ignore_index 42, z-loss in the loss, softcap.
OPTIONS = [(False, 0, -100, 0, None, False, None), (True, 0.1, 42, 1e-4, 30.0, True, torch.float32),
           pytest.param(False, 0.1, 42, 1e-4, 30.0, False, torch.float32, id="row2-without-ce_weight-z_output")]


def _options_case(fn):
    fn = pytest.mark.parametrize("has_ce_weight, label_smoothing, ignore_index, lse_square_scale, softcap, "
                                 "return_z_loss, accum_dtype", OPTIONS)(fn)
    fn = pytest.mark.parametrize("bias", [True, False])(fn)
    fn = pytest.mark.parametrize("reduction, scalar, dtype, atol, rtol", REDUCTIONS)(fn)
    return pytest.mark.parametrize("B, T, H, V", SHAPES)(fn)


@_options_case
def test_correctness(client, B, T, H, V, scalar, dtype, bias, has_ce_weight, lse_square_scale, label_smoothing,
                     ignore_index, reduction, softcap, return_z_loss, accum_dtype, atol, rtol):
    """accum_dtype (Liger's gradient accumulation dtype) needs nothing: the server accumulates in fp32."""
    g = torch.Generator().manual_seed(V)
    ce_weight = torch.rand(V, generator=g, dtype=torch.float32) if has_ce_weight else None
    b = torch.rand(V, generator=g).to(dtype) if bias else None  # theirs: lin.bias.data = torch.rand(V, dtype)
    check_case(client, B=B, T=T, H=H, V=V, dtype=dtype, reduction=reduction, atol=atol, rtol=rtol, seed=B + V,
               lse_square_scale=lse_square_scale, label_smoothing=label_smoothing, ignore_index=ignore_index,
               softcap=softcap, ce_weight=ce_weight, return_z_loss=return_z_loss, bias=b)


@_options_case
def test_correctness_with_forward_only(client, B, T, H, V, scalar, dtype, bias, has_ce_weight, lse_square_scale,
                                       label_smoothing, ignore_index, reduction, softcap, return_z_loss,
                                       accum_dtype, atol, rtol):
    """Under no_grad: the same loss, an output that cannot be backpropagated ("does not require grad"),
    and (our contract) nothing added to the head's gradient."""
    g = torch.Generator().manual_seed(B + V + 1)
    weight = torch.rand(V, H, generator=g).to(dtype)
    b = torch.rand(V, generator=g).to(dtype) if bias else None
    serve_weight(client, weight, HEAD, bias=b)
    x = torch.randn(B * T, H, generator=g).to(dtype)
    target = with_ignored(torch.randint(0, V, (B * T,), generator=g), ignore_index, g)
    ce_weight = torch.rand(V, generator=g) if has_ce_weight else None
    opts = dict(reduction=reduction, lse_square_scale=lse_square_scale, label_smoothing=label_smoothing,
                ignore_index=ignore_index, softcap=softcap, ce_weight=ce_weight, return_z_loss=return_z_loss)
    x2 = x.clone().requires_grad_(True)
    with torch.no_grad():
        output1 = torch_lm_head_ce(x, weight, target, bias=b, **opts)
        output2 = remote_lm_head_ce(client, x2, target, **opts)
        if return_z_loss:
            assert_verbose_allclose(output1[1], output2.z_loss, atol=atol, rtol=rtol, what="z_loss")
            output1, output2 = output1[0], output2.loss
        assert_verbose_allclose(output1, output2, atol=atol, rtol=rtol, what="loss")
    with pytest.raises(RuntimeError, match="does not require grad"):
        output2.backward(gradient=torch.rand_like(output1))
    assert not client.get_grad(head=HEAD).any(), "a no_grad forward added to the head's gradient"
    if bias:
        assert not client.get_grad(head=HEAD, bias=True).any(), "a no_grad forward added to the bias's gradient"


@pytest.mark.parametrize("B, T, H, V", [(2, 2, 8, 8), (9, 7, 41, 41)])
@pytest.mark.parametrize("scalar, dtype, atol, rtol",
                         [(1.0, torch.bfloat16, 5e-3, 5e-2), (1.0, torch.float32, 1e-5, 5e-4)])
@pytest.mark.parametrize("ce_weight", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_correctness_functional(client, B, T, H, V, scalar, dtype, bias, ce_weight, atol, rtol):
    """Theirs compares liger_fused_linear_cross_entropy with LigerFusedLinearCrossEntropyFunction (both
    Liger): randn inputs, weight and ce_weight (negative class weights included), lse_square_scale 1e-4,
    label_smoothing 0.1, softcap 30, mean, return_z_loss, a randn scalar grad_output. Ours against their
    ground truth on the same inputs: loss, z-loss, both gradients."""
    g = torch.Generator().manual_seed(B * V + int(ce_weight))
    x = torch.randn(B * T, H, generator=g).to(dtype) * scalar
    target = torch.randint(0, V, (B * T,), generator=g)
    weight = torch.randn(V, H, generator=g).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    cw = torch.randn(V, generator=g) if ce_weight else None
    check_case(client, B=B, T=T, H=H, V=V, dtype=dtype, reduction="mean", atol=atol, rtol=rtol, seed=0, x=x,
               weight=weight, target=target, grad_output=torch.randn((), generator=g), lse_square_scale=1e-4,
               label_smoothing=0.1, softcap=30.0, ce_weight=cw, return_z_loss=True, bias=b)


@pytest.mark.parametrize("B, T, H, V", [(2, 2, 8, 8), (9, 7, 41, 41)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.bfloat16, 5e-3, 5e-2), (torch.float32, 1e-5, 5e-4)])
def test_functional_options_loss_and_gradients(client, B, T, H, V, dtype, atol, rtol):
    """test_correctness_functional's inputs and options (randn weight, lse_square_scale 1e-4,
    label_smoothing 0.1, softcap 30, mean) and its randn scalar grad_output, the loss and both
    gradients against their ground truth."""
    g = torch.Generator().manual_seed(B * V)
    x = torch.randn(B * T, H, generator=g).to(dtype)
    weight = torch.randn(V, H, generator=g).to(dtype)
    target = torch.randint(0, V, (B * T,), generator=g)
    check_case(client, B=B, T=T, H=H, V=V, dtype=dtype, reduction="mean", atol=atol, rtol=rtol, seed=0, x=x,
               weight=weight, target=target, grad_output=torch.randn((), generator=g), lse_square_scale=1e-4,
               label_smoothing=0.1, softcap=30.0)


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("reduction, scalar, dtype, atol, rtol", REDUCTIONS[:2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("return_token_accuracy", [True, False])
def test_correctness_with_token_accuracy(client, B, T, H, V, scalar, dtype, bias, return_token_accuracy, reduction,
                                         atol, rtol):
    """Their loss and gradients with and without return_token_accuracy, and the accuracy against theirs:
    argmax of the logits in the inputs' dtype, right where it is the target, over the valid tokens."""
    g = torch.Generator().manual_seed(B * T)
    weight = torch.rand(V, H, generator=g).to(dtype)
    b = torch.rand(V, generator=g).to(dtype) if bias else None
    x = (torch.randn(B * T, H, generator=g) * scalar).to(dtype)
    target = with_ignored(torch.randint(0, V, (B * T,), generator=g), -100, g)
    if return_token_accuracy:
        serve_weight(client, weight, HEAD, bias=b)
        result = remote_lm_head_ce(client, x.clone().requires_grad_(True), target, reduction=reduction,
                                   return_token_accuracy=True)
        with torch.no_grad():
            predictions = torch.argmax(x @ weight.t() + (b if bias else 0), dim=-1)
            mask = target != -100
            expected_accuracy = ((predictions == target) & mask).sum().float() / mask.sum().float()
        assert_verbose_allclose(result.token_accuracy, expected_accuracy, atol=atol, rtol=rtol, what="accuracy")
    check_case(client, B=B, T=T, H=H, V=V, dtype=dtype, reduction=reduction, atol=atol, rtol=rtol, seed=0,
               weight=weight, x=x, target=target, bias=b)


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("bias, cast_dtype, atol, rtol",
                         [(True, torch.bfloat16, 5e-3, 5e-2), (True, torch.float16, 5e-3, 5e-2),
                          (False, torch.bfloat16, 5e-3, 5e-2), (False, torch.float16, 5e-3, 5e-2)])
@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
def test_amp(client, B, T, H, V, bias, cast_dtype, accum_dtype, atol, rtol):
    """fp32 head and inputs under torch.autocast (CPU here): their ground truth's linear runs in the cast
    dtype, the server's head in fp32; accum_dtype needs nothing (fp32 accumulation). Their bias is
    nn.Linear's own initialisation (U(±1/sqrt(H))), here the same in both heads."""
    g = torch.Generator().manual_seed(V + int(cast_dtype == torch.float16))
    weight = torch.rand(V, H, generator=g)
    b = (torch.rand(V, generator=g) * 2 - 1) / H ** 0.5 if bias else None
    serve_weight(client, weight, HEAD, bias=b)
    x = torch.randn(B * T, H, generator=g)
    target = torch.randint(0, V, (B * T,), generator=g)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    w1 = weight.clone().requires_grad_(True)
    b1 = b.clone().requires_grad_(True) if bias else None
    with torch.autocast(device_type="cpu", dtype=cast_dtype):
        output1 = torch_lm_head_ce(x1, w1, target, bias=b1)
        output2 = remote_lm_head_ce(client, x2, target)
    assert_verbose_allclose(output1, output2, atol=atol, rtol=rtol, what="loss")
    with torch.autocast(device_type="cpu", dtype=cast_dtype):
        output1.backward()
        output2.backward()
    assert_verbose_allclose(x1.grad, x2.grad, atol=atol, rtol=rtol, what="input grad")
    assert_verbose_allclose(w1.grad, torch.from_numpy(client.get_grad(head=HEAD)), atol=atol, rtol=rtol,
                            what="weight grad (the server's dW)")
    if bias:
        assert_verbose_allclose(b1.grad, torch.from_numpy(client.get_grad(head=HEAD, bias=True)), atol=atol,
                                rtol=rtol, what="bias grad (the server's dB)")


@pytest.mark.parametrize("name", ["test_correctness_token_scaling", "test_correctness_token_scaling_consistency",
                                  "test_correctness_token_scaling_functional",
                                  "test_correctness_token_scaling_module", "test_token_scaling_with_ignore_index"])
def test_token_scaling(name):
    """Their five use_token_scaling tests: each token's loss times its detached predicted probability."""
    skip_unless((True, f"{name}: use_token_scaling (loss scaled by the predicted probability)"))


@pytest.mark.parametrize("return_z_loss, return_token_accuracy",
                         [(False, False), (True, False), (False, True), (True, True)])
def test_liger_fused_linear_cross_entropy_structured_output(client, return_z_loss, return_token_accuracy):
    """Their hand-written 3x2 head with its bias: a plain loss without the flags, a CrossEntropyOutput with
    them (z_loss / token_accuracy present exactly when asked), the loss equal to F.cross_entropy within
    1e-6, their accuracy, and a loss that backpropagates."""
    hidden_states = torch.tensor([[0.2, -0.1], [1.0, 0.5], [-0.3, 0.7]], requires_grad=True)
    weight = torch.tensor([[0.5, -0.4], [-0.2, 0.3], [0.1, 0.6]])
    bias = torch.tensor([0.1, -0.2, 0.05])
    targets = torch.tensor([0, 1, 2])
    serve_weight(client, weight, HEAD, bias=bias)
    result = remote_lm_head_ce(client, hidden_states, targets, return_z_loss=return_z_loss,
                               return_token_accuracy=return_token_accuracy)
    logits = hidden_states @ weight.t() + bias
    expected_loss = F.cross_entropy(logits, targets)
    if not return_z_loss and not return_token_accuracy:
        assert isinstance(result, torch.Tensor)
        assert torch.allclose(result, expected_loss, atol=1e-6)
        result.backward()
    else:
        assert isinstance(result, CrossEntropyOutput)
        assert torch.allclose(result.loss, expected_loss, atol=1e-6)
        assert (result.z_loss is not None) == return_z_loss
        assert (result.token_accuracy is not None) == return_token_accuracy
        if return_token_accuracy:
            expected_accuracy = (logits.argmax(dim=-1) == targets).float().mean()
            assert torch.allclose(result.token_accuracy, expected_accuracy, atol=1e-6)
        result.loss.backward()
    assert hidden_states.grad is not None


@pytest.mark.parametrize("B, T, H, V", SHAPES)
@pytest.mark.parametrize("reduction, dtype, atol, rtol", [("mean", torch.bfloat16, 5e-3, 5e-2),
                                                          ("mean", torch.float32, 1e-5, 5e-4)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_correctness_with_predicted_tokens(client, B, T, H, V, reduction, dtype, bias, ignore_index, atol, rtol):
    """Their checks: CrossEntropyOutput.predicted_tokens int64 [B*T], the logit at the predicted token equal
    to the row's max logit (within their tolerance), -1 for ignored rows, and a loss that backpropagates."""
    g = torch.Generator().manual_seed(42)
    weight = torch.randn(V, H, generator=g).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    serve_weight(client, weight, HEAD, bias=b)
    x = torch.randn(B * T, H, generator=g).to(dtype).requires_grad_(True)
    target = torch.randint(0, V, (B * T,), generator=g)
    target[torch.randperm(B * T, generator=g)[:B * T // 4]] = ignore_index
    result = remote_lm_head_ce(client, x, target, ignore_index=ignore_index, reduction=reduction,
                               return_predicted_tokens=True)
    assert result.predicted_tokens is not None
    assert result.predicted_tokens.shape == (B * T,)
    assert result.predicted_tokens.dtype == torch.int64
    mask = target != ignore_index
    with torch.no_grad():
        logits = x.float() @ weight.float().t() + (b.float() if bias else 0)
        max_logits = logits[mask].max(dim=-1).values
        predicted = logits[mask].gather(1, result.predicted_tokens[mask].unsqueeze(1)).squeeze(1)
    assert torch.allclose(predicted, max_logits, atol=atol, rtol=rtol)
    assert torch.all(result.predicted_tokens[~mask] == -1)
    result.loss.backward()
    assert x.grad is not None


@pytest.mark.parametrize("B, T, H, V", [(2, 16, 32, 64), (1, 32, 64, 128)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-4, 1e-4)])
def test_correctness_reduction_none_per_token_grad_output(client, B, T, H, V, bias, dtype, atol, rtol):
    """reduction="none" with a non-uniform per-token grad_output: dW = sum_i grad_output[i] * (g_i outer
    x_i). Their regression test for a kernel that scaled every row by grad_output[0]; here the server's
    dW (a recompute with grad_loss = grad_output, docs/MATH.md) against their torch_ref."""
    g = torch.Generator().manual_seed(42 + V)
    x = torch.randn(B * T, H, generator=g, dtype=dtype) * 0.1
    weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.1
    b = torch.randn(V, generator=g, dtype=dtype) * 0.1 if bias else None  # theirs: randn(V) * 0.1
    target = torch.randint(0, V, (B * T,), generator=g)
    grad_output = torch.rand(B * T, generator=g, dtype=dtype) + 0.5
    check_case(client, B=B, T=T, H=H, V=V, dtype=dtype, reduction="none", atol=atol, rtol=rtol, seed=0, x=x,
               weight=weight, target=target, grad_output=grad_output, bias=b)
