"""A head with a bias on tensor-parallel groups (CPU engine, Gloo; issue 34's "heads from plain PyTorch"):
each rank owns its vocabulary rows of the bias as of W. LoadHead (seeded with a bias, then UpdateWeights
with one: serve_linear's upload), Score and ForwardBackward with it, dB accumulated on each rank's shard,
GetGrad(bias) gathering the shards in vocabulary order, UpdateWeights(bias) scattering it, OptimizerStep
(AdamW; clipping by the norm of [dW | dB] over every shard) and SaveHead / LoadHead of the shards. Groups
of 2 and 3 against one server: the same bits (docs/MATH.md, "Order of reductions": the CPU engine's
outputs, dW and the tile-ordered norm do not depend on the group size, and dB sums the rows in order as
dW does); and against torch's nn.Linear with a bias + cross-entropy in float64 (loss, dW, dB, one
clip_grad_norm_ + AdamW step)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import lce_client
from conftest import HIDDEN, VOCAB, TpGroup, requires_torch
from lce_client.local import read_safetensors

pytestmark = pytest.mark.skipif(os.environ.get("LCE_TEST_BACKEND", "cpu") != "cpu",
                                reason="one rank's bits for any group size are the CPU engine's (CUDA: not dW, dB)")

SIZES = (1, 2, 3)
STEP = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)


@pytest.fixture(scope="module")
def groups(workdir):
    """A server of one rank and groups of 2 and 3, each starting with a placeholder head."""
    started = {}
    try:
        for k in SIZES:
            started[k] = TpGroup([f"--seed-head={VOCAB}x{HIDDEN}", "--head-dtype=fp32"], workdir, f"tpbias_k{k}", k)
        yield {k: lce_client.Client(g.target, timeout=60) for k, g in started.items()}
    finally:
        for g in started.values():
            g.stop()


def layer_and_rows(seed, rows=37):
    """A biased nn.Linear [VOCAB, HIDDEN] (its bias large enough to move the answers) and rows whose
    first targets fall in every shard of every group size (one ignored row in 9)."""
    import torch

    torch.manual_seed(seed)
    layer = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    with torch.no_grad():
        layer.bias.mul_(40.0)
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
    y = rng.integers(0, VOCAB, rows).astype(np.int64)
    y[:12] = np.arange(12) * (VOCAB // 12)
    y[5::9] = -100
    return layer, h, y


def saved(client, directory, head):
    """`head`'s weight and bias as SaveHead writes them (a shard a rank), in vocabulary order."""
    files, index = client.save_head(str(directory), head=head)
    shards = [read_safetensors(f) for f in files]
    return (np.concatenate([s["lm_head.weight"] for s in shards]), np.concatenate([s["lm_head.bias"] for s in shards]),
            index)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@requires_torch
def test_a_biased_head_trains_on_groups_as_on_one_server_and_as_torch(groups, tmp_path):
    """The same requests on groups of 1, 2 and 3: score, loss and d_hidden, dW and dB (through the
    torch op's backward: (loss · 0.7), committed with its scale on every rank), the step's norm, the
    stepped weight and bias, and the answers after it are the same bits; each is torch's within fp32
    rounding (float64 reference)."""
    import torch

    from lce_client.torch import serve_linear

    layer, h, y = layer_and_rows(3)
    bias_before = layer.bias.detach().numpy().copy()
    out = {}
    for k, c in groups.items():
        module = serve_linear(layer, c, head="lin", train=True)
        lp, _ = c.score(h, y, head="lin")
        x = torch.tensor(h, requires_grad=True)
        loss = module(x, torch.tensor(y)) * 0.7
        loss.backward()
        dw, db = c.get_grad(head="lin"), c.get_grad(head="lin", bias=True)
        norm, info, step = c.optimizer_step(head="lin", **STEP)
        assert (info.version, step) == (3, 1)
        w, b, _ = saved(c, tmp_path / f"k{k}", "lin")
        after, _ = c.score(h, y, head="lin")
        assert not c.get_grad(head="lin", bias=True).any(), f"k={k}: zero_grad reaches every shard's dB"
        out[k] = dict(lp=lp, loss=float(loss.detach()), dh=x.grad.numpy(), dw=dw, db=db, norm=norm, w=w, b=b,
                      after=after)
    for k in SIZES[1:]:
        for name in ("lp", "dh", "dw", "db", "w", "b", "after"):
            np.testing.assert_array_equal(bits(out[k][name]), bits(out[1][name]), err_msg=f"k={k}: {name}")
        assert out[k]["loss"] == out[1]["loss"] and out[k]["norm"] == out[1]["norm"], k

    # torch, float64: the same layer, loss, clip_grad_norm_ over (W, b) and one AdamW step.
    ref = layer.double()
    x = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    logits = ref(x)
    want_lp = -torch.nn.functional.cross_entropy(logits, torch.tensor(y), reduction="none", ignore_index=-100)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y)) * 0.7
    loss.backward()
    r = out[1]
    valid = y != -100
    np.testing.assert_allclose(r["lp"][valid], want_lp.detach().numpy()[valid], rtol=1e-5, atol=1e-5)
    assert r["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    np.testing.assert_allclose(r["dh"], x.grad.numpy(), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(r["dw"], ref.weight.grad.numpy(), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(r["db"], ref.bias.grad.numpy(), rtol=1e-5, atol=1e-8)
    assert np.abs(ref.bias.grad.numpy()).max() > 1e-2, "dB is not negligible"
    want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), STEP["max_grad_norm"]))
    assert r["norm"] == pytest.approx(want_norm, rel=1e-5), "the norm clipped is ‖[dW | dB]‖"
    assert want_norm > STEP["max_grad_norm"], "clipping is exercised"
    torch.optim.AdamW(ref.parameters(), lr=STEP["lr"], weight_decay=STEP["weight_decay"]).step()
    # One AdamW step moves each element by about lr; where its gradient is near 0, g / sqrt(g²) magnifies
    # fp32's rounding of g (6e-6 seen), hence an absolute tolerance, 500x below lr.
    np.testing.assert_allclose(r["w"], ref.weight.detach().numpy(), rtol=0, atol=2e-5)
    np.testing.assert_allclose(r["b"], ref.bias.detach().numpy(), rtol=0, atol=2e-5)
    assert np.abs(r["b"] - bias_before).max() > 5e-3, "the step moved the bias"


def test_update_weights_scatters_the_bias_and_get_grad_gathers_it_in_vocabulary_order(groups, tmp_path):
    """A bias that differs on every row: after UpdateWeights, SaveHead writes it back row for row from
    every group (and from a clone); one row's dB is that row's, wherever its shard; a save by a group of
    3 loads its bias into a group of 2 and one server; a seeded bias starts at zero. Bad biases change
    nothing."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((VOCAB, HIDDEN)) * 0.1).astype(np.float32)
    b = np.arange(VOCAB, dtype=np.float32) / 7 - 20
    h = rng.standard_normal((6, HIDDEN)).astype(np.float32)
    y = np.array([0, 1, 130, 200, 388, 387])
    for k, c in groups.items():
        c.load_head("ub", seeded=(VOCAB, HIDDEN, 5, "fp32"), bias=True)
        assert not c.get_grad(head="ub", bias=True).any()
        _, got_b, _ = saved(c, tmp_path / f"seeded{k}", "ub")
        assert not got_b.any(), f"k={k}: a seeded bias is zero"
        c.update_weights(w, head="ub", bias=b)
        got_w, got_b, _ = saved(c, tmp_path / f"ub{k}", "ub")
        np.testing.assert_array_equal(got_b, b, err_msg=f"k={k}: each rank holds its rows of the bias")
        np.testing.assert_array_equal(got_w, w)
        c.update_weights(w * 2, head="ub")
        np.testing.assert_array_equal(saved(c, tmp_path / f"kept{k}", "ub")[1], b, err_msg="no bias: it stays")
        c.load_head("clone", clone_of="ub")
        np.testing.assert_array_equal(saved(c, tmp_path / f"clone{k}", "clone")[1], b, err_msg="a clone's bias")
        with pytest.raises(lce_client.LceError, match=f"{VOCAB - 1} values for {VOCAB} rows"):
            c.update_weights(w, head="ub", bias=b[1:])
        bad = b.copy()
        bad[VOCAB - 3] = np.inf
        with pytest.raises(lce_client.LceError, match=f"bias\\[{VOCAB - 3}\\] is not finite"):
            c.update_weights(w, head="ub", bias=bad)
        np.testing.assert_array_equal(saved(c, tmp_path / f"after_bad{k}", "ub")[1], b)
        c.forward_backward(h, y, reduction="sum", head="ub", accumulate_weight_grad=True)
        db = c.get_grad(head="ub", bias=True)
        assert db.shape == (VOCAB,)
        lp = c.score(h, y, head="ub")[0]
        # dB_j = Σ_i (p_ij − [y_i = j]) of the summed cross-entropy, in float64.
        z = h.astype(np.float64) @ (2 * w.T.astype(np.float64)) + b  # the weight is w · 2 by now
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        np.testing.assert_allclose(db, p.sum(0), rtol=1e-5, atol=1e-6, err_msg=f"k={k}")
        if k == 1:
            want_db, want_lp = db, lp
        np.testing.assert_array_equal(bits(db), bits(want_db), err_msg=f"k={k}: dB in vocabulary order")
        np.testing.assert_array_equal(bits(lp), bits(want_lp), err_msg=f"k={k}")
        c.zero_grad(head="ub")
    _, _, index = saved(groups[3], tmp_path / "from3", "ub")
    for k in (1, 2):
        groups[k].load_head("loaded", safetensors_file=index)
        assert groups[k].info("loaded").head.has_bias
        np.testing.assert_array_equal(saved(groups[k], tmp_path / f"loaded{k}", "loaded")[1], b)
        np.testing.assert_array_equal(bits(groups[k].score(h, y, head="loaded")[0]), bits(want_lp))


def test_bias_requests_a_group_refuses(groups):
    """The errors of one server, on a group: no bias to set or read on a plain head, none of a pending
    contribution."""
    for k, c in groups.items():
        c.load_head("plain", seeded=(VOCAB, HIDDEN, 1, "fp32"))
        with pytest.raises(lce_client.LceError, match="no bias"):
            c.update_weights(np.zeros((VOCAB, HIDDEN), np.float32), head="plain", bias=np.zeros(VOCAB, np.float32))
        with pytest.raises(lce_client.LceError, match="no bias"):
            c.get_grad(head="plain", bias=True)
        c.load_head("biased", seeded=(VOCAB, HIDDEN, 1, "fp32"), bias=True)
        with pytest.raises(lce_client.LceError, match="separately"):
            c.get_grad(head="biased", bias=True, pending_grad=7)


def test_a_bf16_biased_head_gives_a_group_one_servers_bits(groups):
    """The same on a bf16 head (d_hidden in bf16; dW, dB and the bias fp32)."""
    rng = np.random.default_rng(2)
    w = lce_client.f32_to_bf16_bits((rng.standard_normal((VOCAB, HIDDEN)) * 0.2).astype(np.float32))
    b = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
    h = lce_client.f32_to_bf16_bits(rng.standard_normal((50, HIDDEN)).astype(np.float32))
    y = rng.integers(0, VOCAB, 50)
    got = {}
    for k, c in groups.items():
        c.load_head("bf", seeded=(VOCAB, HIDDEN, 0, "bf16"), bias=True)
        c.update_weights(w, head="bf", bias=b)
        r = c.forward_backward(h, y, reduction="mean", head="bf", label_smoothing=0.1, z_loss=1e-3,
                               accumulate_weight_grad=True)
        got[k] = (bits(r.per_token_loss), np.asarray(r.d_hidden).view(np.uint16), bits(c.get_grad(head="bf")),
                  bits(c.get_grad(head="bf", bias=True)))
    for k in SIZES[1:]:
        for name, a, want in zip(("loss", "d_hidden", "dW", "dB"), got[k], got[1]):
            np.testing.assert_array_equal(a, want, err_msg=f"k={k}: {name}")
