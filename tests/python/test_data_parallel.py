"""Data-parallel replicas (--dp-size) on loopback, CPU engine, Gloo: R tensor-parallel groups train one
head as one job. Each replica accumulates dW from its own batches; an OptimizerStep called on any
replica sums dW over the replicas and every replica takes the same AdamW step, so their weights stay
bitwise equal and equal (within fp32 rounding) to one server trained on the union of the batches.
ZeroGrad, LoadHead, UpdateWeights and SaveHead act on the whole job; a replica killed mid-job fails
the next step with UNAVAILABLE naming it, and the survivors keep scoring."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import lce_client
from conftest import server_binary
from lce_client.local import read_safetensors

VOCAB, HIDDEN = 389, 48
SEED = 5
STEP = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)


class Replica:
    """One replica: a group of k lce_server ranks, rank 0 its front."""

    def __init__(self, procs, port_file: Path, logs):
        self.procs, self.port_file, self.logs = procs, port_file, logs
        self.target = ""

    def wait_serving(self, deadline: float) -> None:
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            for p, log in zip(self.procs, self.logs):
                if p.poll() is not None:
                    raise RuntimeError(f"lce_server exited with {p.returncode}: {Path(log.name).read_text()}")
            if time.time() > deadline:
                raise RuntimeError("a replica's front did not start in 60 s: " + Path(self.logs[0].name).read_text())
            time.sleep(0.02)
        self.target = f"127.0.0.1:{int(self.port_file.read_text())}"

    def client(self) -> lce_client.Client:
        return lce_client.Client(self.target, timeout=60)

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


class DpJob:
    """R replicas of k ranks each, started together in fresh rendezvous directories under `workdir`."""

    def __init__(self, workdir: Path, replicas: int, k: int, extra=(), head=(VOCAB, HIDDEN), extra_for=None):
        self.replicas = []
        for d in range(replicas):
            port_file = workdir / f"front-{d}.port"
            procs, logs = [], []
            for t in range(k):
                log = open(workdir / f"replica-{d}-rank-{t}.log", "w")
                cmd = [str(server_binary()), "--host=127.0.0.1", "--port=0", f"--port-file={port_file}",
                       "--backend=cpu", "--cpu-threads=1", "--shutdown-grace-seconds=2", "--log-requests=false",
                       f"--seed-head={head[0]}x{head[1]}", "--head-dtype=fp32", f"--seed={SEED}",
                       f"--tp-size={k}", f"--tp-rank={t}", f"--tp-rendezvous={workdir / f'tp-{d}'}",
                       f"--dp-size={replicas}", f"--dp-rank={d}", f"--dp-rendezvous={workdir / 'dp'}",
                       "--dp-timeout-seconds=10", *extra, *(extra_for(d) if extra_for else ())]
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
                logs.append(log)
            self.replicas.append(Replica(procs, port_file, logs))
        deadline = time.time() + 60
        try:
            for r in self.replicas:
                r.wait_serving(deadline)
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        for r in self.replicas:
            for p in r.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM if p is r.procs[0] else signal.SIGKILL)
        for r in self.replicas:
            for p in r.procs:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for log in r.logs:
                log.close()


@pytest.fixture
def dp_job(tmp_path):
    jobs = []

    def start(replicas, k, extra=(), head=(VOCAB, HIDDEN), extra_for=None):
        workdir = tmp_path / f"job{len(jobs)}"
        workdir.mkdir()
        jobs.append(DpJob(workdir, replicas, k, extra, head, extra_for))
        return jobs[-1]

    yield start
    for j in jobs:
        j.stop()


@pytest.fixture
def single(server_factory):
    """One server without replicas, of the same seeded head: the reference."""
    return server_factory([f"--seed-head={VOCAB}x{HIDDEN}", "--head-dtype=fp32", f"--seed={SEED}"], name="dp_ref")


def batch(step: int, replica: int, rows: int = 40):
    rng = np.random.default_rng(1000 * step + replica)
    y = rng.integers(0, VOCAB, rows).astype(np.int32)
    y[::9] = -100
    return rng.standard_normal((rows, HIDDEN)).astype(np.float32), y


def saved_weight(c: lce_client.Client, directory: Path, head: str = "") -> np.ndarray:
    """The head's weight as the replica `c` calls holds it: SaveHead there writes that replica's copy,
    a shard a rank, in row order."""
    files, _ = c.save_head(str(directory), head=head or None)
    return np.concatenate([next(iter(read_safetensors(f).values())) for f in files], axis=0)


def train(job: DpJob, ref: lce_client.Client, steps: int, tmp_path: Path):
    """`steps` AdamW steps: replica d accumulates its batches, the step is called on replica
    step % R; the reference accumulates every replica's batches. Returns the last step's answers."""
    clients = [r.client() for r in job.replicas]
    R = len(clients)
    for s in range(steps):
        for d, c in enumerate(clients):
            h, y = batch(s, d)
            c.forward_backward(h, y, reduction="sum", accumulate_weight_grad=True)
            ref.forward_backward(h, y, reduction="sum", accumulate_weight_grad=True)
        norm, info, n = clients[s % R].optimizer_step(**STEP)
        ref_norm, ref_info, ref_n = ref.optimizer_step(**STEP)
        assert n == ref_n == s + 1 and info.version == ref_info.version == s + 2
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (s, norm, ref_norm)
        assert ref_norm > STEP["max_grad_norm"], "clipping is exercised"
    return clients


def check_job_equals_reference(job: DpJob, ref: lce_client.Client, clients, tmp_path: Path):
    weights = [saved_weight(c, tmp_path / f"saved-{d}") for d, c in enumerate(clients)]
    for d, w in enumerate(weights[1:], 1):
        assert np.array_equal(w, weights[0]), f"replica {d}'s weights differ from replica 0's"
    want = saved_weight(ref, tmp_path / "saved-ref")
    err = np.abs(weights[0] - want).max() / np.abs(want).max()
    assert err < 1e-5, f"the job's weights differ from one server's trained on the union of its batches: {err}"
    h, y = batch(99, 0)
    scores = [c.score(h, y)[0] for c in clients]
    for d, lp in enumerate(scores[1:], 1):
        assert np.array_equal(lp, scores[0]), f"replica {d} scores differently"
    np.testing.assert_allclose(scores[0], ref.score(h, y)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [2, 1])
def test_replicas_train_as_one_server_on_the_union_of_their_batches(dp_job, single, tmp_path, k):
    job = dp_job(2, k)
    ref = lce_client.Client(single.target, timeout=60)
    clients = train(job, ref, 20, tmp_path)
    check_job_equals_reference(job, ref, clients, tmp_path)
    for c in clients:
        assert c.info().head.version == 21


def test_training_calls_act_on_the_whole_job(dp_job, single, tmp_path):
    job = dp_job(2, 2)
    a, b = (r.client() for r in job.replicas)
    ref = lce_client.Client(single.target, timeout=60)
    # LoadHead on replica 1: every replica has the head.
    info = b.load_head("t", seeded=(VOCAB, HIDDEN, 3, "fp32"))
    ref.load_head("t", seeded=(VOCAB, HIDDEN, 3, "fp32"))
    assert info.version == 1 and a.info("t").head.version == 1
    # dW accumulated on both, ZeroGrad on replica 1 zeroes both.
    for d, c in enumerate((a, b)):
        c.forward_backward(*batch(0, d), reduction="sum", head="t", accumulate_weight_grad=True)
    b.zero_grad("t")
    assert not a.get_grad("t").any() and not b.get_grad("t").any()
    # A step that keeps dW: replica 0 keeps the job's sum, the others none, so the next step counts
    # each accumulation once.
    for d, c in enumerate((a, b)):
        h, y = batch(1, d)
        c.forward_backward(h, y, reduction="sum", head="t", accumulate_weight_grad=True)
        ref.forward_backward(h, y, reduction="sum", head="t", accumulate_weight_grad=True)
    want = ref.get_grad("t")
    b.optimizer_step("t", zero_grad=False, **STEP)
    ref.optimizer_step("t", zero_grad=False, **STEP)
    np.testing.assert_allclose(a.get_grad("t"), want, rtol=1e-5, atol=1e-6)
    assert not b.get_grad("t").any()
    a.optimizer_step("t", **STEP)
    ref.optimizer_step("t", **STEP)
    wa, wb = (saved_weight(c, tmp_path / f"t-{d}", "t") for d, c in enumerate((a, b)))
    assert np.array_equal(wa, wb)
    # (Within one AdamW update's rounding: where an element's dW is near 0, m / sqrt(v) magnifies the
    # rounding of the replicas' sum, which adds the batches in another order than one server does.)
    np.testing.assert_allclose(wa, saved_weight(ref, tmp_path / "t-ref", "t"), rtol=0, atol=1e-4)
    # UpdateWeights on replica 1 reaches both; a failed one (a stale expected version) changes none.
    w = np.full((VOCAB, HIDDEN), 0.01, np.float32)
    with pytest.raises(lce_client.LceError) as ei:
        b.update_weights(w, head="t", expected_version=1)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    info = b.update_weights(w, head="t")
    assert info.version == 4 and a.info("t").head.version == 4
    h, y = batch(5, 0)
    assert np.array_equal(a.score(h, y, head="t")[0], b.score(h, y, head="t")[0])
    # A head one replica cannot find fails everywhere and changes nothing.
    with pytest.raises(lce_client.LceError) as ei:
        a.optimizer_step("missing", **STEP)
    assert ei.value.code == grpc.StatusCode.NOT_FOUND
    assert a.optimizer_step("t", **STEP)[1].version == 5


def saved_bias(c: lce_client.Client, directory: Path, head: str) -> np.ndarray:
    files, _ = c.save_head(str(directory), head=head)
    return np.concatenate([read_safetensors(f)["lm_head.bias"] for f in files])


def test_replicas_of_groups_train_a_bias_as_one_server(dp_job, single, tmp_path):
    """A head with a bias on 2 replicas of 2-rank groups: UpdateWeights(bias) on one replica reaches every
    rank of both; a step sums [dW | dB] over the replicas (replica 0 keeps the sum with zero_grad=False),
    clips by its norm and moves the bias of both replicas alike, as one server trained on the union."""
    job = dp_job(2, 2)
    a, b = (r.client() for r in job.replicas)
    ref = lce_client.Client(single.target, timeout=60)
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((VOCAB, HIDDEN)) * 0.2).astype(np.float32)
    bias = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
    for c in (b, ref):
        c.load_head("bz", seeded=(VOCAB, HIDDEN, 3, "fp32"), bias=True)
        c.update_weights(w, head="bz", bias=bias)
    for d, c in enumerate((a, b)):
        np.testing.assert_array_equal(saved_bias(c, tmp_path / f"up-{d}", "bz"), bias, err_msg=f"replica {d}")
    for s in range(3):
        for d, c in enumerate((a, b)):
            h, y = batch(s, d)
            c.forward_backward(h, y, reduction="sum", head="bz", accumulate_weight_grad=True)
            ref.forward_backward(h, y, reduction="sum", head="bz", accumulate_weight_grad=True)
        want_db = ref.get_grad(head="bz", bias=True)
        norm, _, _ = ref.optimizer_step("bz", zero_grad=False, **STEP)
        job_norm, _, _ = (a, b)[s % 2].optimizer_step("bz", zero_grad=False, **STEP)
        assert abs(job_norm - norm) <= 1e-5 * norm and norm > STEP["max_grad_norm"], (s, job_norm, norm)
        np.testing.assert_allclose(a.get_grad(head="bz", bias=True), want_db, rtol=1e-5, atol=1e-6)
        assert not b.get_grad(head="bz", bias=True).any(), "replica 1 keeps none of the sum"
        for c in (a, b, ref):
            c.zero_grad("bz")
    got = [saved_bias(c, tmp_path / f"b-{d}", "bz") for d, c in enumerate((a, b))]
    assert np.array_equal(got[0], got[1]), "the replicas stepped the bias differently"
    want = saved_bias(ref, tmp_path / "b-ref", "bz")
    assert np.abs(want - bias).max() > 1e-2, "the steps moved the bias"
    # (Within AdamW's rounding, as above: the replicas' sum adds the batches in another order.)
    np.testing.assert_allclose(got[0], want, rtol=0, atol=1e-4)


def hold_head(target: str, head: str):
    """Opens a Score stream on `head` and sends only its header: the request holds the head's version
    (a weight change waits for it) until the returned function ends the stream."""
    from lce_client._proto import lce_pb2 as pb, lce_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(target)
    release = threading.Event()

    def messages():
        yield pb.StreamRequest(header=pb.RequestHeader(head=head, hidden_size=HIDDEN, dtype=pb.DTYPE_FLOAT32,
                                                       temperature=1.0, ignore_index=-100,
                                                       outputs=[pb.OUTPUT_LOGPROBS]))
        release.wait(60)

    answers = pb_grpc.LceServiceStub(channel).Score(messages())

    def end():
        release.set()
        answers.cancel()
        channel.close()

    return end


# Guards against a LoadHead that loads without the replicas' meeting (DpCall::Ready): the replicas
# that could change would then serve the new head alone.
def test_a_load_one_replica_cannot_get_ready_for_changes_no_replica(dp_job):
    job = dp_job(2, 1)
    a, b = (r.client() for r in job.replicas)
    a.load_head("t", seeded=(VOCAB, HIDDEN, 3, "fp32"))
    h, y = batch(0, 0)
    before = a.score(h, y, head="t")[0]
    # Replica 1 has a request running on "t": its weight change cannot begin before the deadline.
    end = hold_head(job.replicas[1].target, "t")
    try:
        time.sleep(0.5)  # the header is in: the request holds "t"
        with pytest.raises(lce_client.LceError) as ei:
            lce_client.Client(job.replicas[0].target, timeout=4).load_head("t", seeded=(VOCAB, HIDDEN, 4, "fp32"))
        assert ei.value.code in (grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED), ei.value
    finally:
        end()
    time.sleep(1)  # the replicas' handlers have answered
    for d, c in enumerate((a, b)):
        assert c.info("t").head.version == 1, f"replica {d} changed the head alone"
        assert np.array_equal(c.score(h, y, head="t")[0], before), f"replica {d} serves another head"


# The load itself agreed on: a replica that cannot load the head (here over its --max-head-bytes) keeps
# every replica from serving it (a replica without tensor-parallel peers loads before the meeting).
def test_a_head_one_replica_cannot_load_is_served_by_none(dp_job):
    job = dp_job(2, 1, extra_for=lambda d: ["--max-head-bytes=100000"] if d == 1 else [])
    a, b = (r.client() for r in job.replicas)
    with pytest.raises(lce_client.LceError) as ei:
        a.load_head("big", seeded=(1000, HIDDEN, 5, "fp32"))  # 192,000 bytes: over replica 1's limit
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "replica 1" in str(ei.value), ei.value
    for d, c in enumerate((a, b)):
        assert "big" not in [h.name for h in c.info().heads], f"replica {d} serves the head alone"
    a.load_head("small", seeded=(VOCAB, HIDDEN, 6, "fp32"))  # the job goes on
    assert b.info("small").head.version == 1


# dW crosses between replicas in pieces of 16 << 20 floats (kPieceFloats, server/tp/dp_rank.cc): a head of
# 4097 x 4096 has one row past the first piece. Guards against a piece loop that sums only the first
# piece (or the wrong part of dW) past it.
def test_dw_past_the_first_piece_is_summed_over_the_replicas(dp_job, server_factory, tmp_path):
    vocab, hidden = 4097, 4096
    assert vocab * hidden > 16 << 20 and (vocab - 1) * hidden == 16 << 20, "the last row is the second piece"
    job = dp_job(2, 1, head=(vocab, hidden))
    a, b = (r.client() for r in job.replicas)
    ref = lce_client.Client(server_factory([f"--seed-head={vocab}x{hidden}", "--head-dtype=fp32", f"--seed={SEED}"],
                                           name="dp_big_ref").target, timeout=120)
    for d, c in enumerate((a, b)):
        rng = np.random.default_rng(d)
        h = rng.standard_normal((6, hidden)).astype(np.float32)
        y = rng.integers(0, vocab, 6).astype(np.int32)
        y[d] = vocab - 1  # the last row's own target: its dW row is large and differs per replica
        c.forward_backward(h, y, reduction="sum", accumulate_weight_grad=True)
        ref.forward_backward(h, y, reduction="sum", accumulate_weight_grad=True)
    want = ref.get_grad()
    b.optimizer_step(zero_grad=False, **STEP)  # replica 0 keeps the job's sum
    got = a.get_grad()
    np.testing.assert_allclose(got[-1], want[-1], rtol=1e-5, atol=1e-6, err_msg="the row past the first piece")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    del got, want
    # The step both took: the same weights on both replicas, the last row included.
    wa, wb = (saved_weight(c, tmp_path / f"big-{d}") for d, c in enumerate((a, b)))
    assert np.array_equal(wa[-1], wb[-1]) and np.array_equal(wa, wb), "the replicas stepped differently"


@pytest.mark.parametrize("victim,ranks", [(1, "all"), (0, "all"), (1, "peer")])
def test_a_killed_replica_fails_the_step_and_the_others_keep_scoring(dp_job, victim, ranks):
    """SIGKILL of a whole replica (the sequencer, replica 0, or another), or of one tensor-parallel
    peer of a replica (its group goes down): the next step is UNAVAILABLE naming that replica and
    changes no replica; training stays down; the survivor keeps scoring."""
    job = dp_job(2, 2)
    survivor = 1 - victim
    clients = [r.client() for r in job.replicas]
    for d, c in enumerate(clients):
        c.forward_backward(*batch(0, d), reduction="sum", accumulate_weight_grad=True)
    clients[victim].optimizer_step(**STEP)
    if ranks == "all":
        job.replicas[victim].kill()
    else:
        job.replicas[victim].procs[1].kill()
    c = clients[survivor]
    h, y = batch(1, survivor)
    c.forward_backward(h, y, reduction="sum", accumulate_weight_grad=True)
    t0 = time.time()
    with pytest.raises(lce_client.LceError) as ei:
        c.optimizer_step(**STEP)
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE, ei.value
    assert f"replica {victim}" in str(ei.value), ei.value
    assert time.time() - t0 < 20, "the step gave up late"
    for _ in range(3):
        lp, _ = c.score(h, y)
        assert np.isfinite(lp).all()
    assert c.info().head.version == 2, "no replica stepped"
    with pytest.raises(lce_client.LceError) as ei:  # training stays down until the job restarts
        c.zero_grad()
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_launcher_starts_a_job_of_r_groups_and_stops_it(tmp_path):
    """deploy/lce_dp_launch.sh 2 2: four processes, two fronts on their own ports (port files .0 and
    .1), training as one job; SIGTERM stops every process."""
    port_file = tmp_path / "front.port"
    env = dict(os.environ, LCE_SERVER=str(server_binary()), LCE_DP_RENDEZVOUS=str(tmp_path / "rdv"))
    log = open(tmp_path / "launch.log", "w")
    launcher = subprocess.Popen(
        ["bash", str(Path(__file__).resolve().parents[2] / "deploy" / "lce_dp_launch.sh"), "2", "2", "--",
         "--host=127.0.0.1", "--port=0", f"--port-file={port_file}", "--backend=cpu", "--cpu-threads=1",
         f"--seed-head={VOCAB}x{HIDDEN}", "--head-dtype=fp32", "--shutdown-grace-seconds=2", "--log-requests=false"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        fronts = [Replica([launcher], Path(f"{port_file}.{d}"), [log]) for d in range(2)]
        deadline = time.time() + 60
        for f in fronts:
            f.wait_serving(deadline)
        a, b = (f.client() for f in fronts)
        for d, c in enumerate((a, b)):
            c.forward_backward(*batch(0, d), reduction="sum", accumulate_weight_grad=True)
        assert b.optimizer_step(**STEP)[1].version == 2 and a.info().head.version == 2
        h, y = batch(1, 0)
        assert np.array_equal(a.score(h, y)[0], b.score(h, y)[0])
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0, (tmp_path / "launch.log").read_text()
        assert "job stopped" in (tmp_path / "launch.log").read_text()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        log.close()
