"""The soak's training lanes on the head "train" (fp32): a trainer that accumulates dW through
ForwardBackward and PolicyLoss (at once, or deferred and committed with a scale, beside clients that
forward deferred and die before their backward), reads it back (GetGrad), steps (OptimizerStep), replaces the weight
(UpdateWeights), reloads the head (LoadHead) and saves it (SaveHead), each checked against a local
reference of the same successful steps (float64 dW; AdamW in fp32 from the server's own dW); training
requests that must fail, each followed by a check that dW and the version did not move; and a lane
that scores the head while it trains, pinned to a version or not, checked against that version's
weights."""
from __future__ import annotations

import re
from pathlib import Path

import grpc
import numpy as np

import lce_client
import reference as R
from common import DW_TOL, Checker, code_name, unexpected
from lanes import Lane
from lce_client._proto import lce_pb2 as pb, lce_pb2_grpc as pb_grpc
from requests_ref import check, issue, make_request

TRAIN_HEAD = "train"


class TrainState:
    """What the reference knows of the trained head: its version, weight and AdamW state, and the dW
    accumulated since the last zeroing. It outlives the lanes (the warm-up's trainer hands it on)."""

    def __init__(self, version: int, w64: np.ndarray):
        self.version = version
        self.adam = R.new_adam(w64)
        self.dW = np.zeros_like(w64)


class TrainerLane(Lane):
    name = "trainer"

    def __init__(self, ctx, seed):
        super().__init__(ctx, seed)
        self.head = ctx.heads[TRAIN_HEAD]
        self.client = lce_client.Client(ctx.target, timeout=120, chunk_bytes=16 << 10)
        self.stub = pb_grpc.LceServiceStub(self.client._channel)
        self.save_dir = Path(ctx.workdir) / "train_saves"
        self.s: TrainState = ctx.train

    def step(self) -> None:
        """One cycle: a few accumulations (with failing requests among them), dW checked, a step, now and
        then a save, a weight update or a reload."""
        for _ in range(int(self.rng.integers(1, 4))):
            self.accumulate()
            if self.rng.random() < 0.3:
                self.fault()
        self.optimizer_step(self.check_grad())
        r = self.rng.random()
        if r < 0.2:
            self.check_saved_weight()
        elif r < 0.25:
            self.update_weights()
        elif r < 0.27:
            self.reload()

    # ------------------------------------------------------------------------------ the steps
    def accumulate(self) -> None:
        """One accumulating request: its dW added at once, or deferred and committed with a scale (an
        autograd backward's upstream gradient); now and then a client that forwards deferred and dies
        before its backward, whose contribution must never reach dW (the next check_grad)."""
        kind = str(self.rng.choice(["forward_backward", "policy_loss"]))
        req = make_request(self.rng, self.head, kind, rows=int(self.rng.integers(1, 200)), version=self.s.version)
        deferred = bool(self.rng.random() < 0.5)
        scale = float(self.rng.choice([0.25, 1.0, -0.5, 0.0])) if deferred else 1.0
        try:
            res = issue(self.client, req, accumulate_weight_grad=True, defer_weight_grad=deferred)
            if deferred:
                self.client.commit_grad(res.pending_grads, scale=scale, head=TRAIN_HEAD)
        except lce_client.LceError as e:
            unexpected(self.ledger, f"trainer/{kind}", e, req.describe())
            return
        check(self.ledger, "trainer", req, res)
        self.s.dW += scale * R.d_weight(req.f, req.ref["dz"])
        if self.rng.random() < 0.3:
            self.abandoned_forward()

    def abandoned_forward(self) -> None:
        req = make_request(self.rng, self.head, "forward_backward", rows=int(self.rng.integers(1, 64)),
                           version=self.s.version)
        dying = lce_client.Client(self.ctx.target, timeout=120)
        try:
            issue(dying, req, accumulate_weight_grad=True, defer_weight_grad=True)
        except lce_client.LceError as e:
            unexpected(self.ledger, "trainer/abandoned_forward", e, req.describe())
        finally:
            dying.close()

    def check_grad(self) -> np.ndarray:
        g = self.client.get_grad(TRAIN_HEAD)
        c = Checker(self.ledger, "trainer/get_grad", f"v{self.s.version}")
        scale = float(np.abs(self.s.dW).max(initial=0.0))
        c.values("dW", g, self.s.dW, dict(rtol=DW_TOL["rtol"], atol=DW_TOL["atol"] + DW_TOL["rtol"] * scale))
        c.done()
        return g

    def optimizer_step(self, g: np.ndarray) -> None:
        hp = dict(lr=float(self.rng.choice([1e-3, 3e-3])), beta1=float(self.rng.choice([0.9, 0.8])),
                  beta2=float(self.rng.choice([0.999, 0.95])), eps=float(self.rng.choice([1e-8, 1e-7])),
                  weight_decay=float(self.rng.choice([0.0, 0.01])), max_grad_norm=float(self.rng.choice([0.0, 0.5, 5.0])))
        zero = bool(self.rng.random() < 0.8)
        norm, info, steps = self.client.optimizer_step(TRAIN_HEAD, zero_grad=zero, **hp)
        c = Checker(self.ledger, "trainer/optimizer_step", str(hp))
        c.scalar("grad_norm", norm, float(np.sqrt((g.astype(np.float64) ** 2).sum())), dict(rtol=1e-9, atol=0))
        c.equal("step", steps, self.s.adam.t + 1)
        c.equal("version", info.version, self.s.version + 1)
        c.done()
        mgn = hp.pop("max_grad_norm")
        R.adamw_step(self.s.adam, g, grad_scale=R.clip_scale(norm, mgn), **hp)
        if zero:
            self.s.dW[:] = 0
        self.publish(info.version)

    def check_saved_weight(self) -> None:
        """SaveHead, read back: the weight the reference stepped to (then the reference takes the saved
        bits, so that fp32 differences never pile up)."""
        _, index = self.client.save_head(str(self.save_dir), TRAIN_HEAD)
        w, _ = R.read_saved_head(index)
        c = Checker(self.ledger, "trainer/save_head", f"v{self.s.version}")
        c.values("weight", w, self.s.adam.p, dict(rtol=1e-6, atol=1e-7))
        if c.done():
            if np.array_equal(w, self.s.adam.p):
                self.ledger.note("saved weight bit-equal to the reference AdamW")
            self.s.adam.p[:] = w
            self.publish(self.s.version)

    def update_weights(self) -> None:
        w = (self.s.adam.p + self.rng.normal(0, 1e-3, self.s.adam.p.shape)).astype(np.float32)
        info = self.client.update_weights(w, TRAIN_HEAD, expected_version=self.s.version)
        c = Checker(self.ledger, "trainer/update_weights", f"v{self.s.version}")
        c.equal("version", info.version, self.s.version + 1)
        c.done()
        self.s.adam.p[:] = w  # the masters follow; moments, step count and dW stay
        self.publish(info.version)

    def reload(self) -> None:
        """LoadHead over the head: a new seeded weight, no gradient, no optimizer state."""
        info = self.client.load_head(TRAIN_HEAD, seeded=(self.head.vocab, self.head.hidden,
                                                         int(self.rng.integers(1 << 30)), "fp32"))
        _, index = self.client.save_head(str(self.save_dir), TRAIN_HEAD)
        w, _ = R.read_saved_head(index)
        c = Checker(self.ledger, "trainer/load_head", f"v{self.s.version}")
        c.equal("version", info.version, self.s.version + 1)
        c.done()
        self.s.adam = R.new_adam(w)
        self.s.dW[:] = 0
        self.publish(info.version)

    def publish(self, version: int) -> None:
        self.s.version = version
        self.head.publish(version, self.s.adam.p.astype(np.float64))

    # ------------------------------------------------------------------------------ failures
    def fault(self) -> None:
        """A training request that must fail, before it touches anything or after some of its chunks'
        dW went in; then dW and the version must be as before (checked at once)."""
        name = str(self.rng.choice(list(TRAINING_FAULTS)))
        expected, run = TRAINING_FAULTS[name]
        try:
            run(self)
            outcome = "OK"
        except (lce_client.LceError, grpc.RpcError) as e:
            outcome = code_name(e)
        self.ledger.fault(f"training/{name}", outcome, expected)
        info = self.client.info(TRAIN_HEAD)
        if info.head.version != self.s.version:
            self.ledger.fail(f"training fault {name} moved head 'train' from version {self.s.version} to {info.head.version}")
        self.check_grad()

    def close(self) -> None:
        self.client.close()


def _bad_target_first_chunk(t: TrainerLane) -> None:
    req = make_request(t.rng, t.head, "forward_backward", rows=40, version=t.s.version)
    req.y[int(t.rng.integers(0, 20))] = t.head.vocab + 5  # in the first chunk: refused before any compute
    issue(t.client, req, accumulate_weight_grad=True)


def _nan_hidden(t: TrainerLane) -> None:
    req = make_request(t.rng, t.head, "forward_backward", rows=20, version=t.s.version)
    req.st[int(t.rng.integers(0, 20)), 3] = np.nan
    issue(t.client, req, accumulate_weight_grad=True)


def _stale_version(t: TrainerLane) -> None:
    req = make_request(t.rng, t.head, "policy_loss", rows=20, version=t.s.version)
    issue(t.client, req, accumulate_weight_grad=True, head_version=t.s.version - 1 if t.s.version > 1 else t.s.version + 1000)


def _accumulate_on_score(t: TrainerLane) -> None:
    hdr = pb.RequestHeader(head=TRAIN_HEAD, hidden_size=t.head.hidden, dtype=pb.DTYPE_FLOAT32, accumulate_weight_grad=True)
    chunk = pb.RowChunk(hidden=np.zeros((2, t.head.hidden), np.float32).tobytes(), targets=[1, 2])
    t.stub.Call(pb.CallRequest(method=pb.CALL_SCORE, header=hdr, chunk=chunk), timeout=30)


def _cancel_before_rows(t: TrainerLane) -> None:
    """An accumulating stream cancelled after its header, before any row."""
    import threading

    gate = threading.Event()
    hdr = pb.RequestHeader(head=TRAIN_HEAD, hidden_size=t.head.hidden, dtype=pb.DTYPE_FLOAT32,
                           reduction=pb.REDUCTION_SUM, accumulate_weight_grad=True)

    def gen():
        yield pb.StreamRequest(header=hdr)
        gate.wait(30)

    call = t.stub.ForwardBackward(gen(), timeout=30)
    threading.Timer(float(t.rng.uniform(0.01, 0.2)), call.cancel).start()
    try:
        for _ in call:
            pass
    finally:
        gate.set()


def _accumulating_stream(t: TrainerLane, second_chunk_bad: bool) -> list:
    """A ForwardBackward stream accumulating dW whose first chunk is good (its dW goes in) and whose second,
    when `second_chunk_bad`, has a target outside the vocabulary."""
    hdr = pb.RequestHeader(head=TRAIN_HEAD, hidden_size=t.head.hidden, dtype=pb.DTYPE_FLOAT32,
                           reduction=pb.REDUCTION_SUM, accumulate_weight_grad=True)
    chunks = []
    for bad in (False, second_chunk_bad):
        y = t.rng.integers(0, t.head.vocab, 10)
        if bad:
            y[int(t.rng.integers(0, 10))] = t.head.vocab + 1
        h = t.rng.standard_normal((10, t.head.hidden)).astype(np.float32)
        chunks.append(pb.StreamRequest(chunk=pb.RowChunk(hidden=h.tobytes(), targets=y.tolist())))
    return [pb.StreamRequest(header=hdr)] + chunks


def _bad_target_second_chunk(t: TrainerLane) -> None:
    """Refused after the first chunk's dW is in: the server must roll dW back (issue 22)."""
    for _ in t.stub.ForwardBackward(iter(_accumulating_stream(t, True)), timeout=30):
        pass


def _cancel_after_first_answer(t: TrainerLane) -> None:
    """Cancelled by its client once the first chunk's answer (and its dW) is in: rolled back too."""
    import threading

    gate = threading.Event()
    msgs = _accumulating_stream(t, False)[:2]

    def gen():
        yield from msgs
        gate.wait(30)

    call = t.stub.ForwardBackward(gen(), timeout=30)
    try:
        next(call)
        call.cancel()
        for _ in call:
            pass
    finally:
        gate.set()


def _bad_step(t: TrainerLane) -> None:
    t.client.optimizer_step(TRAIN_HEAD, lr=float(t.rng.choice([-1e-3, float("nan")])))


def _stale_update(t: TrainerLane) -> None:
    t.client.update_weights(t.s.adam.p, TRAIN_HEAD, expected_version=t.s.version + 7)


def _short_update(t: TrainerLane) -> None:
    t.client.update_weights(t.s.adam.p[:-3], TRAIN_HEAD)


def _clone_unknown(t: TrainerLane) -> None:
    t.client.load_head(TRAIN_HEAD, clone_of="no-such-head")


TRAINING_FAULTS = {
    "bad_target_first_chunk": ({"INVALID_ARGUMENT"}, _bad_target_first_chunk),
    "nan_hidden": ({"INVALID_ARGUMENT"}, _nan_hidden),
    "stale_version": ({"FAILED_PRECONDITION"}, _stale_version),
    "accumulate_on_score": ({"INVALID_ARGUMENT"}, _accumulate_on_score),
    "cancel_before_rows": ({"CANCELLED"}, _cancel_before_rows),
    "bad_target_second_chunk": ({"INVALID_ARGUMENT"}, _bad_target_second_chunk),
    "cancel_after_first_answer": ({"CANCELLED"}, _cancel_after_first_answer),
    "bad_optimizer_step": ({"INVALID_ARGUMENT"}, _bad_step),
    "stale_update_weights": ({"FAILED_PRECONDITION"}, _stale_update),
    "short_update_weights": ({"INVALID_ARGUMENT"}, _short_update),
    "clone_unknown_head": ({"NOT_FOUND"}, _clone_unknown),
}


class TrainedHeadLane(Lane):
    """Scores the trained head while it trains: pinned to the latest version the trainer published (the
    answer must be that version's; FAILED_PRECONDITION only when the head has moved on), or unpinned
    ForwardBackward (the answer must be that of the version its summary names)."""

    name = "trained_head"
    _AT = re.compile(r"is at version (\d+)")

    def __init__(self, ctx, seed):
        super().__init__(ctx, seed)
        self.head = ctx.heads[TRAIN_HEAD]
        self.client = lce_client.Client(ctx.target, timeout=120, chunk_bytes=8 << 10)

    def step(self) -> None:
        v, _ = self.head.latest()
        seed = int(self.rng.integers(1 << 62))
        pinned = self.rng.random() < 0.6
        kind = str(self.rng.choice(["score", "forward_backward", "backward", "policy_loss"])) if pinned else "forward_backward"
        req = make_request(np.random.default_rng(seed), self.head, kind, version=v)
        try:
            res = issue(self.client, req, **({"head_version": v} if pinned else {}))
        except lce_client.LceError as e:
            m = self._AT.search(str(e))
            if pinned and e.code == grpc.StatusCode.FAILED_PRECONDITION and m and int(m.group(1)) > v:
                self.ledger.note("pinned version gone (FAILED_PRECONDITION)")
                return
            unexpected(self.ledger, f"trained_head/{kind}", e, req.describe())
            return
        if not pinned and res.head_version != v:  # ran on a later version: its reference, same rows
            if self.head.weight(res.head_version) is None:
                self.ledger.fail(f"trained_head: answered on version {res.head_version}, never published")
                return
            req = make_request(np.random.default_rng(seed), self.head, kind, version=res.head_version)
            self.ledger.note("unpinned request ran on a newer version")
        check(self.ledger, "trained_head" + ("/pinned" if pinned else ""), req, res)

    def close(self) -> None:
        self.client.close()
