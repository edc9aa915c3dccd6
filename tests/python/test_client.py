"""lce_client.Client against the real lce_server (CPU engine), checked against a float64 torch reference
computed from materialised logits (values, and gradients by autograd)."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

import lce_client
import lce_client.local
from conftest import (GRAD_RTOL, HIDDEN, VOCAB, as_f64, assert_close, grad_of, reference, requires_torch)

OPTION_SETS = {
    "plain": dict(),
    "temperature": dict(temperature=0.7),
    "softcap+temperature": dict(temperature=1.3, softcap=5.0),
}


def targets_for(rows, seed=0, ignore=(2, 5), ignore_index=-100):
    y = np.random.default_rng(seed).integers(0, VOCAB, rows).astype(np.int64)
    for i in ignore:
        if i < rows:
            y[i] = ignore_index
    return y


def ref_opts(opts):
    return dict(temperature=opts.get("temperature", 1.0), softcap=opts.get("softcap") or 0.0,
                label_smoothing=opts.get("label_smoothing", 0.0), z_loss=opts.get("z_loss", 0.0))


def test_info(heads):
    for dt, head in heads.items():
        with head.client() as c:
            info = c.info()
        assert info.head.vocab_size == VOCAB and info.head.hidden_size == HIDDEN
        assert info.head.dtype == dt and info.head.version >= 1
        assert info.backend == "cpu" and info.tp_size == 1
        assert info.max_message_bytes > 0 and info.server_version
        assert [h.name for h in info.heads] == [info.head.name]
        every_output = ["logprob", "entropy", "lse", "loss", "d_hidden", "d_weight", "argmax", "top_tokens",
                        "top_logprobs"]
        assert info.invariant_across_batches == every_output  # the CPU engine's guarantees
        assert info.invariant_across_tp_sizes == every_output


@requires_torch
@pytest.mark.parametrize("opts", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
def test_score_matches_reference(head, opts):
    rows = 37
    h, h64 = head.hidden(rows, seed=1)
    y = targets_for(rows, seed=2)
    with head.client(chunk_bytes=700) as c:  # several chunks
        lp, ent = c.score(h, y, **opts)
    ref = reference(head.w64, h64, y, **ref_opts(opts))
    assert isinstance(lp, np.ndarray) and lp.dtype == np.float32 and lp.shape == (rows,)
    assert ent.dtype == np.float32 and ent.shape == (rows,)
    assert_close(lp, ref["logprobs"].detach(), rtol=2e-6, atol=2e-5, what="logprobs")
    assert_close(ent, ref["entropy"].detach(), rtol=2e-6, atol=2e-5, what="entropy")
    assert lp[2] == 0 and lp[5] == 0 and ent[2] > 0  # ignored rows: logprob 0, entropy still computed


def test_score_without_entropy(heads):
    head = heads["fp32"]
    h, _ = head.hidden(9, seed=3)
    with head.client() as c:
        lp, ent = c.score(h, targets_for(9), entropy=False)
    assert ent is None and lp.shape == (9,)


@requires_torch
def test_custom_ignore_index(heads):
    head = heads["fp32"]
    rows = 12
    h, h64 = head.hidden(rows, seed=4)
    y = targets_for(rows, seed=5, ignore=(0, 7), ignore_index=-1)
    with head.client() as c:
        lp, _ = c.score(h, y, ignore_index=-1)
        r = c.forward_backward(h, y, ignore_index=-1)
        with pytest.raises(lce_client.LceError) as ei:  # -100 is now an out-of-range target
            c.score(h, np.where(y == -1, -100, y), ignore_index=-1)
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    ref = reference(head.w64, h64, y, ignore_index=-1)
    assert_close(lp, ref["logprobs"].detach(), rtol=2e-6, atol=2e-5, what="logprobs")
    assert r.valid_tokens == rows - 2
    assert_close(r.loss, (ref["loss"].sum() / (rows - 2)).detach(), rtol=1e-6, atol=1e-5, what="loss")


FB_OPTIONS = {
    "plain": dict(),
    "smoothing+zloss": dict(label_smoothing=0.1, z_loss=1e-3),
    "softcap+temperature": dict(temperature=0.8, softcap=4.0),
}


@requires_torch
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", list(FB_OPTIONS.values()), ids=list(FB_OPTIONS))
def test_forward_backward_matches_reference(head, reduction, opts):
    rows = 29
    h, h64 = head.hidden(rows, seed=6)
    y = targets_for(rows, seed=7, ignore=(0, 11, 28))
    g = None
    if reduction == "none":
        g = np.random.default_rng(8).standard_normal(rows).astype(np.float32)
    with head.client(chunk_bytes=600) as c:
        r = c.forward_backward(h, y, reduction=reduction, grad_loss=g, **opts)
    ref = reference(head.w64, h64, y, **ref_opts(opts))
    n_valid = rows - 3
    assert r.rows == rows and r.valid_tokens == n_valid and r.head_version >= 1
    assert r.per_token_loss.dtype == np.float32 and r.per_token_loss.shape == (rows,)
    assert_close(r.per_token_loss, ref["loss"].detach(), rtol=2e-6, atol=3e-5, what="per_token_loss")
    assert r.per_token_loss[0] == 0 and r.per_token_loss[28] == 0
    if reduction == "mean":
        reduced = ref["loss"].sum() / n_valid
        objective = reduced
    else:
        reduced = ref["loss"].sum()
        objective = reduced if g is None else (ref["loss"] * __import__("torch").tensor(g, dtype=reduced.dtype)).sum()
    assert isinstance(r.loss, float)
    assert_close(r.loss, reduced.detach(), rtol=2e-6, atol=2e-5, what="loss")
    want = grad_of(objective, ref["h"])
    got = as_f64(r.d_hidden, head.dtype)
    assert got.shape == (rows, HIDDEN)
    assert_close(got, want, rtol=GRAD_RTOL[head.dtype], atol=1e-7, what="d_hidden")
    assert np.all(got[0] == 0) and np.all(got[28] == 0)  # ignored rows add no loss gradient


@requires_torch
@pytest.mark.parametrize("opts", list(OPTION_SETS.values()), ids=list(OPTION_SETS))
def test_backward_matches_reference(head, opts):
    rows = 23
    h, h64 = head.hidden(rows, seed=9)
    y = targets_for(rows, seed=10, ignore=(4,))
    rng = np.random.default_rng(11)
    u = rng.standard_normal(rows).astype(np.float32)
    e = rng.standard_normal(rows).astype(np.float32)
    import torch

    ref = reference(head.w64, h64, y, **ref_opts(opts))
    with head.client(chunk_bytes=500) as c:
        d_both = c.backward(h, y, u, e, **opts)
        d_lp = c.backward(h, y, grad_logprob=u, **opts)
        d_ent = c.backward(h, y, grad_entropy=e, **opts)
    tu, te = torch.tensor(u, dtype=torch.float64), torch.tensor(e, dtype=torch.float64)
    for got, obj, what in ((d_both, (tu * ref["logprobs"] + te * ref["entropy"]).sum(), "both"),
                           (d_lp, (tu * ref["logprobs"]).sum(), "logprob only"),
                           (d_ent, (te * ref["entropy"]).sum(), "entropy only")):
        assert_close(as_f64(got, head.dtype), grad_of(obj, ref["h"]), rtol=GRAD_RTOL[head.dtype], atol=1e-7,
                     what=f"d_hidden ({what})")


@requires_torch
def test_torch_inputs_come_back_as_torch(heads):
    """[B, T, H] torch tensors of each dtype: outputs are torch tensors shaped [B, T] (fp32) and
    d_hidden [B, T, H] in the input's dtype."""
    import torch

    for dt, head in heads.items():
        st, h64 = head.hidden(2 * 7, seed=12, shape=(2, 7))
        tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dt]
        ht = torch.from_numpy(st.view(np.int16)).view(torch.bfloat16) if dt == "bf16" else torch.from_numpy(st)
        assert ht.dtype == tdt and ht.shape == (2, 7, HIDDEN)
        y = torch.from_numpy(targets_for(14, seed=13).reshape(2, 7))
        with head.client() as c:
            lp, ent = c.score(ht, y)
            r = c.forward_backward(ht, y, reduction="sum")
            d = c.backward(ht, y, torch.ones(2, 7), None)
        ref = reference(head.w64, h64, y.numpy())
        assert isinstance(lp, torch.Tensor) and lp.dtype == torch.float32 and lp.shape == (2, 7)
        assert ent.shape == (2, 7)
        assert_close(lp.reshape(-1), ref["logprobs"].detach(), rtol=2e-6, atol=2e-5, what=f"{dt} logprobs")
        assert isinstance(r.d_hidden, torch.Tensor) and r.d_hidden.dtype == tdt and r.d_hidden.shape == (2, 7, HIDDEN)
        assert r.per_token_loss.shape == (2, 7)
        assert_close(as_f64(r.d_hidden).reshape(-1, HIDDEN), grad_of(ref["loss"].sum(), ref["h"]),
                     rtol=GRAD_RTOL[dt], atol=1e-7, what=f"{dt} d_hidden")
        assert d.dtype == tdt and d.shape == (2, 7, HIDDEN)
        assert_close(as_f64(d).reshape(-1, HIDDEN), grad_of(ref["logprobs"].sum(), ref["h"]),
                     rtol=GRAD_RTOL[dt], atol=1e-7, what=f"{dt} backward")


def test_numpy_bf16_as_uint16_with_dtype(heads):
    head = heads["bf16"]
    st, _ = head.hidden(5, seed=14)
    y = targets_for(5)
    with head.client() as c:
        a, _ = c.score(st, y)
        b, _ = c.score(st.view(np.int16), y, dtype="bf16")
        with pytest.raises(TypeError):
            c.score(st.astype(np.float64), y)
    np.testing.assert_array_equal(a, b)


def test_chunking_invariance(heads):
    """Different chunk sizes (1 row, 5 rows + a few bytes, everything in one chunk) give the same answers,
    including the mean over the whole request and the progress callback's count."""
    head = heads["fp32"]
    rows = 50
    h, _ = head.hidden(rows, seed=15)
    y = targets_for(rows, seed=16, ignore=(0, 13, 49))
    u = np.random.default_rng(17).standard_normal(rows).astype(np.float32)
    row_bytes = HIDDEN * 4
    results = []
    for cb in (row_bytes, 5 * row_bytes + 7, 1 << 22):
        calls = []
        with head.client(chunk_bytes=cb) as c:
            lp, ent = c.score(h, y, temperature=0.9, progress=lambda done, total: calls.append((done, total)))
            r = c.forward_backward(h, y, reduction="mean", label_smoothing=0.05)
            d = c.backward(h, y, u, u)
        n_chunks = -(-rows // max(1, cb // row_bytes))
        assert len(calls) == n_chunks and calls[-1] == (rows, rows)
        assert all(a[0] < b[0] for a, b in zip(calls, calls[1:]))
        results.append((lp, ent, r.loss, r.per_token_loss, r.d_hidden, d))
    base = results[0]
    for other in results[1:]:
        for a, b in zip(base, other):
            # not bitwise: OpenBLAS blocks differently for different row counts; fp32 rounding only
            assert_close(b, a, rtol=2e-5, atol=1e-6, what="chunked vs unchunked")


class _NoCall(grpc.RpcError):
    """What an older server, without LceService.Call, answers it."""

    def code(self):
        return grpc.StatusCode.UNIMPLEMENTED

    def details(self):
        return "Method not found!"


def test_small_requests_go_as_one_call_with_the_streams_bits(heads):
    """A request of one chunk goes as one Call (one message each way); its answers are the stream's,
    bit for bit; against a server without Call the client streams, and goes on streaming."""
    head = heads["fp32"]
    rows = 20
    h, _ = head.hidden(rows, seed=80)
    y = targets_for(rows, seed=81)
    u = np.random.default_rng(82).standard_normal(rows).astype(np.float32)

    def all_four(c):
        r = c.forward_backward(h, y, reduction="mean")
        return (*c.score(h, y), r.loss, r.per_token_loss, r.d_hidden, c.backward(h, y, u, u))

    with head.client() as c:
        stub = c._replicas[0].stub
        real, calls = stub.Call, []
        stub.Call = lambda *a, **k: calls.append(1) or real(*a, **k)
        called = all_four(c)
        assert len(calls) == 3
        c._streams_only.add(id(stub))  # as against an older server
        streamed = all_four(c)
        assert len(calls) == 3
    for a, b in zip(called, streamed):
        assert np.array_equal(np.asarray(a), np.asarray(b)), "Call and stream differ"

    with head.client() as c:
        stub = c._replicas[0].stub

        def refuse(*a, **k):
            raise _NoCall()

        stub.Call = refuse
        lp, ent = c.score(h, y)
        assert np.array_equal(lp, called[0]) and np.array_equal(ent, called[1])
        assert id(stub) in c._streams_only


def test_tqdm_progress(heads, capsys):
    pytest.importorskip("tqdm")
    head = heads["fp32"]
    h, _ = head.hidden(20, seed=18)
    with head.client(chunk_bytes=HIDDEN * 4 * 3) as c:
        lp, _ = c.score(h, targets_for(20), tqdm=True)
    assert lp.shape == (20,)
    assert "20/20" in capsys.readouterr().err


@requires_torch
def test_mean_all_ignored_is_zero(heads):
    head = heads["fp32"]
    h, _ = head.hidden(6, seed=19)
    y = np.full(6, -100)
    with head.client() as c:
        r = c.forward_backward(h, y, reduction="mean")
    assert r.loss == 0.0 and r.valid_tokens == 0
    assert np.all(r.d_hidden == 0) and np.all(r.per_token_loss == 0)


@requires_torch
def test_weight_grad_accumulates_on_server(heads, server_factory, workdir):
    """accumulate_weight_grad + GetGrad: dW of the reduced loss, against autograd w.r.t. W."""
    import torch

    from conftest import make_weight, write_safetensors

    w = make_weight("fp32", seed=7)
    path = workdir / "train_head.safetensors"
    write_safetensors(path, {"lm_head.weight": (w, "F32")})
    srv = server_factory([f"--head-file={path}"], name="train")
    rows = 21
    rng = np.random.default_rng(20)
    h = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
    y = targets_for(rows, seed=21)
    with lce_client.Client(srv.target, timeout=60, chunk_bytes=1000) as c:
        c.zero_grad()
        c.forward_backward(h, y, reduction="mean", accumulate_weight_grad=True)
        c.forward_backward(h, y, reduction="sum", accumulate_weight_grad=True)
        dW = c.get_grad()
    W = torch.tensor(w.astype(np.float64), requires_grad=True)
    ht = torch.tensor(h.astype(np.float64))
    ce = torch.nn.functional.cross_entropy(ht @ W.T, torch.tensor(y), reduction="sum", ignore_index=-100)
    n_valid = int((y != -100).sum())
    (ce / n_valid + ce).backward()
    assert dW.shape == (VOCAB, HIDDEN) and dW.dtype == np.float32
    assert_close(dW, W.grad.numpy(), rtol=1e-5, atol=1e-7, what="dW")


# --------------------------------------------------------------------------------------- errors
def test_errors_arrive_as_lce_error_with_code_and_message(heads):
    head = heads["fp32"]
    h, _ = head.hidden(10, seed=22)
    y = targets_for(10)
    with head.client() as c:
        cases = [
            (lambda: c.score(h[:, :HIDDEN - 1].copy(), y), grpc.StatusCode.INVALID_ARGUMENT, "hidden"),
            (lambda: c.score(h.astype(np.float16), y), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
            (lambda: c.score(h, np.where(np.arange(10) == 6, VOCAB, y)), grpc.StatusCode.INVALID_ARGUMENT, "6"),
            (lambda: c.score(h, y, temperature=0.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
            (lambda: c.score(h, y, head="no-such-head"), grpc.StatusCode.NOT_FOUND, "no-such-head"),
            (lambda: c.score(h, y, head_version=999), grpc.StatusCode.FAILED_PRECONDITION, "version"),
            (lambda: c.forward_backward(np.where(np.arange(10)[:, None] == 3, np.nan, h).astype(np.float32), y),
             grpc.StatusCode.INVALID_ARGUMENT, "3"),
            (lambda: c.forward_backward(h, y, label_smoothing=1.5), grpc.StatusCode.INVALID_ARGUMENT, "smoothing"),
        ]
        for fn, code, needle in cases:
            with pytest.raises(lce_client.LceError) as ei:
                fn()
            e = ei.value
            assert e.code == code, f"{e!r}"
            assert isinstance(e.details, str) and needle.lower() in e.details.lower(), e.details
            assert code.name in str(e)
            assert isinstance(e.__cause__, grpc.RpcError)
        # the server goes on serving after errors
        lp, _ = c.score(h, y)
        assert lp.shape == (10,)


def test_error_in_a_later_chunk_names_the_row(heads):
    head = heads["fp32"]
    rows = 40
    h, _ = head.hidden(rows, seed=23)
    y = targets_for(rows)
    y[33] = VOCAB + 5
    with head.client(chunk_bytes=HIDDEN * 4 * 4) as c:
        with pytest.raises(lce_client.LceError) as ei:
            c.forward_backward(h, y)
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "33" in ei.value.details, ei.value.details


def test_unreachable_server_is_unavailable():
    c = lce_client.Client("127.0.0.1:1", timeout=5)
    with pytest.raises(lce_client.LceError) as ei:
        c.info()
    assert ei.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_bearer_token(server_factory, workdir):
    tok = workdir / "token"
    tok.write_text("s3cret-token-0123456789\n")
    srv = server_factory([f"--seed-head=64x{HIDDEN}", "--head-dtype=fp32", f"--auth-token-file={tok}"], name="auth")
    h = np.random.default_rng(0).standard_normal((3, HIDDEN)).astype(np.float32)
    y = np.array([1, 2, 3])
    with pytest.raises(lce_client.LceError) as ei:
        lce_client.Client(srv.target, timeout=30).score(h, y)
    assert ei.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(lce_client.LceError) as ei:
        lce_client.Client(srv.target, timeout=30, token="wrong").score(h, y)
    assert ei.value.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    lp, _ = lce_client.Client(srv.target, timeout=30, token="s3cret-token-0123456789").score(h, y)
    assert lp.shape == (3,) and np.all(lp < 0)


def test_empty_batch_is_answered_without_rpc():
    c = lce_client.Client("127.0.0.1:1", timeout=1)  # nothing listens there: no RPC is made
    h = np.zeros((0, HIDDEN), np.float32)
    y = np.zeros(0, np.int64)
    lp, ent = c.score(h, y)
    assert lp.shape == (0,) and ent.shape == (0,)
    r = c.forward_backward(h, y)
    assert r.loss == 0.0 and r.d_hidden.shape == (0, HIDDEN) and r.valid_tokens == 0
    assert c.backward(h, y).shape == (0, HIDDEN)


def test_default_chunk_size_splits_large_requests(heads):
    """More than 4 MiB of hidden states go as several default-sized chunks and reassemble in order."""
    head = heads["fp32"]
    rows = (5 << 20) // (HIDDEN * 4)  # 5 MiB
    h = np.random.default_rng(50).standard_normal((rows, HIDDEN)).astype(np.float32)
    y = targets_for(rows, seed=51)
    calls = []
    with head.client() as c:
        lp, _ = c.score(h, y, progress=lambda d, t: calls.append(d))
        lp_small, _ = c.score(h[-100:], y[-100:])
    assert len(calls) == 2 and calls[-1] == rows
    assert_close(lp[-100:], lp_small, rtol=2e-5, atol=1e-6, what="tail rows")


@requires_torch
@pytest.mark.parametrize("aggregation,kl,dual", [("token-mean", "k1", 0.0), ("seq-mean-token-mean", "k3", 3.0),
                                                  ("seq-mean-token-sum", "k3", 0.0)])
def test_policy_loss_matches_reference(heads, aggregation, kl, dual):
    """PolicyLoss (docs/MATH.md, "Policy loss"): loss, statistics and d_hidden against autograd."""
    import torch

    head = heads["fp32"]
    B, T = 3, 10
    st, h64 = head.hidden(B * T, seed=60, shape=(B, T))
    y = targets_for(B * T, seed=61, ignore=(8, 9, 19)).reshape(B, T)
    ref = reference(head.w64, h64, y)
    lp0 = ref["logprobs"].detach().numpy()
    rng = np.random.default_rng(62)
    old = (lp0 + rng.normal(0, 0.4, B * T)).astype(np.float32)
    adv = rng.standard_normal(B * T).astype(np.float32)
    ref_lp = (lp0 + rng.normal(0, 0.3, B * T)).astype(np.float32)
    cl, ch, ent_coef, kl_coef = 0.2, 0.28, 0.01, 0.05
    with head.client(chunk_bytes=700) as c:
        r = c.policy_loss(st, y, old.reshape(B, T), adv.reshape(B, T), ref_logprobs=ref_lp.reshape(B, T),
                          clip_low=cl, clip_high=ch, dual_clip=dual, aggregation=aggregation,
                          entropy_coef=ent_coef, kl_coef=kl_coef, kl_estimator=kl)

    valid = ref["valid"]
    lp, H = ref["logprobs"], ref["entropy"]
    o, A_, rl = (torch.tensor(v, dtype=torch.float64) for v in (old, adv, ref_lp))
    ratio = torch.exp(lp - o)
    unclipped, clipped = -A_ * ratio, -A_ * torch.clamp(ratio, 1 - cl, 1 + ch)
    pg = torch.maximum(unclipped, clipped)
    if dual > 0:
        pg = torch.where(A_ < 0, torch.minimum(pg, -A_ * dual), pg)
    d = rl - lp
    klt = -d if kl == "k1" else torch.exp(d) - d - 1
    L = pg + kl_coef * klt - ent_coef * H
    seq = torch.arange(B).repeat_interleave(T)
    n_seq = torch.bincount(seq[valid], minlength=B).double()
    if aggregation == "token-mean":
        w = torch.full_like(L, 1.0 / valid.sum().item())
    elif aggregation == "seq-mean-token-sum":
        w = torch.full_like(L, 1.0 / B)
    else:
        w = 1.0 / (B * n_seq[seq])
    loss = (torch.where(valid, w * L, torch.zeros_like(L))).sum()
    v = valid.numpy()
    assert r.valid_tokens == int(v.sum())
    assert_close(r.loss, loss.detach(), rtol=1e-5, atol=1e-6, what="policy loss")
    assert_close(r.logprobs.reshape(-1), lp.detach(), rtol=2e-6, atol=2e-5, what="logprobs")
    assert_close(r.entropy.reshape(-1), H.detach(), rtol=2e-6, atol=2e-5, what="entropy")
    assert_close(r.approx_kl, (o - lp)[valid].mean().detach(), rtol=1e-5, atol=1e-5, what="approx_kl")
    assert_close(r.mean_entropy, H[valid].mean().detach(), rtol=1e-5, atol=1e-5, what="mean_entropy")
    assert_close(r.mean_ratio, ratio[valid].mean().detach(), rtol=1e-5, atol=1e-5, what="mean_ratio")
    assert_close(r.mean_kl, klt[valid].mean().detach(), rtol=1e-5, atol=1e-5, what="mean_kl")
    frac = (clipped > unclipped)[valid].double().mean().item()
    assert abs(r.clip_fraction - frac) < 1e-9 and 0 < frac < 1
    assert_close(as_f64(r.d_hidden).reshape(-1, HIDDEN), grad_of(loss, ref["h"]), rtol=2e-5, atol=1e-8,
                 what="d_hidden")


def test_tls_and_mutual_tls(server_factory, tls_files):
    d = tls_files
    read = lambda n: (d / n).read_bytes()  # noqa: E731
    h = np.random.default_rng(1).standard_normal((4, HIDDEN)).astype(np.float32)
    y = np.array([0, 1, 2, 3])
    head = [f"--seed-head=32x{HIDDEN}", "--head-dtype=fp32"]
    srv = server_factory(head + [f"--tls-cert={d / 'server.pem'}", f"--tls-key={d / 'server.key'}"], name="tls")
    lp, _ = lce_client.Client(srv.target, timeout=30, root_certificates=read("ca.pem")).score(h, y)
    assert lp.shape == (4,)
    with pytest.raises(lce_client.LceError) as ei:  # plaintext to a TLS server
        lce_client.Client(srv.target, timeout=5).info()
    assert ei.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    m = server_factory(head + [f"--tls-cert={d / 'server.pem'}", f"--tls-key={d / 'server.key'}",
                               f"--tls-client-ca={d / 'ca.pem'}"], name="mtls")
    c = lce_client.Client(m.target, timeout=30, root_certificates=read("ca.pem"), private_key=read("client.key"),
                          certificate_chain=read("client.pem"))
    assert c.info().head.vocab_size == 32
    with pytest.raises(lce_client.LceError) as ei:  # no client certificate
        lce_client.Client(m.target, timeout=5, root_certificates=read("ca.pem")).info()
    assert ei.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_head_management_roundtrip(server_factory, workdir):
    """load_head (seeded, clone), update_weights, info versions, save_head, and scoring a named head."""
    srv = server_factory([f"--seed-head=16x{HIDDEN}", "--head-dtype=bf16"], name="heads")
    rng = np.random.default_rng(70)
    w = lce_client.f32_to_bf16_bits((rng.standard_normal((40, HIDDEN)) * 0.3).astype(np.float32))
    with lce_client.Client(srv.target, timeout=60, chunk_bytes=HIDDEN * 2 * 7) as c:
        hi = c.load_head("extra", seeded=(40, HIDDEN, 3, "bf16"))
        assert (hi.name, hi.vocab_size, hi.hidden_size, hi.dtype) == ("extra", 40, HIDDEN, "bf16")
        hi2 = c.update_weights(w, head="extra")  # several chunks of 7 rows
        assert hi2.version == hi.version + 1
        with pytest.raises(lce_client.LceError) as ei:
            c.update_weights(w, head="extra", expected_version=hi.version)  # stale
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
        c.load_head("extra_ref", clone_of="extra")
        names = {h.name for h in c.info().heads}
        assert {"extra", "extra_ref"} <= names
        h = lce_client.f32_to_bf16_bits(rng.standard_normal((5, HIDDEN)).astype(np.float32))
        lp1, _ = c.score(h, [0, 1, 2, 3, 39], head="extra")
        lp2, _ = c.score(h, [0, 1, 2, 3, 39], head="extra_ref")
        np.testing.assert_array_equal(lp1, lp2)
        files, index = c.save_head(str(workdir / "saved"), head="extra")
    assert index and files
    saved = lce_client.local.read_safetensors(files[0])
    (tensor,) = saved.values()
    np.testing.assert_array_equal(tensor, w)
