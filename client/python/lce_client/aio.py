"""lce_client.aio.Client: the asyncio client (grpc.aio), for rollout workers that keep many requests in flight.

    from lce_client.aio import Client
    async with Client("127.0.0.1:50051", timeout=60) as c:
        results = await asyncio.gather(*(c.score(h, t) for h, t in batches))   # 64 calls in flight at once
        r = await c.forward_backward(hidden, targets)

The calls are those of the sync lce_client.Client, with the same arguments and results, as coroutines:
score, forward_backward, backward, policy_loss, info, head_info, load_head, zero_grad, get_grad,
optimizer_step, update_weights, save_head. Both clients build their requests and read their answers with
the same code (lce_client._client._Calls); the answers are the same bits. What this client does not do
(use the sync Client for it): several replicas, a request split over several streams (`streams` > 1),
the data plane, and shared-memory / CUDA IPC regions. Each call is one gRPC stream on one channel (HTTP/2
multiplexes them over one connection); the channel is made on the first call, in the running event loop.
"""
from __future__ import annotations

import asyncio
import functools
from typing import Optional, Sequence, Union

import grpc
import grpc.aio

from ._client import Client as SyncClient
from ._client import (DEFAULT_CHUNK_BYTES, HeadInfo, LceError, ServerInfo, _AnswerReader, _Calls,
                      _empty_summary, _new_outputs, _Progress, _replica_targets, _server_info, _StreamCall, _wrap)
from ._proto import lce_pb2 as pb
from ._proto import lce_pb2_grpc as pb_grpc

__all__ = ["Client", "LceError"]


def _coroutine(shared):
    """An `async def` method of the shared call `shared` (whose _execute* return coroutines here)."""

    @functools.wraps(shared)
    async def call(self, *args, **kwargs):
        return await shared(self, *args, **kwargs)

    return call


def _status_masked(e: grpc.RpcError) -> bool:
    """grpc.aio's INTERNAL of a write that failed because the server had ended the stream (grpc/grpc#36066)."""
    debug = e.debug_error_string() if hasattr(e, "debug_error_string") else ""
    return e.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (debug or "")


class Client(_Calls):
    """An asyncio connection to one lce_server. Arguments as lce_client.Client's (timeout, chunk_bytes,
    first_chunk_bytes, last_chunk_bytes, grow_chunks, TLS, token, admin_token, head, options); one target.
    Any number of calls may be in flight at once (asyncio.gather); each is its own stream."""

    def __init__(self, target: Union[str, Sequence[str]], *, timeout: Optional[float] = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, root_certificates: Optional[bytes] = None,
                 private_key: Optional[bytes] = None, certificate_chain: Optional[bytes] = None,
                 tls: Optional[bool] = None, token: Optional[str] = None, head: str = "", options: Sequence = (),
                 first_chunk_bytes: int = 0, last_chunk_bytes: int = 0, grow_chunks: bool = False,
                 admin_token: Optional[str] = None):
        targets = _replica_targets(target, None)
        if len(targets) != 1:
            raise ValueError(f"lce_client.aio.Client takes one target, got {len(targets)} ({', '.join(targets)}): "
                             "for replicas use the sync lce_client.Client")
        self.target = targets[0]
        self._init_settings(timeout=timeout, chunk_bytes=chunk_bytes, first_chunk_bytes=first_chunk_bytes,
                            last_chunk_bytes=last_chunk_bytes, grow_chunks=grow_chunks, head=head, options=options,
                            tls=tls, root_certificates=root_certificates, private_key=private_key,
                            certificate_chain=certificate_chain, token=token, admin_token=admin_token)
        self._channel: Optional[grpc.aio.Channel] = None
        self._stub_obj = None
        self._settings = dict(timeout=timeout, chunk_bytes=chunk_bytes, root_certificates=root_certificates,
                              private_key=private_key, certificate_chain=certificate_chain, tls=tls, token=token,
                              head=head, options=options, first_chunk_bytes=first_chunk_bytes,
                              last_chunk_bytes=last_chunk_bytes, grow_chunks=grow_chunks, admin_token=admin_token)
        self._sync: Optional[SyncClient] = None  # made on first use: see _status_of

    # ----------------------------------------------------------------------------------- plumbing
    @property
    def _stub(self):
        """The stub of the channel, made on first use (in the running event loop, as grpc.aio wants)."""
        if self._stub_obj is None:
            if self._creds is not None:
                self._channel = grpc.aio.secure_channel(self.target, self._creds, options=self._options)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
            self._stub_obj = pb_grpc.LceServiceStub(self._channel)
        return self._stub_obj

    async def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub_obj = None, None

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Waits until the channel is connected (LceError UNAVAILABLE after `timeout`)."""
        self._stub  # noqa: B018 (makes the channel)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError as e:
            raise LceError(grpc.StatusCode.UNAVAILABLE, f"no server at {self.target} after {timeout}s") from e

    async def _execute_unary(self, rpc: str, request, finish):
        try:
            r = await getattr(self._stub, rpc)(request, timeout=self.timeout, metadata=self._call_metadata(rpc))
        except grpc.RpcError as e:
            raise _wrap(e, rpc) from e
        return finish(r)

    async def _execute_collect(self, rpc: str, request, fold, finish):
        acc = None
        try:
            async for msg in getattr(self._stub, rpc)(request, timeout=self.timeout, metadata=self._call_metadata(rpc)):
                acc = fold(acc, msg)
        except grpc.RpcError as e:
            raise _wrap(e, rpc) from e
        return finish(acc)

    async def _execute(self, call: _StreamCall, progress=None, tqdm=False, streams=None):
        if call.regions:
            raise ValueError(f"lce_client.aio.Client sends hidden states on the wire: {', '.join(call.regions)} "
                             "(shared memory, CUDA IPC) is for the sync lce_client.Client")
        if streams not in (None, 1):
            raise ValueError(f"lce_client.aio.Client sends each call as one stream (streams={streams!r}): keep "
                             "several calls in flight instead, or use the sync lce_client.Client")
        h, n = call.h, call.h.rows
        out = _new_outputs(n, h, call.want_dhidden)
        if n == 0:
            out["summary"] = _empty_summary()
            return call.finish(out)
        row_bytes = h.hidden_size * h.itemsize
        plan = self._plan_part(n, row_bytes, region_backed=False, d_hidden_back=call.want_dhidden)
        dh_bytes = out["d_hidden"].reshape(-1).view("uint8") if call.want_dhidden else None
        reader = _AnswerReader(call.rpc, out, 0, n, row_bytes, dh_bytes, False)
        prog = _Progress(n, progress, tqdm, call.rpc) if (progress or tqdm) else None
        # The requests are made lazily from the caller's array, as the sync client's (grpc.aio takes the
        # plain iterator; each chunk is serialised as it is sent).
        rpc = getattr(self._stub, call.rpc)(self._requests(h, call.targets, call.header, call.per_row, plan),
                                            timeout=self.timeout, metadata=self._metadata)
        try:
            async for msg in rpc:
                placed = reader.take(msg)
                if placed is not None and prog is not None:
                    prog.update(*placed)
        except grpc.RpcError as e:
            if _status_masked(e) and not call.header.accumulate_weight_grad:
                return await self._status_of(call)
            err = _wrap(e, call.rpc)
            if _status_masked(e):
                err.annotate("grpc.aio hides the server's status of a stream it ended early, grpc/grpc#36066; "
                             "a call that accumulates the weight gradient is not sent again to learn it")
            raise err from e
        except BaseException:  # a bad answer, or the task was cancelled: end the stream
            rpc.cancel()
            raise
        finally:
            if prog is not None:
                prog.close()
        out["summary"] = reader.done()
        return call.finish(out)

    async def _status_of(self, call: _StreamCall):
        """The call again, through the sync client in a worker thread, for the server's own status: grpc.aio
        replaces the status of a stream that the server ended early (it refused the header) with INTERNAL
        "Internal error from Core" when a request message is written after that end (grpc/grpc#36066;
        the sync API reports the server's status). Only calls without side effects are sent again;
        the answer (or error) is the sync client's."""
        if self._sync is None:
            self._sync = SyncClient(self.target, **self._settings)
        return await asyncio.to_thread(self._sync._execute, call)

    # ------------------------------------------------------------------------------------- calls
    async def info(self, head: Optional[str] = None) -> ServerInfo:
        """Describes the head (default: the client's head) and the server."""
        info = await self._execute_unary("GetInfo", pb.GetInfoRequest(head=self._head(head)), _server_info)
        return self._remember_info(head, info)

    async def head_info(self, head: Optional[str] = None, refresh: bool = False) -> HeadInfo:
        """The head's description, cached after the first call (refresh=True asks again)."""
        return self._cached_head(head, refresh) or (await self.info(head)).head

    score = _coroutine(_Calls.score)
    forward_backward = _coroutine(_Calls.forward_backward)
    backward = _coroutine(_Calls.backward)
    policy_loss = _coroutine(_Calls.policy_loss)
    load_head = _coroutine(_Calls.load_head)
    zero_grad = _coroutine(_Calls.zero_grad)
    get_grad = _coroutine(_Calls.get_grad)
    optimizer_step = _coroutine(_Calls.optimizer_step)
    update_weights = _coroutine(_Calls.update_weights)
    save_head = _coroutine(_Calls.save_head)

