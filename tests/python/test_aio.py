"""lce_client.aio.Client against the real lce_server (CPU engine): 64 calls in flight at once from one event
loop, each answer the same bits as the sync client's answer to the same call (the CPU engine is
batch-invariant: a row's answer does not depend on what else the server is computing), and the training
RPCs, errors and refusals."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

import lce_client
import lce_client.aio
from conftest import HIDDEN, VOCAB, targets_for_rows

CONCURRENT = 64  # the server's default --max-concurrent-streams


def _calls(head):
    """64 calls of the four streaming kinds, of 1 to 40 rows, some over several chunks: (name, args, kwargs)."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(CONCURRENT):
        rows = int(rng.integers(1, 41))
        h, _ = head.hidden(rows, seed=100 + i)
        y = targets_for_rows(rows, seed=200 + i)
        kind = ("score", "forward_backward", "backward", "policy_loss")[i % 4]
        if kind == "score":
            out.append((kind, (h, y), dict(temperature=0.9, softcap=4.0 if i % 8 == 0 else None)))
        elif kind == "forward_backward":
            out.append((kind, (h, y), dict(reduction=("mean", "sum", "none")[i % 3], return_logprobs=True,
                                           return_entropy=True, label_smoothing=0.1 * (i % 2))))
        elif kind == "backward":
            out.append((kind, (h, y, rng.standard_normal(rows).astype(np.float32),
                               rng.standard_normal(rows).astype(np.float32)), {}))
        else:
            old = (rng.standard_normal(rows) * 0.1 - 5).astype(np.float32)
            adv = rng.standard_normal(rows).astype(np.float32)
            out.append((kind, (h, y, old, adv), dict(entropy_coef=0.01, clip_high=0.28)))
    return out


def _flat(result):
    """A call's result as a list of numpy arrays / numbers, to compare bit for bit."""
    if isinstance(result, tuple):
        return [np.asarray(x) for x in result]
    if isinstance(result, np.ndarray):
        return [result]
    return [np.asarray(v) if isinstance(v, np.ndarray) else v for v in vars(result).values()]


def _same_bits(a, b, what):
    fa, fb = _flat(a), _flat(b)
    assert len(fa) == len(fb), what
    for x, y in zip(fa, fb):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, what
            assert x.tobytes() == y.tobytes(), f"{what}: answers differ"
        else:
            assert x == y, f"{what}: {x} != {y}"


def test_64_concurrent_calls_match_the_sync_client_bit_for_bit(head):
    calls = _calls(head)
    with head.client(chunk_bytes=16 * HIDDEN * 4) as c:  # several chunks for the larger calls
        want = [getattr(c, name)(*args, **kw) for name, args, kw in calls]

    async def run():
        in_flight, peak = [0], [0]

        async def one(c, name, args, kw):
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            try:
                return await getattr(c, name)(*args, **kw)
            finally:
                in_flight[0] -= 1

        async with lce_client.aio.Client(head.target, timeout=60, chunk_bytes=16 * HIDDEN * 4) as c:
            await c.wait_ready()
            got = await asyncio.gather(*(one(c, *call) for call in calls))
        return got, peak[0]

    got, peak = asyncio.run(run())
    assert peak == CONCURRENT
    for i, ((name, _, _), g, w) in enumerate(zip(calls, got, want)):
        _same_bits(g, w, f"call {i} ({name})")


def test_torch_in_torch_out(heads):
    torch = pytest.importorskip("torch")
    head = heads["bf16"]
    h = torch.randn(3, 5, HIDDEN).to(torch.bfloat16)
    y = torch.randint(0, VOCAB, (3, 5))

    async def run():
        async with lce_client.aio.Client(head.target, timeout=60) as c:
            return await c.score(h, y), await c.forward_backward(h, y)

    (lp, ent), fb = asyncio.run(run())
    with head.client() as c:
        lp_s, _ = c.score(h, y)
        fb_s = c.forward_backward(h, y)
    assert isinstance(lp, torch.Tensor) and lp.shape == (3, 5) and torch.equal(lp, lp_s)
    assert fb.d_hidden.dtype == torch.bfloat16 and torch.equal(fb.d_hidden, fb_s.d_hidden) and fb.loss == fb_s.loss


def test_training_rpcs_and_info(server_factory, tmp_path):
    srv = server_factory(["--seed-head=64x16", "--head-dtype=fp32", "--seed=3"], name="aio_train")
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 16)) * 0.1).astype(np.float32)
    h = rng.standard_normal((10, 16)).astype(np.float32)
    y = rng.integers(0, 64, 10)

    async def run():
        async with lce_client.aio.Client(srv.target, timeout=60) as c:
            info = await c.info()
            loaded = await c.load_head("aio", seeded=(64, 16, 1, "fp32"))
            updated = await c.update_weights(w, head="aio")
            assert (await c.head_info("aio")).version == updated.version  # cached from info() / asked
            await c.zero_grad(head="aio")
            fb = await c.forward_backward(h, y, head="aio", accumulate_weight_grad=True)
            dw = await c.get_grad(head="aio")
            norm, after, step = await c.optimizer_step(head="aio", lr=1e-2)
            files, index = await c.save_head(str(tmp_path / "saved"), head="aio")
            return info, loaded, updated, fb, dw, norm, after, step, files

    info, loaded, updated, fb, dw, norm, after, step, files = asyncio.run(run())
    assert info.head.vocab_size == 64 and info.backend == "cpu"
    assert loaded.version == 1 and updated.version == 2 and after.version == 3 and step == 1
    # dW of the mean loss, by hand: (softmax - onehot)^T h / rows
    z = h.astype(np.float64) @ w.astype(np.float64).T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(10), y] -= 1
    np.testing.assert_allclose(dw, p.T @ h / 10, rtol=1e-4, atol=1e-6)
    assert abs(norm - np.linalg.norm(dw)) <= 1e-4 * norm
    assert files


def test_errors_and_refusals(heads):
    head = heads["fp32"]
    h, _ = head.hidden(4)
    y = targets_for_rows(4)

    async def run():
        async with lce_client.aio.Client(head.target, timeout=60) as c:
            with pytest.raises(lce_client.LceError) as e:
                await c.score(h, y, head="no-such-head")
            assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-head" in e.value.details
            with pytest.raises(ValueError, match="one stream"):
                await c.score(h, y, streams=2)
            with pytest.raises(ValueError, match="reduction"):
                await c.forward_backward(h, y, reduction="avg")
            lp, ent = await c.score(h[:0], y[:0])  # no rows: answered without a call
            assert lp.shape == (0,) and ent.shape == (0,)

    asyncio.run(run())
    with pytest.raises(ValueError, match="one target"):
        lce_client.aio.Client(f"{head.target},{head.target}")
