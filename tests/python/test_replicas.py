"""Clients over several replicas, against two real lce_servers on loopback serving the same seeded head,
each counting its requests in its Prometheus metrics: scoring calls spread over both (a list, a
comma-separated string, gRPC's round_robin over one name, the data plane, and lce_cli), training calls
on the first, and a replica that dies leaving scoring to the other."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

import lce_client
from conftest import HIDDEN
from helpers import cli
from helpers import free_port, sample, scrape

VOCAB = 64
SCORING = ("Score", "ForwardBackward", "Backward", "PolicyLoss")
TRAINING = ("LoadHead", "ZeroGrad", "GetGrad", "OptimizerStep", "UpdateWeights", "SaveHead")


@pytest.fixture
def pair(server_factory):
    """Two servers of one seeded head (equal weights), each with metrics and a data plane."""
    out = []
    for i in range(2):
        port = free_port()
        srv = server_factory([f"--seed-head={VOCAB}x{HIDDEN}", "--head-dtype=fp32", "--seed=11", "--data-port=0",
                              f"--metrics-port={port}", "--metrics-host=127.0.0.1"], name=f"replica{i}")
        srv.metrics_port = port
        out.append(srv)
    return out


def counts(srv, methods=SCORING + TRAINING) -> dict:
    text = scrape(srv.metrics_port)
    return {m: int(sample(text, "lce_requests_total", method=m, code="OK")) for m in methods}


def delta(after: dict, before: dict) -> dict:
    return {m: after[m] - before[m] for m in after if after[m] != before[m]}


def batch(rows=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, HIDDEN)).astype(np.float32), rng.integers(0, VOCAB, rows).astype(np.int32)


def scoring_calls(c, h, y):
    """Two of each scoring call (none accumulates dW)."""
    for _ in range(2):
        c.score(h, y)
        c.forward_backward(h, y, reduction="sum")
        c.backward(h, y, grad_logprob=np.ones(len(y), np.float32))
        c.policy_loss(h, y, np.full(len(y), -4.0, np.float32), np.ones(len(y), np.float32))


@pytest.mark.parametrize("form", ["list", "comma-separated"])
def test_scoring_calls_spread_and_training_calls_go_to_the_first(pair, tmp_path, form):
    a, b = pair
    target = [a.target, b.target] if form == "list" else f"{a.target}, {b.target}"
    h, y = batch()
    before = [counts(s) for s in pair]
    with lce_client.Client(target, timeout=60) as c, lce_client.Client(a.target, timeout=60) as one:
        assert c.targets == [a.target, b.target]
        scoring_calls(c, h, y)
        lp, ent = c.score(h, y)
        lp1, ent1 = one.score(h, y)
        np.testing.assert_array_equal(lp, lp1)  # equal heads: the same answers wherever a call ran
        c.load_head("t", seeded=(VOCAB, HIDDEN, 3, "fp32"))
        c.zero_grad("t")
        c.forward_backward(h, y, head="t", accumulate_weight_grad=True)
        c.policy_loss(h, y, np.full(len(y), -4.0, np.float32), np.ones(len(y), np.float32), head="t",
                      accumulate_weight_grad=True)
        assert np.abs(c.get_grad("t")).max() > 0
        _, info, _ = c.optimizer_step("t", lr=0.01)
        c.update_weights(np.zeros((VOCAB, HIDDEN), np.float32), head="t")
        c.save_head(str(tmp_path / "saved"), head="t")
    da, db = (delta(counts(s), b0) for s, b0 in zip(pair, before))
    # The 9 scoring calls took turns, the first on the first replica: 5 there, 4 on the second; the 2
    # that accumulate dW went to the front, as did the one-server client's score.
    assert {m: db.get(m, 0) for m in SCORING} == {"Score": 0, "ForwardBackward": 2, "Backward": 0, "PolicyLoss": 2}, db
    assert {m: da.get(m, 0) for m in SCORING} == {"Score": 3 + 1, "ForwardBackward": 1, "Backward": 2,
                                                  "PolicyLoss": 1}, da
    # Every training RPC on the front only.
    assert all(da[m] == 1 for m in TRAINING) and not any(db.get(m, 0) for m in TRAINING), (da, db)
    assert info.version == 2
    assert "t" not in {h.name for h in lce_client.Client(b.target).info().heads}


def test_a_killed_replica_leaves_scoring_to_the_other(pair):
    a, b = pair
    h, y = batch()
    with lce_client.Client([a.target, b.target], timeout=60) as c:
        c.score(h, y)
        c.score(h, y)  # both connected
        b.proc.kill()
        b.proc.wait()
        before = counts(a)
        for _ in range(6):
            c.score(h, y)
            c.forward_backward(h, y)
        d = delta(counts(a), before)
        assert d["Score"] == 6 and d["ForwardBackward"] == 6, d
        c.zero_grad()  # the front is alive
        with pytest.raises(lce_client.LceError) as ei:  # without retries, a call that starts there fails
            lce_client.Client([b.target, a.target], timeout=60, max_attempts=1).score(h, y)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_killed_front_fails_training_calls_but_not_scoring(pair):
    a, b = pair
    h, y = batch()
    with lce_client.Client([a.target, b.target], timeout=60) as c:
        c.score(h, y)
        a.proc.kill()
        a.proc.wait()
        for _ in range(4):
            c.score(h, y)
        assert c.info().backend == "cpu"  # another replica describes the heads
        for call in (lambda: c.zero_grad(), lambda: c.forward_backward(h, y, accumulate_weight_grad=True)):
            with pytest.raises(lce_client.LceError) as ei:
                call()
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE


def test_round_robin_name_spreads_scoring_and_keeps_training_on_one_address(pair):
    a, b = pair
    h, y = batch()
    name = f"ipv4:{a.target},{b.target}"
    before = [counts(s) for s in pair]
    with lce_client.Client(name, load_balancing="round_robin", timeout=60) as c:
        assert c.targets == [name]
        # gRPC's round_robin picks among the addresses that are connected; both are after a few calls.
        for _ in range(100):
            c.score(h, y)
            if all(delta(counts(s), b0).get("Score", 0) for s, b0 in zip(pair, before)):
                break
        for _ in range(4):
            c.zero_grad()
    ds = [delta(counts(s), b0) for s, b0 in zip(pair, before)]
    assert all(d.get("Score", 0) > 0 for d in ds), ds
    assert sorted(d.get("ZeroGrad", 0) for d in ds) == [0, 4], ds
    with pytest.raises(ValueError, match="round_robin"):
        lce_client.Client([a.target, b.target], load_balancing="round_robin")
    with pytest.raises(ValueError, match="data_plane"):
        lce_client.Client(name, load_balancing="round_robin", data_plane=True)


def test_each_replica_has_its_own_data_plane(pair):
    a, b = pair
    h, y = batch(40)
    want = lce_client.Client(a.target, timeout=60).forward_backward(h, y, reduction="none")
    before = [counts(s) for s in pair]
    with lce_client.Client([a.target, b.target], timeout=60, data_plane=True) as c:
        for _ in range(2):
            r = c.forward_backward(h, y, reduction="none")
            np.testing.assert_array_equal(r.d_hidden, want.d_hidden)
            np.testing.assert_array_equal(r.per_token_loss, want.per_token_loss)
        assert all(rep.data_plane.session is not None for rep in c._replicas)
    assert [delta(counts(s), b0)["ForwardBackward"] for s, b0 in zip(pair, before)] == [1, 1]


def test_cli_spreads_over_replicas_and_trains_on_the_first(pair):
    a, b = pair
    t = f"--target={a.target},{b.target}"
    before = [counts(s) for s in pair]
    out = cli("bench", t, "--op=score", "--rows=8", "--iterations=4", "--warmup=0")
    assert "score: 8 rows" in out, out
    cli("zero-grad", t)
    cli("forward-backward", t, "--rows=8", "--accumulate-weight-grad=1")
    cli("step", t, "--lr=0.01")
    da, db = (delta(counts(s), b0) for s, b0 in zip(pair, before))
    assert da.get("Score") == 2 and db.get("Score") == 2, (da, db)
    assert (da.get("ZeroGrad"), da.get("ForwardBackward"), da.get("OptimizerStep")) == (1, 1, 1), da
    assert not any(db.get(m) for m in ("ZeroGrad", "ForwardBackward", "OptimizerStep")), db
    b.proc.kill()
    b.proc.wait()
    for _ in range(2):  # whichever replica a call starts on, it ends on the live one
        assert "mean logprob" in cli("score", t, "--rows=4")
    assert "UNAVAILABLE" in cli("score", f"--target={b.target}", "--rows=4", code=1)


def test_bad_targets_and_options_are_value_errors():
    for target in ("", "a:1,,b:2", [], ["a:1", ""], [None]):
        with pytest.raises(ValueError, match="target"):
            lce_client.Client(target)
    with pytest.raises(ValueError, match="max_attempts"):
        lce_client.Client("a:1", max_attempts=0)
    with pytest.raises(ValueError, match="load_balancing"):
        lce_client.Client("a:1", load_balancing="random")
    assert lce_client.Client("a:1,b:2").max_attempts == 3 and lce_client.Client("a:1").max_attempts == 1


def test_replica_info_says_what_each_replica_is(pair):
    a, b = pair
    b.proc.kill()
    b.proc.wait()
    with lce_client.Client([a.target, b.target], timeout=10) as c:
        (ta, ia), (tb, ib) = c.replica_info()
        assert (ta, tb) == (a.target, b.target)
        assert ia.backend == "cpu" and ia.head.vocab_size == VOCAB
        assert isinstance(ib, lce_client.LceError) and ib.code == grpc.StatusCode.UNAVAILABLE
        lines = c.describe().splitlines()
        assert lines[0].startswith(
            f"  {a.target} (front): backend cpu, tp_size 1, head 'default' {VOCAB}x{HIDDEN} fp32")
        assert lines[1].startswith(f"  {b.target}: GetInfo: UNAVAILABLE")
