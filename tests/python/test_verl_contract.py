"""verl's fused linear cross-entropy contract, checked the way verl's own test checks its kernel.

Source read: volcengine/verl, tests/utils/test_linear_cross_entropy.py (last changed in eac4863ad722,
read at b178a3cd56f5) and verl/utils/kernel/linear_cross_entropy.py + kernels.py (read at
b178a3cd56f5). Their test is not vendored: this one calls `lce_client.rl.linear_cross_entropy` where
they call their kernel, against their reference `run_torch_entropy` (re-stated below: fp32 logits from
hidden @ weight.T / temperature, logprobs = -cross_entropy(reduction=...), entropy = logsumexp -
sum(softmax * logits)), with their inputs (hidden [1, T, H] and weight uniform in [-0.5, 0.5], labels
[1, T], temperature 1.5, upstream gradients g_entropy uniform in [-0.5, 0.5] and g_logprobs uniform in
[-1, 1] of shape [T]) and their tolerances (logprobs atol 1e-3 rtol 2e-4; entropy 5e-3 / 5e-4;
d_hidden 2e-2 / 4e-2), at sizes a CPU server answers in CI (their cases are T 1388..8192, H 896..4096,
V 32256..152064). The server's head is set to their weight with Client.update_weights.

d_weight as their test takes it: torch.autograd.grad w.r.t. (hidden, weight). The weight's gradient is
the served head's dW of the call's upstream gradients, computed by the Backward RPC into a pending
contribution that the client reads back and discards (the server's own dW is left alone).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lce_client.rl as rl  # noqa: E402
from conftest import own_server_client, serve_weight  # noqa: E402

TEMPERATURE = 1.5  # verl's TestLinearCrossEntropy default
# (T, H, V): small stand-ins for verl's five cases (odd sizes on purpose: the CPU engine's tails)
SHAPES = [(37, 48, 97), (300, 64, 1000)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def client(workdir):
    yield from own_server_client(workdir, "verl")


def run_torch_entropy(hidden, weight, labels, temperature, reduction="none"):
    """verl's reference (tests/utils/test_linear_cross_entropy.py), same operations in the same order."""
    hidden = hidden.squeeze(0).to(torch.float32)
    weight = weight.transpose(0, 1).to(torch.float32)
    logits = torch.matmul(hidden, weight)  # [num_tokens, vocab_size]
    logits /= temperature
    pd = torch.nn.functional.softmax(logits, dim=-1)
    entropy_a = torch.logsumexp(logits, dim=-1)
    entropy_b = torch.sum(pd * logits, dim=-1)
    entropy = entropy_a - entropy_b
    logprobs = torch.nn.functional.cross_entropy(logits, labels.squeeze(0), reduction=reduction)
    logprobs = torch.neg(logprobs)
    return logprobs, entropy


def forward_inputs(T, H, V, dtype, seed):
    """verl's generate_forward_inputs (batch 1), on the CPU and seeded."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.empty((1, T, H), dtype=dtype).uniform_(-0.5, 0.5, generator=g).requires_grad_()
    weight = torch.empty((V, H), dtype=dtype).uniform_(-0.5, 0.5, generator=g).requires_grad_()
    labels = torch.randint(0, V, (1, T), generator=g)
    return hidden, weight, labels


def backward_inputs(T, dtype, seed):
    """verl's generate_backward_inputs: g_entropy, g_logprobs of shape [T] in the inputs' dtype."""
    g = torch.Generator().manual_seed(seed)
    g_entropy = torch.empty((T,), dtype=dtype).uniform_(-0.5, 0.5, generator=g)
    g_logprobs = torch.empty((T,), dtype=dtype).uniform_(-1, 1, generator=g)
    return g_entropy, g_logprobs


def serve(client, weight, name):
    """The server's head := verl's weight; linear_cross_entropy's default head is it."""
    serve_weight(client, weight, name)
    rl.set_head(client, head=name)


@pytest.fixture(autouse=True)
def _reset_head():
    yield
    rl.set_head(None)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("T,H,V", SHAPES)
def test_verify_correctness(client, T, H, V, dtype):
    """verl's verify_correctness against run_torch_entropy: forward values of shape [T], and d_hidden
    from torch.autograd.grad with verl's [T] upstream gradients."""
    dt = DTYPES[dtype]
    hidden, weight, labels = forward_inputs(T, H, V, dt, seed=T + V)
    serve(client, weight, f"verl-{dtype}-{V}")
    torch_logprobs, torch_entropy = run_torch_entropy(hidden, weight, labels, TEMPERATURE)
    # verl's call, positional as in their test
    kernel_logprobs, kernel_entropy = rl.linear_cross_entropy(hidden, weight, labels, TEMPERATURE)
    assert kernel_logprobs.shape == (T,) and kernel_entropy.shape == (T,)
    torch.testing.assert_close(torch_logprobs, kernel_logprobs, atol=1e-3, rtol=2e-4)
    torch.testing.assert_close(torch_entropy, kernel_entropy, atol=5e-3, rtol=5e-4)

    g_entropy, g_logprobs = backward_inputs(T, dt, seed=T)
    client.zero_grad(head=f"verl-{dtype}-{V}")
    # verl's backward, as their test writes it: gradients w.r.t. hidden and weight
    (d_torch_hidden, d_torch_weight) = torch.autograd.grad(
        (torch_entropy, torch_logprobs), (hidden, weight), (g_entropy, g_logprobs), retain_graph=False)
    (d_kernel_hidden, d_kernel_weight) = torch.autograd.grad(
        (kernel_entropy, kernel_logprobs), (hidden, weight), (g_entropy, g_logprobs), retain_graph=False)
    assert d_kernel_hidden.shape == hidden.shape and d_kernel_hidden.dtype == hidden.dtype
    assert d_kernel_weight.shape == weight.shape and d_kernel_weight.dtype == weight.dtype
    torch.testing.assert_close(d_torch_hidden, d_kernel_hidden, atol=2e-2, rtol=4e-2)
    torch.testing.assert_close(d_torch_weight, d_kernel_weight, atol=2e-2, rtol=4e-2)
    # verl's tolerances are loose for its GPU kernel; ours is fp32 accumulation like the reference, so
    # hold it to more than theirs as well (bf16: d_hidden's rounding to bf16 on the way back; d_weight
    # comes back in fp32 and is rounded to the weight's dtype like the reference's).
    tight = {"fp32": 1e-5, "bf16": 1e-2}[dtype]
    torch.testing.assert_close(d_kernel_hidden.float(), d_torch_hidden.float(), atol=tight, rtol=tight)
    torch.testing.assert_close(d_kernel_weight.float(), d_torch_weight.float(), atol=tight, rtol=tight)
    assert not np.any(client.get_grad(head=f"verl-{dtype}-{V}")), "the server's own dW is left alone"


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reduced_logprobs_keep_per_token_entropy(client, reduction, dtype):
    """verl's kernel with reduction "sum" / "mean": logprobs is a scalar (the reference's
    -cross_entropy(reduction=...)), the entropy stays [T]; the backward takes a scalar g_logprobs
    (verl's kernel asserts dlogprobs.dim() == 0) and a [T] g_entropy."""
    T, H, V = SHAPES[0]
    dt = DTYPES[dtype]
    hidden, weight, labels = forward_inputs(T, H, V, dt, seed=7)
    serve(client, weight, f"verl-red-{dtype}")
    torch_logprobs, torch_entropy = run_torch_entropy(hidden, weight, labels, TEMPERATURE, reduction=reduction)
    kernel_logprobs, kernel_entropy = rl.linear_cross_entropy(hidden, weight, labels, TEMPERATURE, reduction)
    assert kernel_logprobs.shape == () and kernel_entropy.shape == (T,)
    torch.testing.assert_close(torch_logprobs, kernel_logprobs, atol=1e-3, rtol=2e-4)
    torch.testing.assert_close(torch_entropy, kernel_entropy, atol=5e-3, rtol=5e-4)
    g_entropy, _ = backward_inputs(T, dt, seed=8)
    g_logprobs = torch.tensor(-0.7, dtype=dt)
    (d_torch_hidden,) = torch.autograd.grad((torch_entropy, torch_logprobs), (hidden,), (g_entropy, g_logprobs))
    (d_kernel_hidden,) = torch.autograd.grad((kernel_entropy, kernel_logprobs), (hidden,), (g_entropy, g_logprobs))
    torch.testing.assert_close(d_torch_hidden, d_kernel_hidden, atol=2e-2, rtol=4e-2)


def test_flat_inputs_and_entropy_only_backward(client):
    """hidden [T, H] and labels [T] (verl's kernel takes both layouts) give the same answers as [1, T, H];
    a backward through the entropy alone (verl's entropy bonus without a logprob term) works."""
    T, H, V = SHAPES[0]
    hidden, weight, labels = forward_inputs(T, H, V, torch.float32, seed=9)
    serve(client, weight, "verl-flat")
    lp3, ent3 = rl.linear_cross_entropy(hidden, weight, labels, TEMPERATURE)
    flat = hidden.detach().reshape(T, H).requires_grad_()
    lp2, ent2 = rl.linear_cross_entropy(flat, weight, labels.reshape(T), TEMPERATURE)
    assert torch.equal(lp3, lp2) and torch.equal(ent3, ent2)
    _, torch_entropy = run_torch_entropy(flat, weight, labels, TEMPERATURE)
    g_entropy, _ = backward_inputs(T, torch.float32, seed=10)
    (want,) = torch.autograd.grad(torch_entropy, flat, g_entropy)
    (got,) = torch.autograd.grad(ent2, flat, g_entropy)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_frozen_weight_gets_no_gradient(client):
    """A weight that needs no gradient is no input of the op: d_hidden as before, and the server's own
    dW untouched. (A tensor-parallel rank's shard of the weight: tests/python/test_tp_group.py.)"""
    T, H, V = SHAPES[0]
    hidden, weight, labels = forward_inputs(T, H, V, torch.float32, seed=11)
    serve(client, weight, "verl-dw")
    client.zero_grad(head="verl-dw")
    g_entropy, g_logprobs = backward_inputs(T, torch.float32, seed=12)
    lp, ent = rl.linear_cross_entropy(hidden, weight.detach(), labels, TEMPERATURE)
    (d_hidden,) = torch.autograd.grad((ent, lp), (hidden,), (g_entropy, g_logprobs))
    assert d_hidden is not None
    assert not np.any(client.get_grad(head="verl-dw"))
