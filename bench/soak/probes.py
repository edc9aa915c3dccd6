"""Faults that hit bugs known and not fixed yet (soak.py --probe-open-bugs); each outcome named after
what it shows, each expected outcome the one a fixed server gives. Off by default: they fail the run
until the bugs are fixed (docs/OPERATING.md, "Soak").

- training_chunk_fails_late: a ForwardBackward with accumulate_weight_grad whose second chunk is bad
  fails INVALID_ARGUMENT, but the first chunk's dW stays in the head's gradient (issue 22: "a failed
  or cancelled training request leaves weights and accumulated gradients exactly as before it").
- training_cancelled_midway: the same, the request cancelled by its client after its first answer.
- garbage_after_chunk: a stream whose message after a valid chunk is no protobuf message is answered
  OK, as if the client had half-closed there: the request "succeeds" with the rows before it.
"""
from __future__ import annotations

import threading

import grpc
import numpy as np

import lce_client
from common import code_name
from lanes import Lane
from lce_client._proto import lce_pb2 as pb, lce_pb2_grpc as pb_grpc

PROBE_HEAD = "probe"


class ProbeLane(Lane):
    name = "probes"

    def __init__(self, ctx, seed):
        super().__init__(ctx, seed)
        self.client = lce_client.Client(ctx.target, timeout=60)
        self.stub = pb_grpc.LceServiceStub(self.client._channel)
        self.hidden = ctx.heads["default"].hidden
        self.client.load_head(PROBE_HEAD, seeded=(256, self.hidden, seed, "fp32"))

    def step(self) -> None:
        name = str(self.rng.choice(list(PROBES)))
        expected, run = PROBES[name]
        try:
            outcome = run(self)
        except (lce_client.LceError, grpc.RpcError) as e:
            outcome = code_name(e)
        self.ledger.fault(f"probe/{name}", outcome, expected)
        self.stop.wait(1.0)

    def close(self) -> None:
        self.client.close()

    def header(self, **kw):
        return pb.RequestHeader(hidden_size=self.hidden, dtype=pb.DTYPE_FLOAT32, **kw)

    def chunk(self, rows, vocab, bad=False):
        y = self.rng.integers(0, vocab, rows)
        if bad:
            y[rows // 2] = vocab + 1
        return pb.RowChunk(hidden=self.rng.standard_normal((rows, self.hidden)).astype(np.float32).tobytes(),
                           targets=y.tolist())

    def grad_kept(self, before: np.ndarray, what: str) -> str:
        after = self.client.get_grad(PROBE_HEAD)
        return f"{what}, dW kept" if np.array_equal(before, after) else f"{what}, dW changed"


def training_chunk_fails_late(p: ProbeLane) -> str:
    before = p.client.get_grad(PROBE_HEAD)
    hdr = p.header(head=PROBE_HEAD, reduction=pb.REDUCTION_SUM, accumulate_weight_grad=True)
    msgs = [pb.StreamRequest(header=hdr), pb.StreamRequest(chunk=p.chunk(10, 256)),
            pb.StreamRequest(chunk=p.chunk(10, 256, bad=True))]
    try:
        for _ in p.stub.ForwardBackward(iter(msgs), timeout=30):
            pass
        outcome = "OK"
    except grpc.RpcError as e:
        outcome = e.code().name
    return p.grad_kept(before, outcome)


def training_cancelled_midway(p: ProbeLane) -> str:
    before = p.client.get_grad(PROBE_HEAD)
    gate = threading.Event()
    hdr = p.header(head=PROBE_HEAD, reduction=pb.REDUCTION_SUM, accumulate_weight_grad=True)

    def gen():
        yield pb.StreamRequest(header=hdr)
        yield pb.StreamRequest(chunk=p.chunk(10, 256))
        gate.wait(30)

    call = p.stub.ForwardBackward(gen(), timeout=30)
    try:
        next(call)  # the first chunk's answer: its dW is in
        call.cancel()
        for _ in call:
            pass
        outcome = "OK"
    except grpc.RpcError as e:
        outcome = e.code().name
    finally:
        gate.set()
    return p.grad_kept(before, outcome)


def garbage_after_chunk(p: ProbeLane) -> str:
    vocab = p.ctx.heads["default"].vocab
    call = p.client._channel.stream_stream("/lce.v1.LceService/Score", request_serializer=None,
                                           response_deserializer=None)
    msgs = [pb.StreamRequest(header=p.header()).SerializeToString(),
            pb.StreamRequest(chunk=p.chunk(5, vocab)).SerializeToString(), b"\x12\xff\xff\xff\xff\x0f",
            pb.StreamRequest(chunk=p.chunk(5, vocab)).SerializeToString()]
    for _ in call(iter(msgs), timeout=30):
        pass
    return "OK"


PROBES = {
    "training_chunk_fails_late": ({"INVALID_ARGUMENT, dW kept"}, training_chunk_fails_late),
    "training_cancelled_midway": ({"CANCELLED, dW kept"}, training_cancelled_midway),
    "garbage_after_chunk": ({"INVALID_ARGUMENT"}, garbage_after_chunk),
}
