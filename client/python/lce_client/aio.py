"""lce_client on asyncio: the same computations as lce_client.Client, as coroutines over grpc.aio, so
that one rollout worker keeps many requests in flight from one event loop.

    client = lce_client.aio.Client("127.0.0.1:50051")
    lp, ent = await client.score(hidden, targets)
    results = await asyncio.gather(*(client.score(h, y) for h, y in batches))

score, forward_backward, backward and policy_loss take the sync client's arguments and return the same
results; a request that fits one chunk goes as one Call (one message each way), a larger one as a
stream. Their hidden states travel as bytes: shared-memory and CUDA regions, the data plane, split
streams and progress reporting are the sync client's (ValueError here). The other calls (info,
load_head, optimizer_step, ...) run the sync client's on a worker thread.
"""
from __future__ import annotations

import asyncio
from typing import Optional

import grpc
import numpy as np

from . import _arrays as A
from ._client import Client as _SyncClient
from ._errors import LceError, _wrap
from ._proto import lce_pb2 as pb
from ._proto import lce_pb2_grpc as pb_grpc

_CALL_METHODS = {"Score": pb.CALL_SCORE, "ForwardBackward": pb.CALL_FORWARD_BACKWARD,
                 "Backward": pb.CALL_BACKWARD, "PolicyLoss": pb.CALL_POLICY_LOSS}


class _MaskedStatus(Exception):
    """grpc.aio reported INTERNAL "Internal error from Core" for a stream the server ended early."""


class Client(_SyncClient):
    """lce_client.Client's arguments (one target or several: requests take turns over them)."""

    def __init__(self, target, **kwargs):
        super().__init__(target, **kwargs)
        if self.load_balancing:
            raise ValueError("aio.Client takes its replicas listed, not as a round_robin name")
        self._aio_channels = [self._new_aio_channel(t) for t in self.targets]
        self._aio_stubs = [pb_grpc.LceServiceStub(ch) for ch in self._aio_channels]
        self._aio_next = 0
        self._aio_streams_only: set = set()  # stubs whose server has no Call

    def _new_aio_channel(self, target: str):
        if self._creds is not None:
            return grpc.aio.secure_channel(target, self._creds, options=self._options)
        return grpc.aio.insecure_channel(target, options=self._options)

    async def aclose(self) -> None:
        """Closes the asyncio channels and the sync client's."""
        for ch in self._aio_channels:
            await ch.close()
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    # The four computations: the sync client's argument handling (score, forward_backward, ...),
    # then this transport.
    def _run(self, rpc, h, targets, header, per_row, finish, *, want_dhidden, progress=None, use_tqdm=False,
             hidden_region=None, d_hidden_region=None, d_hidden_offset=0, streams=None, expect_valid=None):
        unsupported = [name for name, used in (("hidden_region", hidden_region is not None),
                                               ("d_hidden_region", d_hidden_region is not None),
                                               ("progress", progress is not None or bool(use_tqdm)),
                                               ("streams", streams not in (None, 1)))
                       if used]
        if unsupported:
            raise ValueError(f"aio.Client: {', '.join(unsupported)} is the sync lce_client.Client's")
        return self._arun(rpc, h, targets, header, per_row, finish, want_dhidden)

    async def _arun(self, rpc, h, targets, header, per_row, finish, want_dhidden):
        n = h.rows
        out = {"logprobs": A.new_rows_out(n), "entropy": A.new_rows_out(n), "loss": A.new_rows_out(n),
               "d_hidden": A.new_hidden_out(n, h.hidden_size, h.wire_dtype) if want_dhidden else None,
               "summary": None}
        if n == 0:
            out["summary"] = pb.RequestSummary(rows=0, valid_tokens=0, loss=0.0)
            return finish(out)
        row_bytes = h.hidden_size * h.itemsize
        dh_bytes = out["d_hidden"].reshape(-1).view(np.uint8) if want_dhidden else None
        plan = self._plan_part(n, row_bytes, region_backed=False, d_hidden_back=want_dhidden)
        # Training calls belong to the front; the rest take turns over the targets.
        i = 0 if header.accumulate_weight_grad else self._aio_next % len(self._aio_stubs)
        self._aio_next += 1
        stub = self._aio_stubs[i]
        requests = list(self._requests(h, targets, header, per_row, plan))
        answers = None
        if len(plan) == 1 and id(stub) not in self._aio_streams_only:
            answers = await self._acall(stub, rpc, requests)
        if answers is None:
            try:
                answers = await self._astream(stub, rpc, requests)
            except _MaskedStatus:
                return await self._resend_for_the_status(rpc, h, targets, header, per_row, finish, want_dhidden)
        expect = 0
        for msg in answers:
            kind = msg.WhichOneof("kind")
            if kind == "summary":
                out["summary"] = msg.summary
            elif kind == "chunk":
                expect = self._place_chunk(msg.chunk, 0, n, expect, out, dh_bytes, row_bytes, rpc, header)
        if expect != n:
            raise LceError(grpc.StatusCode.INTERNAL, f"server answered {expect} of {n} rows", rpc)
        return finish(out)

    async def _astream(self, stub, rpc, requests):
        """A streamed request, written message by message. A server that refuses the request early (an
        unknown head, a bad header) ends the stream while we still write; grpc.aio then reports INTERNAL
        for an iterator-fed stream (grpc/grpc#36066), so we stop writing and read the call's own status."""
        call = getattr(stub, rpc)(timeout=self.timeout, metadata=self._metadata)
        try:
            for req in requests:
                if call.done():
                    break
                await call.write(req)
            if not call.done():
                await call.done_writing()
            return [msg async for msg in call]
        except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
            code, details = await call.code(), await call.details()
            if code == grpc.StatusCode.INTERNAL and details == "Internal error from Core":
                raise _MaskedStatus() from e
            if code == grpc.StatusCode.OK:
                code, details = grpc.StatusCode.INTERNAL, f"stream ended while writing: {e}"
            raise LceError(code, details, rpc) from e

    async def _resend_for_the_status(self, rpc, h, targets, header, per_row, finish, want_dhidden):
        """grpc.aio lost the server's status of a stream it ended early (grpc/grpc#36066): send the request
        again through the sync client, which reports it. A call that accumulates dW is not sent twice."""
        if header.accumulate_weight_grad:
            raise LceError(grpc.StatusCode.INTERNAL, "the server ended the stream early and grpc.aio lost its "
                           "status (grpc/grpc#36066); not resent, as it accumulates the weight gradient", rpc)
        return await asyncio.to_thread(_SyncClient._run, self, rpc, h, targets, header, per_row, finish,
                                       want_dhidden=want_dhidden, progress=None, use_tqdm=False)

    async def _acall(self, stub, rpc, requests):
        """A request of one chunk as one Call; None where the server has none (then this stub streams)."""
        req = pb.CallRequest(method=_CALL_METHODS[rpc], header=requests[0].header, chunk=requests[1].chunk)
        try:
            resp = await stub.Call(req, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._aio_streams_only.add(id(stub))
                return None
            raise _wrap(e, rpc) from e
        answers = [pb.StreamResponse(chunk=resp.chunk)]
        if resp.HasField("summary"):
            answers.append(pb.StreamResponse(summary=resp.summary))
        return answers


def _on_a_thread(name: str):
    sync = getattr(_SyncClient, name)

    async def call(self, *args, **kwargs):
        return await asyncio.to_thread(sync, self, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"The sync client's {name}, on a worker thread (a coroutine)."
    return call


# The calls other than the four computations: rare (administration, training steps), so the sync
# client's, on a worker thread, keep one implementation of each.
for _name in ("wait_ready", "info", "replica_info", "describe", "head_info", "load_head", "zero_grad", "get_grad",
              "optimizer_step", "update_weights", "save_head"):
    setattr(Client, _name, _on_a_thread(_name))


def _no_sessions(self):
    raise ValueError("aio.Client: shared-memory sessions are the sync lce_client.Client's")


Client.shared_memory_session = _no_sessions
