"""A client process for the soak to SIGKILL in the middle of its work (python child.py MODE TARGET H V).
It prints "ready" once its work is under way, then keeps at it until killed. Modes:
  stream      a ForwardBackward stream whose chunks trickle in (killed mid-upload)
  call        one large Call message after another (killed mid-send)
  shm         a shared-memory session whose regions requests read and write
  data_plane  requests whose hidden states go over the data plane's sockets (killed mid-transfer)
  sessions    several sessions holding shared memory and server memory, idle
  train       a ForwardBackward stream that accumulates dW on head TRAIN_KILL_HEAD: "ready" once its
              first chunk's answer (and so that chunk's dW) is in; killed mid-upload, the server must
              roll dW back to what it was before the request
"""
from __future__ import annotations

import sys
import time

import numpy as np

import lce_client
from lce_client._proto import lce_pb2 as pb, lce_pb2_grpc as pb_grpc


def ready() -> None:
    print("ready", flush=True)


def batch(rng, rows, hidden, vocab):
    return rng.standard_normal((rows, hidden)).astype(np.float32), rng.integers(0, vocab, rows)


def stream(target, hidden, vocab, rng):
    import grpc

    stub = pb_grpc.LceServiceStub(grpc.insecure_channel(target))

    def gen():
        yield pb.StreamRequest(header=pb.RequestHeader(hidden_size=hidden, dtype=pb.DTYPE_FLOAT32,
                                                       reduction=pb.REDUCTION_SUM, sends_ahead=True))
        ready()
        while True:
            h, y = batch(rng, int(rng.integers(1, 200)), hidden, vocab)
            yield pb.StreamRequest(chunk=pb.RowChunk(hidden=h.tobytes(), targets=y.tolist()))
            time.sleep(float(rng.uniform(0, 0.02)))

    for _ in stub.ForwardBackward(gen()):
        pass


TRAIN_KILL_HEAD = "killed"


def train(target, hidden, vocab, rng):
    """vocab: TRAIN_KILL_HEAD's (the kill lane loads it with the default head's shape)."""
    import grpc

    stub = pb_grpc.LceServiceStub(grpc.insecure_channel(target))

    def gen():
        yield pb.StreamRequest(header=pb.RequestHeader(head=TRAIN_KILL_HEAD, hidden_size=hidden, dtype=pb.DTYPE_FLOAT32,
                                                       reduction=pb.REDUCTION_SUM, accumulate_weight_grad=True))
        while True:
            h, y = batch(rng, int(rng.integers(1, 200)), hidden, vocab)
            yield pb.StreamRequest(chunk=pb.RowChunk(hidden=h.tobytes(), targets=y.tolist()))
            time.sleep(float(rng.uniform(0, 0.05)))

    for i, _ in enumerate(stub.ForwardBackward(gen())):
        if i == 0:
            ready()


def call(target, hidden, vocab, rng):
    c = lce_client.Client(target, chunk_bytes=1 << 30)
    ready()
    while True:
        h, y = batch(rng, 3000, hidden, vocab)
        c.forward_backward(h, y)


def shm(target, hidden, vocab, rng):
    c = lce_client.Client(target, chunk_bytes=16 << 10)
    s = c.shared_memory_session()
    rows = 1000
    hr, out = s.create(rows * hidden * 4), s.create(rows * hidden * 4)
    h = hr.ndarray((rows, hidden), np.float32)
    ready()
    while True:
        h[...], y = batch(rng, rows, hidden, vocab)
        c.forward_backward(h, y, hidden_region=hr, d_hidden_region=out)


def data_plane(target, hidden, vocab, rng):
    c = lce_client.Client(target, data_plane=True, chunk_bytes=64 << 10, data_plane_sockets=int(rng.integers(1, 5)))
    ready()
    while True:
        h, y = batch(rng, 4000, hidden, vocab)
        c.forward_backward(h, y)


def sessions(target, hidden, vocab, rng):
    c = lce_client.Client(target)
    held = []
    for _ in range(3):
        s = c.shared_memory_session()
        s.create(1 << 16)
        s.allocate_server_memory(1 << 20)
        held.append(s)
    ready()
    time.sleep(3600)


MODES = {"stream": stream, "call": call, "shm": shm, "data_plane": data_plane, "sessions": sessions, "train": train}

if __name__ == "__main__":
    mode, target, hidden, vocab, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    MODES[mode](target, hidden, vocab, np.random.default_rng(seed))
