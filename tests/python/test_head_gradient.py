"""The head's gradient is autograd's gradient (docs/MATH.md, "When dW is committed"): for every path
that trains a head through the service, the dW the server adds equals what PyTorch autograd gives the
same loss on a local head, in float64 — whatever the upstream gradient (loss / k, weighted sums,
per-token grad_output of reduction "none", a loss used twice, several calls summed, a retained graph
backpropagated twice), and nothing for a forward that is never backpropagated (no_grad,
inference_mode, a dropped loss). Liger-Kernel's regression test for the same contract
(test/transformers/test_fused_linear_cross_entropy.py, "reduction='none' with per-token grad_output")
is the per-token case here."""
import gc

import numpy as np
import pytest

import lce_client
from conftest import HIDDEN, assert_close, requires_torch, write_safetensors
from lce_client.rl import remote_policy_loss
from lce_client.torch import remote_linear_cross_entropy

VOCAB = 97
ROWS = 24


@pytest.fixture(scope="module")
def srv(server_factory_module):
    rng = np.random.default_rng(3)
    w0 = (rng.standard_normal((VOCAB, HIDDEN)) / np.sqrt(HIDDEN) * 2).astype(np.float32)
    return server_factory_module(w0), w0


@pytest.fixture(scope="module")
def server_factory_module(workdir):
    from conftest import Server

    started = []

    def start(w0, extra=()):
        path = workdir / f"head_grad_{len(started)}.safetensors"
        write_safetensors(path, {"lm_head.weight": (w0, "F32")})
        s = Server([f"--head-file={path}", *extra], workdir, f"head_grad_{len(started)}")
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def _rows(seed, rows=ROWS):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
    y = rng.integers(0, VOCAB, rows)
    y[::5] = -100
    return h, y


def _local(w0):
    import torch

    return torch.tensor(w0, dtype=torch.float64, requires_grad=True)


def _ce(W, h, y, reduction="mean"):
    import torch

    return torch.nn.functional.cross_entropy(torch.tensor(h, dtype=torch.float64) @ W.T, torch.tensor(y),
                                             ignore_index=-100, reduction=reduction)


def _remote(c, h, y, reduction="mean", **kw):
    import torch

    return remote_linear_cross_entropy(torch.tensor(h, requires_grad=True), torch.tensor(y), c, reduction=reduction,
                                       accumulate_weight_grad=True, **kw)


def _check(c, W):
    """The server's dW against the local head's autograd gradient (zero when it has none)."""
    want = W.grad.numpy() if W.grad is not None else np.zeros(tuple(W.shape))
    # fp32 accumulation against float64: within a few ulps of the gradient's scale.
    assert_close(c.get_grad(), want, rtol=2e-6, atol=1e-12, what="dW")
    c.zero_grad()


@requires_torch
@pytest.mark.parametrize("case", ["scaled", "zero", "weighted_sum", "used_twice", "accumulated", "divisor"])
def test_scalar_upstream_gradients(srv, case):
    server, w0 = srv
    c = lce_client.Client(server.target, timeout=60)
    c.zero_grad()
    W = _local(w0)
    (h1, y1), (h2, y2) = _rows(1), _rows(2)
    if case == "scaled":  # gradient accumulation's loss / k
        (_remote(c, h1, y1) / 4).backward()
        (_ce(W, h1, y1) / 4).backward()
    elif case == "zero":
        (_remote(c, h1, y1) * 0.0).backward()
        (_ce(W, h1, y1) * 0.0).backward()
    elif case == "weighted_sum":  # a * ce + b * other, over two calls
        (0.3 * _remote(c, h1, y1) - 1.7 * _remote(c, h2, y2, reduction="sum")).backward()
        (0.3 * _ce(W, h1, y1) - 1.7 * _ce(W, h2, y2, "sum")).backward()
    elif case == "used_twice":
        loss = _remote(c, h1, y1)
        (loss + 2.5 * loss).backward()
        ref = _ce(W, h1, y1)
        (ref + 2.5 * ref).backward()
    elif case == "accumulated":  # k micro-batches of loss / k equal one batch of the union, mean over it
        h = np.concatenate([h1, h2])
        y = np.concatenate([y1, y2])
        valid = int((y != -100).sum())
        for hh, yy in ((h1, y1), (h2, y2)):
            (_remote(c, hh, yy, reduction="sum") / valid).backward()
        _ce(W, h, y).backward()
    elif case == "divisor":  # Hugging Face's num_items_in_batch, then a gradient-accumulation scale
        (_remote(c, h1, y1, reduction="sum", divisor=37.0) * 0.5).backward()
        (_ce(W, h1, y1, "sum") / 37.0 * 0.5).backward()
    _check(c, W)


@requires_torch
def test_divisor_divides_the_loss_d_hidden_and_dw_alike(srv):
    """divisor (Hugging Face's num_items_in_batch): the loss is sum / divisor, and d_hidden and dW are
    the quotient's, on the first backward (the pending dW, scaled) and on a retained graph's second one
    (recomputed with per-row upstream gradients). Guards against a divisor dropped from the forward's
    value, its grad_loss or _recompute's per-row gradient."""
    import torch

    server, w0 = srv
    c = lce_client.Client(server.target, timeout=60)
    c.zero_grad()
    W = _local(w0)
    h, y = _rows(6)
    hid = torch.tensor(h, requires_grad=True)
    loss = remote_linear_cross_entropy(hid, torch.tensor(y), c, reduction="sum", divisor=37.0,
                                       accumulate_weight_grad=True)
    ref_h = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(ref_h @ W.T, torch.tensor(y), ignore_index=-100, reduction="sum") / 37.0
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()), (loss.item(), ref.item())
    loss.backward(retain_graph=True)
    ref.backward(retain_graph=True)
    np.testing.assert_allclose(hid.grad.numpy(), ref_h.grad.numpy(), rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    np.testing.assert_allclose(hid.grad.numpy(), ref_h.grad.numpy(), rtol=1e-5, atol=1e-6)
    _check(c, W)


@requires_torch
def test_per_token_grad_output_of_reduction_none(srv):
    """Liger-Kernel's case: reduction="none" and a random per-token grad_output (it recomputes), then a
    uniform one (the pending contribution, scaled)."""
    import torch

    server, w0 = srv
    c = lce_client.Client(server.target, timeout=60)
    c.zero_grad()
    W = _local(w0)
    h, y = _rows(5)
    g = torch.randn(ROWS, dtype=torch.float32)
    hid = torch.tensor(h, requires_grad=True)
    loss = remote_linear_cross_entropy(hid, torch.tensor(y), c, reduction="none", accumulate_weight_grad=True)
    loss.backward(g)
    ref_h = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(ref_h @ W.T, torch.tensor(y), ignore_index=-100, reduction="none")
    ref.backward(g.to(torch.float64))
    np.testing.assert_allclose(hid.grad.numpy(), ref_h.grad.numpy(), rtol=1e-5, atol=1e-6)
    _check(c, W)
    W.grad = None
    _remote(c, h, y, reduction="none").mean().backward()
    _ce(W, h, y, "none").mean().backward()
    _check(c, W)


@requires_torch
def test_retained_graph_backpropagated_twice(srv):
    server, w0 = srv
    c = lce_client.Client(server.target, timeout=60)
    c.zero_grad()
    W = _local(w0)
    h, y = _rows(6)
    loss = _remote(c, h, y)
    loss.backward(retain_graph=True)
    (loss * 3).backward()
    ref = _ce(W, h, y)
    ref.backward(retain_graph=True)
    (ref * 3).backward()
    _check(c, W)


@requires_torch
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "dropped", "frozen_body"])
def test_forwards_without_a_backward_add_nothing(srv, mode):
    import torch

    server, w0 = srv
    c = lce_client.Client(server.target, timeout=60)
    c.zero_grad()
    W = _local(w0)
    h, y = _rows(7)
    if mode == "no_grad":
        with torch.no_grad():
            _remote(c, h, y)
    elif mode == "inference_mode":
        with torch.inference_mode():
            _remote(c, h, y)
    elif mode == "dropped":
        loss = _remote(c, h, y)
        del loss
        gc.collect()
    else:  # hidden states that need no gradient: the head still trains, through its own anchor
        remote_linear_cross_entropy(torch.tensor(h), torch.tensor(y), c, accumulate_weight_grad=True).backward()
        _ce(W, h, y).backward()
    _check(c, W)
    if mode != "frozen_body":
        assert not np.any(c.get_grad()), "a forward without a backward added to dW"


@requires_torch
def test_policy_loss_scaled(srv):
    """remote_policy_loss: the PolicyLoss dW times the loss's upstream gradient (against the unscaled
    call's dW, scaled, which the server computes exactly the same way)."""
    import torch

    server, w0 = srv
    c = lce_client.Client(server.target, timeout=60)
    h, y = _rows(8)
    old = np.full(ROWS, -4.0, np.float32)
    adv = np.linspace(-1, 1, ROWS).astype(np.float32)
    c.zero_grad()
    c.policy_loss(h, y, old, adv, accumulate_weight_grad=True)
    plain = c.get_grad()
    c.zero_grad()
    loss, _ = remote_policy_loss(torch.tensor(h, requires_grad=True), torch.tensor(y), old, adv, c,
                                 accumulate_weight_grad=True)
    (loss * -0.25).backward()
    np.testing.assert_allclose(c.get_grad(), -0.25 * plain, rtol=1e-6, atol=1e-9)
    c.zero_grad()
    with torch.no_grad():
        remote_policy_loss(torch.tensor(h), torch.tensor(y), old, adv, c, accumulate_weight_grad=True)
    assert not np.any(c.get_grad())


def test_commit_grad_rpc_contract(srv):
    """CommitGrad itself: a deferred call adds nothing until committed; an id commits once; discard
    drops it; an optimizer step leaves none to commit (FAILED_PRECONDITION); a bad scale is refused."""
    import grpc

    server, w0 = srv
    c = lce_client.Client(server.target, timeout=60)
    h, y = _rows(9)
    c.zero_grad()
    c.forward_backward(h, y, accumulate_weight_grad=True)
    plain = c.get_grad()
    c.zero_grad()
    r = c.forward_backward(h, y, accumulate_weight_grad=True, defer_weight_grad=True)
    assert len(r.pending_grads) == 1 and not np.any(c.get_grad())
    c.commit_grad(r.pending_grads, scale=2.0)
    np.testing.assert_allclose(c.get_grad(), 2.0 * plain, rtol=1e-6, atol=1e-9)
    with pytest.raises(lce_client.LceError) as e:
        c.commit_grad(r.pending_grads)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "already" in str(e.value)
    r = c.forward_backward(h, y, accumulate_weight_grad=True, defer_weight_grad=True)
    with pytest.raises(lce_client.LceError) as e:
        c.commit_grad(r.pending_grads, scale=float("nan"))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    c.commit_grad(r.pending_grads, discard=True)
    np.testing.assert_allclose(c.get_grad(), 2.0 * plain, rtol=1e-6, atol=1e-9)
    r = c.forward_backward(h, y, accumulate_weight_grad=True, defer_weight_grad=True)
    c.optimizer_step(lr=0.0)
    with pytest.raises(lce_client.LceError) as e:
        c.commit_grad(r.pending_grads)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "weight changed" in str(e.value)
    with pytest.raises(lce_client.LceError) as e:
        c.commit_grad(12345)
    assert e.value.code == grpc.StatusCode.NOT_FOUND


@requires_torch
@pytest.mark.parametrize("mode", ["scaled", "no_grad"])
def test_a_forward_split_over_streams_is_one_contribution(server_factory_module, mode):
    """A forward split over four streams (Client(streams=4)) fills one contribution on the server
    (RequestHeader.split_id): a server that holds one at a time takes all four parts, the backward commits
    it once, scaled, and a forward under no_grad leaves nothing."""
    import torch

    rng = np.random.default_rng(12)
    w0 = (rng.standard_normal((VOCAB, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    server = server_factory_module(w0, ["--max-pending-grads=1"])
    rows, rb = 400, HIDDEN * 4
    c = lce_client.Client(server.target, timeout=60, streams=4, chunk_bytes=16 * rb, min_stream_bytes=40 * rb)
    assert len(c._plan_parts(rows, rb, 16, None)) == 4
    c.zero_grad()
    W = _local(w0)
    h, y = _rows(13, rows)
    if mode == "scaled":
        (_remote(c, h, y) / 4).backward()
        (_ce(W, h, y) / 4).backward()
    else:
        with torch.no_grad():
            _remote(c, h, y)
    _check(c, W)


def test_pending_contributions_are_bounded(server_factory_module):
    """--max-pending-grads: clients that forward and never commit push out the oldest (evicted, then
    NOT_FOUND for its commit) and the head's dW stays as it was; expired ones go after the TTL."""
    import grpc

    rng = np.random.default_rng(11)
    w0 = (rng.standard_normal((VOCAB, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    server = server_factory_module(w0, ["--max-pending-grads=2", "--pending-grad-ttl-seconds=1"])
    c = lce_client.Client(server.target, timeout=60)
    h, y = _rows(10)
    ids = [c.forward_backward(h, y, accumulate_weight_grad=True, defer_weight_grad=True).pending_grads[0]
           for _ in range(5)]
    assert not np.any(c.get_grad())
    with pytest.raises(lce_client.LceError) as e:
        c.commit_grad(ids[0])
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "evicted" in str(e.value)
    import time

    time.sleep(1.2)
    c.forward_backward(h, y, accumulate_weight_grad=True, defer_weight_grad=True)
    with pytest.raises(lce_client.LceError) as e:
        c.commit_grad(ids[-1])
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "expired" in str(e.value)
    assert not np.any(c.get_grad())


@requires_torch
def test_losses_on_logprobs_and_entropy_train_the_head(srv):
    """remote_logprobs(accumulate_weight_grad=True): any loss written in torch on the logprobs and
    entropy (here a policy-gradient term and an entropy bonus, scaled) gives the head autograd's dW,
    from the Backward RPC of its upstream gradients; nothing under no_grad."""
    import torch
    from lce_client.torch import remote_logprobs

    server, w0 = srv
    c = lce_client.Client(server.target, timeout=60)
    c.zero_grad()
    W = _local(w0)
    h, y = _rows(12)
    adv = torch.linspace(-1, 1, ROWS)
    lp, ent = remote_logprobs(torch.tensor(h, requires_grad=True), torch.tensor(y), c, accumulate_weight_grad=True,
                              temperature=0.8)
    (-(adv * lp).sum() * 0.5 - 0.1 * ent.mean()).backward()
    z = torch.tensor(h, dtype=torch.float64) @ W.T / 0.8
    valid = torch.tensor(y) != -100
    ref_lp = torch.where(valid, torch.log_softmax(z, -1).gather(1, torch.tensor(np.where(y < 0, 0, y))[:, None])[:, 0],
                         torch.zeros((), dtype=torch.float64))
    ref_ent = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    (-(adv.double() * ref_lp).sum() * 0.5 - 0.1 * ref_ent.mean()).backward()
    _check(c, W)
    with torch.no_grad():
        remote_logprobs(torch.tensor(h), torch.tensor(y), c, accumulate_weight_grad=True)
    assert not np.any(c.get_grad())


def test_an_accumulating_request_waiting_on_its_client_blocks_no_training_call(srv):
    """Issue 35, item 11: an accumulating ForwardBackward fills its own pending buffer and holds no
    lock on the head's training state while it waits for its client's next chunk: ZeroGrad, GetGrad and
    CommitGrad of another contribution answer at once meanwhile; the stalled request then finishes."""
    import threading
    import time

    from lce_client._proto import lce_pb2 as pb, lce_pb2_grpc as pb_grpc

    server, _ = srv
    c = lce_client.Client(server.target, timeout=60)
    h, y = _rows(13)
    go_on = threading.Event()

    def requests():
        yield pb.StreamRequest(header=pb.RequestHeader(hidden_size=HIDDEN, dtype=pb.DTYPE_FLOAT32,
                                                       reduction=pb.REDUCTION_SUM, accumulate_weight_grad=True))
        yield pb.StreamRequest(chunk=pb.RowChunk(hidden=h[:8].tobytes(), targets=y[:8].tolist()))
        go_on.wait(30)
        yield pb.StreamRequest(chunk=pb.RowChunk(hidden=h[8:].tobytes(), targets=y[8:].tolist()))

    stub = pb_grpc.LceServiceStub(c._channel)
    answers = []
    t = threading.Thread(target=lambda: answers.extend(stub.ForwardBackward(requests(), timeout=60)))
    t.start()
    try:
        time.sleep(0.5)  # the first chunk computed; the request waits for the second
        other = c.forward_backward(h, y, accumulate_weight_grad=True, defer_weight_grad=True)
        t0 = time.monotonic()
        c.zero_grad()
        c.get_grad()
        c.commit_grad(other.pending_grads)
        assert time.monotonic() - t0 < 5, "training calls waited for the stalled request"
    finally:
        go_on.set()
        t.join(60)
    assert answers and answers[-1].HasField("summary"), "the stalled request finished"


@requires_torch
def test_serve_linear_trains_an_existing_head_like_autograd(srv):
    """serve_linear(nn.Linear): one line puts the layer's exact weight on the server and gives the loss
    module over it; a training step's dW is the local layer's autograd gradient."""
    import torch
    from lce_client.torch import serve_linear

    server, _ = srv
    c = lce_client.Client(server.target, timeout=60)
    torch.manual_seed(3)
    layer = torch.nn.Linear(HIDDEN, 53, bias=False)
    module = serve_linear(layer, c, head="from-linear", train=True)
    h, y = _rows(14)
    y = np.where(y >= 0, y % 53, y)
    (module(torch.tensor(h, requires_grad=True), torch.tensor(y)) * 0.3).backward()
    ref = torch.nn.functional.cross_entropy(torch.tensor(h) @ layer.weight.T, torch.tensor(y)) * 0.3
    ref.backward()
    assert_close(c.get_grad(head="from-linear"), layer.weight.grad.numpy(), rtol=1e-5, atol=1e-9, what="dW")


@requires_torch
def test_serve_linear_with_a_bias_trains_it_like_torch(srv):
    """A biased nn.Linear served as it is (its bias on the server, fp32): the loss is the local layer's,
    dW and dB are autograd's for a scaled loss, and an AdamW step moves both as torch.optim.AdamW does;
    a loss under no_grad adds nothing to either."""
    import torch
    from lce_client.torch import serve_linear

    server, _ = srv
    c = lce_client.Client(server.target, timeout=60)
    torch.manual_seed(5)
    layer = torch.nn.Linear(HIDDEN, 53, bias=True).double()
    with torch.no_grad():
        layer.bias.mul_(4.0)  # a bias large enough to matter
    module = serve_linear(layer.float(), c, head="biased", train=True)
    layer = layer.double()
    h, y = _rows(15)
    y = np.where(y >= 0, y % 53, y)
    with torch.no_grad():
        module(torch.tensor(h), torch.tensor(y))
    assert not c.get_grad(head="biased", bias=True).any(), "a no_grad forward added to dB"
    loss = module(torch.tensor(h, requires_grad=True), torch.tensor(y)) * 0.7
    ref = torch.nn.functional.cross_entropy(layer(torch.tensor(h, dtype=torch.float64)), torch.tensor(y)) * 0.7
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    loss.backward()
    ref.backward()
    assert_close(c.get_grad(head="biased"), layer.weight.grad.numpy(), rtol=1e-5, atol=1e-9, what="dW")
    assert_close(c.get_grad(head="biased", bias=True), layer.bias.grad.numpy(), rtol=1e-5, atol=1e-9, what="dB")
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.0)
    opt.step()
    c.optimizer_step(head="biased", lr=1e-2)
    with torch.no_grad():
        after = module(torch.tensor(h), torch.tensor(y))
        want = torch.nn.functional.cross_entropy(layer(torch.tensor(h, dtype=torch.float64)), torch.tensor(y))
    assert float(after) == pytest.approx(float(want), rel=1e-5), "the step moved the bias as AdamW does"
    # A head without a bias takes none, and has no dB to read.
    c.load_head("plain", seeded=(53, HIDDEN, 1, "fp32"))
    with pytest.raises(lce_client.LceError, match="no bias"):
        c.update_weights(np.zeros((53, HIDDEN), np.float32), head="plain", bias=np.zeros(53, np.float32))
    with pytest.raises(lce_client.LceError, match="no bias"):
        c.get_grad(head="plain", bias=True)
    with pytest.raises(lce_client.LceError, match="53 rows"):
        c.update_weights(np.zeros((53, HIDDEN), np.float32), head="biased", bias=np.zeros(52, np.float32))
