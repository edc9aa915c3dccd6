"""Dynamic batching (--batch-max-rows, --batch-max-delay-us) through the real server: two concurrent
small ForwardBackward Calls that differ only in one loss option (label smoothing, z-loss,
ignore_index) are never merged, so each gets the loss, logprobs and d_hidden it gets alone; two that
do not differ are merged (the window is closed by the rows, not the clock) and get the same."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import lce_client
from conftest import HIDDEN, VOCAB
from helpers import free_port, sample, scrape

ROWS = 8  # a request; two fill a batch (--batch-max-rows=2 * ROWS)
SPECIAL = 7  # a target some rows of every request have: ignore_index=SPECIAL ignores them


@pytest.fixture(scope="module")
def servers(workdir):
    from conftest import Server

    seed = ["--seed-head=%dx%d" % (VOCAB, HIDDEN), "--head-dtype=fp32", "--seed=11"]
    # A window of 1 s that a batch of two fills at once: requests of the same key always merge.
    batching = Server(seed + [f"--batch-max-rows={2 * ROWS}", "--batch-max-delay-us=1000000",
                              f"--metrics-port={free_port()}", "--metrics-host=127.0.0.1"], workdir, "batching")
    alone = Server(seed + ["--batch-max-rows=0"], workdir, "unbatched")
    yield batching, alone
    batching.stop()
    alone.stop()


def request(seed: int):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((ROWS, HIDDEN)).astype(np.float32)
    y = rng.integers(0, VOCAB, ROWS).astype(np.int32)
    y[::3] = SPECIAL
    return h, y


def forward_backward(client, h, y, opts):
    return client.forward_backward(h, y, reduction="sum", return_logprobs=True, **opts)


def concurrently(target, calls):
    """Each (h, y, opts) on its own thread and client at once; their answers in order."""
    out = [None] * len(calls)

    def run(i):
        out[i] = forward_backward(lce_client.Client(target, timeout=60), *calls[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def engine_calls(srv) -> float:
    """The batcher's ForwardBackward engine calls so far (merged or of one request)."""
    return sample(scrape(srv.metrics_port), "lce_batch_requests_count", op="forward_backward")


def expect_same(got, want, what):
    assert got.loss == want.loss, f"{what}: loss {got.loss} != {want.loss} alone"
    for name in ("per_token_loss", "logprobs", "d_hidden"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), f"{what}: {name} differs from alone"


# Guards against a merge key (BatchKey::operator<) that leaves out label_smoothing, z_loss or
# ignore_index: the batch-mate's rows then ran with the leader's option.
@pytest.mark.parametrize("opts", [dict(label_smoothing=0.1), dict(z_loss=1e-3), dict(ignore_index=SPECIAL)],
                         ids=["label_smoothing", "z_loss", "ignore_index"])
def test_requests_differing_in_one_loss_option_get_their_own_answers(servers, opts):
    batching, alone = servers
    ref = lce_client.Client(alone.target, timeout=60)
    calls = [(*request(1), {}), (*request(2), opts)]
    want = [forward_backward(ref, *c) for c in calls]
    assert want[1].loss != forward_backward(ref, *calls[1][:2], {}).loss, "the option changes the loss"
    before = engine_calls(batching)
    got = concurrently(batching.target, calls)
    for i in range(2):
        expect_same(got[i], want[i], f"request {i} ({calls[i][2] or 'defaults'})")
    assert engine_calls(batching) - before == 2, "two engine calls of one request each"

    # The same two requests with the same options are merged into one engine call and split back.
    before = engine_calls(batching)
    same = [(*request(1), opts), (*request(2), opts)]
    got = concurrently(batching.target, same)
    for i in range(2):
        expect_same(got[i], forward_backward(ref, *same[i]), f"merged request {i}")
    assert engine_calls(batching) - before == 1, "the two were merged"
