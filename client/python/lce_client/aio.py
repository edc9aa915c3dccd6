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

Concurrent small score() and backward() calls are merged into one Call where that cannot change their
answers (Client's `coalesce`, lce_client._coalesce): grpc.aio costs about 150-250 us of Python a
call, which merging pays once for many.
"""
from __future__ import annotations

import asyncio
from typing import Optional

import grpc
import numpy as np

from . import _arrays as A
from . import _coalesce as C
from ._client import Client as _SyncClient, call_answers
from ._errors import LceError, _wrap
from ._proto import lce_pb2 as pb
from ._proto import lce_pb2_grpc as pb_grpc

_CALL_METHODS = {"Score": pb.CALL_SCORE, "ForwardBackward": pb.CALL_FORWARD_BACKWARD,
                 "Backward": pb.CALL_BACKWARD, "PolicyLoss": pb.CALL_POLICY_LOSS}


class _MaskedStatus(Exception):
    """grpc.aio reported INTERNAL "Internal error from Core" for a stream the server ended early."""


class Client(_SyncClient):
    """lce_client.Client's arguments (one target or several: requests take turns over them), and:

    coalesce: merge concurrent small calls into one RPC (default True). score() and backward() calls
      on this client that fit one chunk and share their head, options and kind of per-row arrays, made
      in the same event-loop turn or while two earlier merged calls of theirs are in flight, go out as
      one Call (their rows concatenated in order, up to the server's max_rows_per_request and
      max_message_bytes and chunk_bytes of hidden states; 32 calls or more with nothing in flight as two
      Calls of half each, so that this process's Python works on one's answers while the server
      computes the other's), and each caller gets its own rows' answers.
      A lone call is not held back: it goes at the end of the loop turn it was made in (no timer).
      Only where the server's GetInfo lists every output the call returns in
      invariance.across_batches (read once a head, on the first such call), so answers are the same
      bits as alone; otherwise, and for forward_backward and policy_loss (a loss over the whole
      request), each call is its own RPC. Errors stay each caller's: a request whose targets the
      server would refuse goes alone, and a merged call refused with INVALID_ARGUMENT or OUT_OF_RANGE
      is sent again as one call a member. A cancelled caller leaves the merged
      call to the others. Deadlines: each caller's is its own, `timeout` after its call: then it gets
      DEADLINE_EXCEEDED, queued or in a merged call. The merged RPC's deadline is the latest of its
      members' (the earliest would fail the members whose deadline has not passed with the status
      of another's; those whose deadline passes first stop waiting without it, while the server
      answers the others). False: one RPC a call.

    `rpcs_sent` counts the computations' RPCs this client sent over grpc.aio (a merged one once).
    """

    def __init__(self, target, *, coalesce: bool = True, **kwargs):
        super().__init__(target, **kwargs)
        if self.load_balancing:
            raise ValueError("aio.Client takes its replicas listed, not as a round_robin name")
        self._aio_channels = [self._new_aio_channel(t) for t in self.targets]
        self._aio_stubs = [pb_grpc.LceServiceStub(ch) for ch in self._aio_channels]
        self._aio_next = 0
        self._aio_streams_only: set = set()  # stubs whose server has no Call
        self.coalesce = bool(coalesce)
        self.rpcs_sent = 0
        self._lanes: dict = {}   # key -> _coalesce.Lane
        self._limits: dict = {}  # head name -> _coalesce.Limits, or the task fetching them

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
        if self._may_merge(rpc, h, header):
            return self._coalesced(rpc, h, targets, header, per_row, finish, want_dhidden)
        return self._arun(rpc, h, targets, header, per_row, finish, want_dhidden, self.timeout)

    async def _arun(self, rpc, h, targets, header, per_row, finish, want_dhidden, timeout):
        n = h.rows
        out = {**A.new_outputs(n, int(header.top_k)),
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
            answers = await self._acall(stub, rpc, requests, timeout)
        if answers is None:
            try:
                answers = await self._astream(stub, rpc, requests, timeout)
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

    async def _astream(self, stub, rpc, requests, timeout):
        """A streamed request, written message by message. A server that refuses the request early (an
        unknown head, a bad header) ends the stream while we still write; grpc.aio then reports INTERNAL
        for an iterator-fed stream (grpc/grpc#36066), so we stop writing and read the call's own status."""
        self.rpcs_sent += 1
        call = getattr(stub, rpc)(timeout=timeout, metadata=self._metadata)
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

    async def _acall(self, stub, rpc, requests, timeout):
        """A request of one chunk as one Call; None where the server has none (then this stub streams)."""
        req = pb.CallRequest(method=_CALL_METHODS[rpc], header=requests[0].header, chunk=requests[1].chunk)
        self.rpcs_sent += 1
        try:
            resp = await stub.Call(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._aio_streams_only.add(id(stub))
                return None
            raise _wrap(e, rpc) from e
        return call_answers(resp)

    # Coalescing (see the class's `coalesce` and lce_client._coalesce).
    def _may_merge(self, rpc, h, header) -> bool:
        """Whether a call may join a merged one, from what it is alone: a score or backward of rows, on
        the wire, that would go as one Call (one chunk)."""
        if not self.coalesce or rpc not in C.MERGEABLE or header.accumulate_weight_grad or h.rows == 0:
            return False
        row_bytes = h.hidden_size * h.itemsize
        per = max(1, self.chunk_bytes // row_bytes)
        first = min(per, max(1, self.first_chunk_bytes // row_bytes)) if self.first_chunk_bytes > 0 else per
        return h.rows <= first  # plan_chunks' one chunk

    async def _coalesced(self, rpc, h, targets, header, per_row, finish, want_dhidden):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout if self.timeout is not None else None
        m = C.Member(h, targets, header, per_row, deadline)
        key = (rpc, want_dhidden, header.SerializeToString(deterministic=True), tuple(per_row))
        lane = self._lanes.get(key) or await self._new_lane(key, rpc, header, want_dhidden, loop)
        if lane is None or not lane.limits.admits(m, header.ignore_index):
            return await self._arun(rpc, h, targets, header, per_row, finish, want_dhidden, m.remaining(loop))
        lane.submit(m)
        return finish(await m.fut)

    async def _new_lane(self, key, rpc, header, want_dhidden, loop):
        """The lane of a key whose calls may merge (decided once while the lane lives), or None."""
        limits = self._limits.get(header.head)
        if not isinstance(limits, C.Limits):
            limits = await self._head_limits(header.head)
        if limits is None or not limits.merges(rpc, header):
            return None
        lane = self._lanes.get(key)  # (made meanwhile, by a call that waited for GetInfo with this one)
        if lane is None:
            send = lambda batch: self._send_merged(rpc, want_dhidden, batch)  # noqa: E731
            lane = self._lanes[key] = C.Lane(key, self._lanes, limits, send, loop)
        return lane

    async def _head_limits(self, head: str):
        """The head's merging limits from GetInfo, asked once (concurrent first calls share the answer);
        None where GetInfo fails (those calls go alone, and get their own status)."""
        got = self._limits.get(head)
        if got is None:
            got = self._limits[head] = asyncio.ensure_future(self._fetch_limits(head))
        return await asyncio.shield(got)  # a cancelled first caller does not cancel the others' GetInfo

    async def _fetch_limits(self, head: str):
        try:
            info = await self._aio_stubs[0].GetInfo(pb.GetInfoRequest(head=head), timeout=self.timeout,
                                                    metadata=self._metadata)
        except Exception:  # noqa: BLE001 - e.g. no such head, or the server is down: asked again next call
            self._limits.pop(head, None)
            return None
        limits = self._limits[head] = C.Limits.of(info, self.chunk_bytes)
        return limits

    async def _send_merged(self, rpc, want_dhidden, batch):
        """One lane's merged call (the lane's task, no caller's: cancelling a caller does not cancel it).
        Every outcome is handed to the members; nothing is raised."""
        loop = asyncio.get_running_loop()
        h, targets, per_row = C.merge_rows(batch)
        remaining = [m.remaining(loop) for m in batch]
        timeout = None if None in remaining else max(remaining)
        try:
            out = await self._arun(rpc, h, targets, batch[0].header, per_row, _raw, want_dhidden, timeout)
        except LceError as e:
            if e.code in C.PER_REQUEST_CODES and len(batch) > 1:
                await asyncio.gather(*(self._send_alone(rpc, want_dhidden, m, loop) for m in batch))
            else:
                for m in batch:
                    m.fail(C.member_error(e))
            return
        except asyncio.CancelledError:  # the loop is going away
            for m in batch:
                m.fut.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - handed to every caller
            for m in batch:
                m.fail(e)
            return
        C.split_answers(out, batch)

    async def _send_alone(self, rpc, want_dhidden, m, loop):
        """A member of a refused merged call, again on its own, with what is left of its deadline."""
        if m.fut.done():
            return
        try:
            out = await self._arun(rpc, m.h, m.targets, m.header, m.per_row, _raw, want_dhidden, m.remaining(loop))
        except Exception as e:  # noqa: BLE001 - the member's own status
            m.fail(e)
            return
        m.answer(out)

    async def load_head(self, name: str, **kwargs):
        """The sync client's load_head, on a worker thread (a coroutine). The heads' merging limits are
        asked again after it (a replaced head may have another vocabulary; it may be the default one)."""
        try:
            return await asyncio.to_thread(_SyncClient.load_head, self, name, **kwargs)
        finally:
            self._limits.clear()


def _raw(out: dict) -> dict:
    """The `finish` of a merged call: its answers as they are, split for the members afterwards."""
    return out


def _on_a_thread(name: str):
    sync = getattr(_SyncClient, name)

    async def call(self, *args, **kwargs):
        return await asyncio.to_thread(sync, self, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"The sync client's {name}, on a worker thread (a coroutine)."
    return call


# The calls other than the four computations: rare (administration, training steps), so the sync
# client's, on a worker thread, keep one implementation of each.
for _name in ("wait_ready", "info", "replica_info", "describe", "head_info", "zero_grad", "commit_grad", "get_grad",
              "optimizer_step", "update_weights", "save_head"):
    setattr(Client, _name, _on_a_thread(_name))


def _no_sessions(self):
    raise ValueError("aio.Client: shared-memory sessions are the sync lce_client.Client's")


Client.shared_memory_session = _no_sessions
