"""Faults that hit bugs known and not fixed yet (soak.py --probe-open-bugs); each outcome named after
what it shows, each expected outcome the one a fixed server gives. Off by default: they fail the run
until the bugs are fixed (docs/OPERATING.md, "Fuzzing, sanitizers, soak"). The training probes that
were here (a late-failing or cancelled accumulating request left dW changed) are fixed and are now
the trainer lane's faults bad_target_second_chunk and cancel_after_first_answer (training.py).

- garbage_after_chunk: a stream whose message after a valid chunk is no protobuf message is answered
  OK, as if the client had half-closed there: the request "succeeds" with the rows before it.
"""
from __future__ import annotations

import grpc
import numpy as np

import lce_client
from common import code_name
from lanes import Lane
from lce_client._proto import lce_pb2 as pb, lce_pb2_grpc as pb_grpc

class ProbeLane(Lane):
    name = "probes"

    def __init__(self, ctx, seed):
        super().__init__(ctx, seed)
        self.client = lce_client.Client(ctx.target, timeout=60)
        self.stub = pb_grpc.LceServiceStub(self.client._channel)
        self.hidden = ctx.heads["default"].hidden

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

    def chunk(self, rows, vocab):
        y = self.rng.integers(0, vocab, rows)
        return pb.RowChunk(hidden=self.rng.standard_normal((rows, self.hidden)).astype(np.float32).tobytes(),
                           targets=y.tolist())


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
    "garbage_after_chunk": ({"INVALID_ARGUMENT"}, garbage_after_chunk),
}
