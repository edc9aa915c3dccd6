"""The soak's traffic lanes: each a thread that sends requests of every kind through one road to the
server and checks every answer against the float64 reference. Roads: gRPC bytes (one stream, several
streams, one message Calls), shared-memory sessions, the data plane. Clients and sessions are made
afresh now and then, so that connections and sessions come and go through the run."""
from __future__ import annotations

import threading
import traceback
from typing import List

import numpy as np

import lce_client
from common import Ledger, code_name, unexpected
from requests_ref import KINDS, check, issue, make_request


class Lane:
    """A thread running step() until stopped; an exception escaping step() is a failure of the lane."""

    name = "lane"

    def __init__(self, ctx, seed: int):
        self.ctx = ctx
        self.ledger: Ledger = ctx.ledger
        self.rng = np.random.default_rng(seed)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def start(self) -> "Lane":
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.step()
        except Exception as e:  # noqa: BLE001 - the ledger reports it; the soak goes on without the lane
            self.ledger.fail(f"lane {self.name} stopped: {code_name(e)}: {e}\n{traceback.format_exc()}")
        finally:
            self.close()

    def step(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def head(self):
        return self.ctx.heads[str(self.rng.choice(self.ctx.static_heads))]

    def computation(self, client, lane: str, rows=None, **extra) -> None:
        """One random request of a random kind through `client`, checked."""
        req = make_request(self.rng, self.head(), str(self.rng.choice(KINDS)), rows=rows)
        try:
            res = issue(client, req, **extra)
        except lce_client.LceError as e:
            unexpected(self.ledger, f"{lane}/{req.kind}", e, req.describe())
            return
        check(self.ledger, lane, req, res)


class BytesLane(Lane):
    """Hidden states inside the gRPC messages: one message Calls, streams of many chunks, requests split
    over several streams, growing chunks."""

    name = "bytes"
    CONFIGS = [dict(), dict(chunk_bytes=16 << 10), dict(chunk_bytes=16 << 10, streams=3, min_stream_bytes=4 << 10),
               dict(chunk_bytes=64 << 10, first_chunk_bytes=4 << 10, grow_chunks=True)]

    def __init__(self, ctx, seed):
        super().__init__(ctx, seed)
        self.clients: List[lce_client.Client] = []
        self.calls = 0

    def step(self) -> None:
        if self.calls % 200 == 0:  # fresh channels now and then: connections come and go
            self.close()
            self.clients = [lce_client.Client(self.ctx.target, timeout=60, **cfg) for cfg in self.CONFIGS]
        self.calls += 1
        i = int(self.rng.integers(len(self.clients)))
        self.computation(self.clients[i], f"bytes{i}")

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.clients = []


class ShmLane(Lane):
    """Co-located: hidden states in a shared-memory region, d_hidden written into another; a session
    lives for a few dozen requests, then closes (and its regions with it)."""

    name = "shm"
    MAX_ROWS = 500

    def __init__(self, ctx, seed):
        super().__init__(ctx, seed)
        self.client = lce_client.Client(ctx.target, timeout=60, chunk_bytes=32 << 10)
        self.session = None
        self.left = 0

    def step(self) -> None:
        if self.left <= 0:
            self._new_session()
        self.left -= 1
        head = self.head()
        req = make_request(self.rng, head, str(self.rng.choice(KINDS)), rows=int(self.rng.integers(1, self.MAX_ROWS)))
        h = self.h_region.ndarray(req.st.shape, req.st.dtype)
        h[...] = req.st
        extra = dict(hidden=h, hidden_region=self.h_region)
        if req.kind != "score":
            row_bytes = req.st.shape[1] * req.st.itemsize
            spare = (self.out_region.nbytes - req.st.nbytes) // row_bytes
            extra.update(d_hidden_region=self.out_region, d_hidden_offset=int(self.rng.integers(0, spare + 1)) * row_bytes)
        try:
            res = issue(self.client, req, **extra)
        except lce_client.LceError as e:
            unexpected(self.ledger, f"shm/{req.kind}", e, req.describe())
            return
        check(self.ledger, "shm", req, res)

    def _new_session(self) -> None:
        self._close_session()
        self.session = self.client.shared_memory_session()
        nbytes = self.MAX_ROWS * max(h.hidden for h in self.ctx.heads.values()) * 4
        self.h_region = self.session.create(nbytes)
        self.out_region = self.session.create(nbytes + 4096)
        self.left = int(self.rng.integers(10, 40))
        self.ledger.note("shm sessions opened")

    def _close_session(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def close(self) -> None:
        self._close_session()
        self.client.close()


class DataPlaneLane(Lane):
    """Remote: hidden states written into server memory over the data plane's sockets, d_hidden read
    back from it; a client (its session, regions and sockets) lives for a few dozen requests."""

    name = "data_plane"

    def __init__(self, ctx, seed):
        super().__init__(ctx, seed)
        self.client = None
        self.left = 0

    def step(self) -> None:
        if self.left <= 0:
            self.close()
            self.client = lce_client.Client(self.ctx.target, timeout=60, data_plane=True,
                                            data_plane_sockets=int(self.rng.integers(1, 5)),
                                            chunk_bytes=int(self.rng.choice([16 << 10, 256 << 10])))
            self.left = int(self.rng.integers(10, 40))
            self.ledger.note("data-plane clients opened")
        self.left -= 1
        self.computation(self.client, "data_plane")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
