"""DESIGN.md's invariance guarantee end to end (CPU engine): a row's logprob, entropy, rankings (argmax,
top-k tokens and logprobs), per-row loss and d_hidden are the same bits alone, in batches of 7 and 300,
under three chunkings, over 1 and 3 streams, through shared memory and the data plane, and on
tensor-parallel groups of 1, 2 and 3 ranks (Gloo). Compared with ==, never a tolerance."""
from __future__ import annotations

import numpy as np
import pytest

import lce_client
from conftest import HIDDEN, VOCAB, Server, TpGroup, to_storage, write_safetensors

ROWS = 300
PICKED = (0, 1, 150, 298, 299)  # rows checked alone and in 7-row batches around them
OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, temperature=0.8, softcap=15.0)


@pytest.fixture(scope="module")
def setup(workdir):
    """A bf16 head file, 300 rows of hidden states and targets, a single server and TP groups of 2 and 3."""
    rng = np.random.default_rng(7)
    w = to_storage((rng.standard_normal((VOCAB, HIDDEN)) * 2.4 / np.sqrt(HIDDEN)).astype(np.float32), "bf16")
    path = workdir / "invariance.safetensors"
    write_safetensors(path, {"lm_head.weight": (w, "BF16")})
    h = to_storage(rng.standard_normal((ROWS, HIDDEN)).astype(np.float32), "bf16")
    y = rng.integers(0, VOCAB, ROWS).astype(np.int64)
    y[::9] = -100
    head_args = [f"--head-file={path}", "--head-tensor=lm_head.weight", "--data-port=0"]
    servers, groups = {1: Server(head_args, workdir, "inv_k1")}, []
    try:
        for k in (2, 3):
            groups.append(TpGroup(head_args[:2], workdir, f"inv_k{k}", k))
            servers[k] = groups[-1].front
        yield h, y, servers
    finally:
        servers[1].stop()
        for g in groups:
            g.stop()


def answers(client, h, y, **kw):
    """Every per-row output of one score (with the rankings: argmax and the top 8) and one
    forward_backward (reduction "sum": a row's gradient is its own loss's, whatever the batch), as raw bits."""
    s = client.score(h, y, temperature=OPTIONS["temperature"], softcap=OPTIONS["softcap"], top_k=8, argmax=True,
                     hidden_region=kw.get("hidden_region"))
    r = client.forward_backward(h, y, reduction="sum", **OPTIONS, **kw)
    as_bits = lambda a: np.asarray(a).view(np.uint32 if np.asarray(a).dtype.itemsize == 4 else np.uint16)
    return {"logprob": as_bits(s.logprobs), "entropy": as_bits(s.entropy), "argmax": np.asarray(s.argmax),
            "top_tokens": np.asarray(s.top_tokens), "top_logprobs": as_bits(s.top_logprobs),
            "loss": as_bits(r.per_token_loss),
            "d_hidden": np.asarray(r.d_hidden).view(np.uint16).reshape(len(y), HIDDEN)}


def assert_rows_equal(got, want, rows, offset=0, what=""):
    for name in want:
        for i in rows:
            np.testing.assert_array_equal(got[name][i - offset], want[name][i], err_msg=f"{what}: {name} row {i}")


@pytest.fixture(scope="module")
def reference(setup):
    h, y, servers = setup
    with lce_client.Client(servers[1].target, timeout=60) as c:
        return answers(c, h, y)


def test_alone_and_in_small_batches(setup, reference):
    h, y, servers = setup
    with lce_client.Client(servers[1].target, timeout=60) as c:
        for i in PICKED:
            assert_rows_equal(answers(c, h[i:i + 1], y[i:i + 1]), reference, [i], i, "alone")
            b0 = min(max(i - 3, 0), ROWS - 7)
            assert_rows_equal(answers(c, h[b0:b0 + 7], y[b0:b0 + 7]), reference, [i], b0, "in 7")


@pytest.mark.parametrize("chunk_rows", [1, 13, 128])
def test_chunkings(setup, reference, chunk_rows):
    h, y, servers = setup
    with lce_client.Client(servers[1].target, timeout=60, chunk_bytes=chunk_rows * HIDDEN * 2) as c:
        assert_rows_equal(answers(c, h, y), reference, range(ROWS), 0, f"{chunk_rows}-row chunks")


def test_three_streams(setup, reference):
    h, y, servers = setup
    with lce_client.Client(servers[1].target, timeout=60, chunk_bytes=16 * HIDDEN * 2, streams=3,
                           min_stream_bytes=40 * HIDDEN * 2) as c:
        assert_rows_equal(answers(c, h, y), reference, range(ROWS), 0, "3 streams")


def test_shared_memory(setup, reference):
    h, y, servers = setup
    with lce_client.Client(servers[1].target, timeout=60) as c, c.shared_memory_session() as s:
        region = s.create(h.nbytes)
        hr = region.ndarray(h.shape, h.dtype)
        hr[...] = h
        out = s.create(h.nbytes)
        got = answers(c, hr, y, hidden_region=region, d_hidden_region=out)
        assert_rows_equal(got, reference, range(ROWS), 0, "shared memory")


def test_data_plane(setup, reference):
    h, y, servers = setup
    with lce_client.Client(servers[1].target, timeout=60, data_plane=True) as c:
        assert_rows_equal(answers(c, h, y), reference, range(ROWS), 0, "data plane")


@pytest.mark.parametrize("k", [2, 3])
def test_tensor_parallel_groups(setup, reference, k):
    h, y, servers = setup
    with lce_client.Client(servers[k].target, timeout=60) as c:
        assert c.info().tp_size == k
        assert_rows_equal(answers(c, h, y), reference, range(ROWS), 0, f"TP group of {k}")
        assert_rows_equal(answers(c, h[150:151], y[150:151]), reference, [150], 150, f"TP group of {k}, alone")


def ranked_answers(client, h, y):
    """The rankings (top-k 8: argmax, tokens, logprobs) and a class-weighted loss with its z-loss part and
    d_hidden, as raw bits."""
    s = client.score(h, y, temperature=OPTIONS["temperature"], softcap=OPTIONS["softcap"], top_k=8)
    cw = (0.5 + (np.arange(VOCAB) % 7) / 4).astype(np.float32)
    r = client.forward_backward(h, y, reduction="sum", class_weights=cw, return_z_loss=True, argmax=True, **OPTIONS)
    bits = lambda a: np.asarray(a).view(np.uint32)
    return {"argmax": np.asarray(s.argmax), "top_tokens": np.asarray(s.top_tokens),
            "top_logprobs": bits(s.top_logprobs),
            "fb_argmax": np.asarray(r.argmax), "loss": bits(r.per_token_loss), "z_loss": bits(r.z_loss),
            "d_hidden": np.asarray(r.d_hidden).view(np.uint16).reshape(len(y), HIDDEN)}


@pytest.mark.parametrize("k", [2, 3])
def test_rankings_and_class_weights_over_groups(setup, k):
    """The new outputs cross the group's control block: a TP group gives one rank's bits."""
    h, y, servers = setup
    with lce_client.Client(servers[1].target, timeout=60) as c:
        want = ranked_answers(c, h, y)
    with lce_client.Client(servers[k].target, timeout=60) as c:
        assert_rows_equal(ranked_answers(c, h, y), want, range(ROWS), 0, f"TP group of {k}")
