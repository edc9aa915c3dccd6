"""The per-row outputs users of Liger-Kernel and rollout workers ask for, computed in the loss's own pass
(no logits), against float64 PyTorch on fresh random inputs (CPU server):
- rankings: argmax (Liger's return_predicted_tokens), token accuracy (return_token_accuracy) and the
  top-k tokens with their logprobs (k <= 64), Score and ForwardBackward;
- class weights: PyTorch's CrossEntropyLoss(weight=...) — loss, d_hidden and the head's dW — with label
  smoothing and z-loss (Liger's ce_weight: src/liger_kernel/ops/cross_entropy.py, linkedin/Liger-Kernel
  at ead96b61), reductions mean / sum / none;
- the z-loss as its own output (Liger's return_z_loss);
and the bad inputs around them get INVALID_ARGUMENT naming the problem."""
import re

import grpc
import numpy as np
import pytest

import lce_client
from conftest import HIDDEN, write_safetensors
from lce_client._proto import lce_pb2 as pb
from lce_client._proto import lce_pb2_grpc as pb_grpc

torch = pytest.importorskip("torch")

VOCAB = 300
ROWS = 40


@pytest.fixture(scope="module")
def served(workdir):
    from conftest import Server

    rng = np.random.default_rng(11)
    w = (rng.standard_normal((VOCAB, HIDDEN)) * 2.5 / np.sqrt(HIDDEN)).astype(np.float32)
    path = workdir / "row_outputs.safetensors"
    write_safetensors(path, {"lm_head.weight": (w, "F32")})
    srv = Server([f"--head-file={path}", "--head-tensor=lm_head.weight"], workdir, "row_outputs")
    try:
        with lce_client.Client(srv.target, timeout=60) as c:
            yield c, w
    finally:
        srv.stop()


def rows(seed, n=ROWS):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n, HIDDEN)).astype(np.float32)
    y = rng.integers(0, VOCAB, n)
    y[::6] = -100
    return h, y


def logits64(w, h, temperature=1.0, softcap=0.0):
    a = torch.tensor(h, dtype=torch.float64) @ torch.tensor(w, dtype=torch.float64).T
    return (softcap * torch.tanh(a / softcap) if softcap else a) / temperature


def check_rankings(tokens, logprobs, z64, k):
    """The j-th logprob is the j-th largest of float64's, and the token named has it (near-equal logits
    may swap places between fp32 and float64, so tokens are checked through their values)."""
    lp64 = torch.log_softmax(z64, dim=-1)
    want = torch.topk(lp64, k, dim=-1).values.numpy()
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    assert tokens.shape == logprobs.shape == (z64.shape[0], k)
    np.testing.assert_allclose(logprobs, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.take_along_axis(lp64.numpy(), tokens.astype(np.int64), 1), want, rtol=1e-5, atol=1e-5)
    for r in tokens:
        assert len(set(r.tolist())) == k


@pytest.mark.parametrize("k", [1, 20, 64])
def test_score_top_k_and_argmax(served, k):
    c, w = served
    h, y = rows(k)
    res = c.score(h, y, temperature=0.7, softcap=20.0, top_k=k)
    z64 = logits64(w, h, 0.7, 20.0)
    check_rankings(res.top_tokens, res.top_logprobs, z64, k)
    np.testing.assert_array_equal(res.argmax, np.asarray(res.top_tokens)[:, 0])
    lp, ent = res  # unpacks as score's plain answer
    lp64 = torch.log_softmax(z64, -1)
    valid = y != -100
    want = np.where(valid, lp64.numpy()[np.arange(ROWS), np.where(valid, y, 0)], 0.0)
    np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-5)
    assert ent is not None


def test_argmax_token_accuracy_and_no_targets(served):
    c, w = served
    h, y = rows(5)
    z64 = logits64(w, h)
    best = torch.argmax(z64, -1).numpy()
    y[:10] = best[:10]  # some rows right for sure
    res = c.score(h, y, entropy=False, argmax=True)
    np.testing.assert_array_equal(res.argmax, best)
    valid = y != -100
    assert lce_client.token_accuracy(res.argmax, y) == pytest.approx(np.mean(best[valid] == y[valid]))
    # Rankings alone: no targets, every row ignored (logprob 0), shaped like the caller's rows.
    alone = c.score(h.reshape(4, ROWS // 4, HIDDEN), None, top_k=3)
    assert np.asarray(alone.top_tokens).shape == (4, ROWS // 4, 3)
    np.testing.assert_array_equal(np.asarray(alone.argmax).reshape(-1), best)
    assert not np.asarray(alone.logprobs).any()


def weighted_ce64(w, h, y, cw, reduction, label_smoothing=0.0, z_loss=0.0):
    """PyTorch's cross_entropy(weight=cw) in float64 plus the z-loss, unweighted and for a mean divided by
    the valid rows' count (Liger-Kernel's liger_cross_entropy_kernel, src/liger_kernel/ops/cross_entropy.py
    at ead96b61: `loss / sum_non_ignore_weight`, `z_loss / n_non_ignore`), with the hidden states a leaf
    for autograd."""
    h64 = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    W = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    z = h64 @ W.T
    yt = torch.as_tensor(y)
    ce = torch.nn.functional.cross_entropy(z, yt, weight=torch.tensor(cw, dtype=torch.float64), ignore_index=-100,
                                           reduction="none", label_smoothing=label_smoothing)
    valid = yt != -100
    zl = torch.where(valid, z_loss * torch.logsumexp(z, -1) ** 2, torch.zeros(()))
    per_row = ce + zl
    if reduction == "mean":
        total = ce.sum() / torch.tensor(cw, dtype=torch.float64)[yt[valid]].sum() + zl.sum() / valid.sum()
    else:
        total = per_row.sum()
    return h64, W, per_row, zl, total


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing, z_loss", [(0.0, 0.0), (0.1, 1e-2)])
def test_class_weights_match_pytorch(served, reduction, label_smoothing, z_loss):
    c, w = served
    h, y = rows(17)
    rng = np.random.default_rng(4)
    # Weights well below 1 (their sum ~ N_valid / 4): a z-loss divided by the weights' sum instead of by
    # N_valid is then ~4x off.
    cw = rng.uniform(0.0, 0.5, VOCAB).astype(np.float32)
    cw[::13] = 0.0
    g = rng.standard_normal(ROWS).astype(np.float32) if reduction == "none" else None
    c.zero_grad()
    r = c.forward_backward(h, y, reduction=reduction, class_weights=cw, label_smoothing=label_smoothing,
                           z_loss=z_loss, grad_loss=g, return_z_loss=True, accumulate_weight_grad=True)
    h64, W, per_row, zl, total = weighted_ce64(w, h, y, cw.astype(np.float64), reduction, label_smoothing, z_loss)
    obj = (per_row * torch.tensor(g, dtype=torch.float64)).sum() if g is not None else total
    obj.backward()
    np.testing.assert_allclose(r.per_token_loss, per_row.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r.z_loss, zl.detach().numpy(), rtol=1e-5, atol=1e-7)
    if reduction != "none":
        assert r.loss == pytest.approx(float(total.detach()), rel=1e-5)
    scale = float(h64.grad.abs().max())
    np.testing.assert_allclose(r.d_hidden, h64.grad.numpy(), rtol=0, atol=2e-5 * scale)
    dw = c.get_grad()
    np.testing.assert_allclose(dw, W.grad.numpy(), rtol=0, atol=2e-5 * float(W.grad.abs().max()))


@pytest.mark.parametrize("zero_weights", [False, True])
def test_weighted_mean_same_on_both_paths(served, zero_weights):
    """Client.forward_backward(class_weights=, reduction="mean") and the torch op's ce_weight (Liger's
    option) share one convention (lce_client._weighted_mean): the same loss, z-loss and d_hidden, equal
    to float64's. Where the valid targets' weights sum to 0 (PyTorch: nan) both divide by N_valid."""
    from lce_client.torch import remote_linear_cross_entropy

    c, w = served
    h, y = rows(29)
    cw = np.random.default_rng(6).uniform(0.0, 0.5, VOCAB).astype(np.float32)
    if zero_weights:
        cw[y[y != -100]] = 0.0
    r = c.forward_backward(h, y, class_weights=cw, z_loss=1e-2, label_smoothing=0.1, return_z_loss=True)
    ht = torch.tensor(h, requires_grad=True)
    out = remote_linear_cross_entropy(ht, torch.as_tensor(y), c, ce_weight=torch.tensor(cw), z_loss=1e-2,
                                      label_smoothing=0.1, return_z_loss=True)
    out.loss.backward()
    h64, _, per_row, zl, total = weighted_ce64(w, h, y, cw.astype(np.float64), "mean", 0.1, 1e-2)
    valid = torch.as_tensor(y != -100)
    if zero_weights:  # the cross-entropy part over N_valid too
        total = (per_row - zl).sum() / valid.sum() + zl.sum() / valid.sum()
    total.backward()
    total = float(total.detach())
    assert r.loss == pytest.approx(total, rel=1e-5)
    assert float(out.loss.detach()) == pytest.approx(total, rel=1e-5)
    assert float(out.z_loss) == pytest.approx(float(zl.detach().sum() / valid.sum()), rel=1e-5)
    np.testing.assert_allclose(r.z_loss, zl.detach().numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(r.per_token_loss, per_row.detach().numpy(), rtol=1e-5, atol=1e-6)
    scale = float(h64.grad.abs().max())
    np.testing.assert_allclose(r.d_hidden, h64.grad.numpy(), rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(ht.grad.numpy(), h64.grad.numpy(), rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cli_class_weights_and_z_loss_match_pytorch(served, tmp_path, reduction):
    """lce_cli forward-backward --class-weights-file (a 1-D .npy) --z-loss: the loss, its z-loss part and
    the rows' losses and z-losses it prints, and the dW it adds, against float64 PyTorch; a mean by the
    same convention as the Python client's (the cross-entropy over the weights' sum, the z-loss over
    the valid count)."""
    from helpers import cli

    c, w = served
    h, y = rows(31)
    cw = np.random.default_rng(7).uniform(0.0, 0.5, VOCAB).astype(np.float32)
    h.tofile(tmp_path / "h.raw")
    y.astype(np.int32).tofile(tmp_path / "y.raw")
    np.save(tmp_path / "cw.npy", cw)
    c.zero_grad()
    out = cli("forward-backward", f"--target={c.target}", f"--hidden-file={tmp_path / 'h.raw'}",
              f"--targets-file={tmp_path / 'y.raw'}", f"--reduction={reduction}",
              f"--class-weights-file={tmp_path / 'cw.npy'}", "--z-loss=0.01", "--label-smoothing=0.1",
              "--accumulate-weight-grad=1", f"--show={ROWS}")
    h64, W, per_row, zl, total = weighted_ce64(w, h, y, cw.astype(np.float64), reduction, 0.1, 1e-2)
    total.backward()
    n = int(np.count_nonzero(y != -100))
    z_want = float(zl.detach().sum()) / (n if reduction == "mean" else 1)
    assert float(re.search(r"z-loss part \(\w+\) (\S+)", out).group(1)) == pytest.approx(z_want, rel=5e-6), out
    if reduction != "none":
        got = float(re.search(r"loss \(\w+\) (\S+)", out).group(1))
        assert got == pytest.approx(float(total.detach()), rel=5e-6), out
    if reduction == "mean":
        d = float(re.search(r"sum of the targets' weights (\S+)", out).group(1))
        assert d == pytest.approx(float(cw[y[y != -100]].astype(np.float64).sum()), rel=1e-6)
    table = np.array([line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+-?\d+\s+\S+\s+\S+$", line)],
                     dtype=np.float64)
    np.testing.assert_array_equal(table[:, 1], y)
    np.testing.assert_allclose(table[:, 2], per_row.detach().numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(table[:, 3], zl.detach().numpy(), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(c.get_grad(), W.grad.numpy(), rtol=0, atol=2e-5 * float(W.grad.abs().max()))


def test_forward_backward_rankings_and_z_loss(served):
    c, w = served
    h, y = rows(23)
    r = c.forward_backward(h, y, reduction="sum", z_loss=1e-2, return_z_loss=True, top_k=5)
    z64 = logits64(w, h)
    check_rankings(r.top_tokens, r.top_logprobs, z64, 5)
    np.testing.assert_array_equal(r.argmax, torch.argmax(z64, -1).numpy())
    lse = torch.logsumexp(z64, -1).numpy()
    np.testing.assert_allclose(r.z_loss, np.where(y != -100, 1e-2 * lse ** 2, 0.0), rtol=1e-5)


def raw_call(client, method, header, h, y, grad_loss=None):
    """One Call with a hand-made header (what a client library would never send)."""
    chunk = pb.RowChunk(hidden=h.tobytes(), targets=[int(t) for t in y])
    if grad_loss is not None:
        chunk.grad_loss.extend(grad_loss)
    stub = pb_grpc.LceServiceStub(grpc.insecure_channel(client.target))
    return stub.Call(pb.CallRequest(method=method, header=header, chunk=chunk), timeout=30)


@pytest.mark.parametrize("change, message", [
    (lambda hd: hd.outputs.append(pb.OUTPUT_TOP_K), "top_k"),                      # OUTPUT_TOP_K without top_k
    (lambda hd: setattr(hd, "top_k", 3), "top_k"),                                  # top_k without OUTPUT_TOP_K
    (lambda hd: (hd.outputs.append(pb.OUTPUT_TOP_K), setattr(hd, "top_k", 65)), "top_k must be in [1, 64]"),
    (lambda hd: hd.class_weights.extend([1.0] * 5), "class_weights"),               # Score takes none
])
def test_bad_score_headers(served, change, message):
    c, _ = served
    h, y = rows(1, 4)
    hdr = pb.RequestHeader(hidden_size=HIDDEN, dtype=pb.DTYPE_FLOAT32, outputs=[pb.OUTPUT_LOGPROBS])
    change(hdr)
    with pytest.raises(grpc.RpcError) as e:
        raw_call(c, pb.CALL_SCORE, hdr, h, y)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


@pytest.mark.parametrize("weights, reduction, message", [
    ([1.0] * (VOCAB - 1), pb.REDUCTION_SUM, f"class_weights has {VOCAB - 1} values"),
    ([1.0] * (VOCAB - 1) + [float("inf")], pb.REDUCTION_SUM, f"class_weights[{VOCAB - 1}] is inf"),
    ([1.0] * (VOCAB - 1) + [float("nan")], pb.REDUCTION_SUM, "must be finite"),
    ([1.0] * VOCAB, pb.REDUCTION_MEAN, "REDUCTION_SUM and divide"),
])
def test_bad_class_weights(served, weights, reduction, message):
    c, _ = served
    h, y = rows(2, 4)
    hdr = pb.RequestHeader(hidden_size=HIDDEN, dtype=pb.DTYPE_FLOAT32, reduction=reduction, class_weights=weights)
    if reduction == pb.REDUCTION_MEAN:
        hdr.num_valid_tokens = int(np.count_nonzero(y != -100))
    with pytest.raises(grpc.RpcError) as e:
        raw_call(c, pb.CALL_FORWARD_BACKWARD, hdr, h, y)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()
    # and the server goes on serving
    assert len(c.score(h, y)[0]) == 4


def test_client_checks_top_k(served):
    c, _ = served
    h, y = rows(3, 4)
    with pytest.raises(ValueError, match="top_k"):
        c.score(h, y, top_k=65)
