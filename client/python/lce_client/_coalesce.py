"""Client-side coalescing of small concurrent calls (lce_client.aio.Client(coalesce=True)).

Concurrent score() and backward() calls on one client with the same key (computation, header: head,
head version, options, dtype; which per-row arrays they carry) are merged into one RPC, their rows
concatenated in order, and each caller gets its own rows of the answer. As the server's dynamic batcher
with a max delay of 0 merges engine calls: a lone call goes out at the end of the event-loop turn it
was made in (no timer; calls made in the same turn go with it), and calls made while two merged calls
of their key are in flight queue, then go out together as soon as one answers (32 or more queued with
nothing in flight go as two halves, so that the client's Python and the server work at once).

Merging never changes an answer: it is done only where the server reports every output the call
returns as the same bits whatever the batch (GetInfo's invariance.across_batches), and only for the
two computations whose results are row by row (forward_backward and policy_loss also return a loss
and statistics over the whole request, so they always go alone).
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import grpc
import numpy as np

from . import _arrays as A
from ._errors import LceError
from ._proto import lce_pb2 as pb

MERGEABLE = frozenset({"Score", "Backward"})
_OUTPUT_NAMES = {pb.OUTPUT_LOGPROBS: "logprob", pb.OUTPUT_ENTROPY: "entropy", pb.OUTPUT_LOSS: "loss"}
# Statuses one member's rows can cause (a target out of range): the members are then sent again alone,
# so that each caller gets its own status (with its own row numbers). Any other status (UNAVAILABLE,
# NOT_FOUND head, a pinned head version, ...) depends only on what the members share, so each gets it
# as it is. Not RESOURCE_EXHAUSTED: a merged call stays within the server's row and message limits, so
# it means a busy server (--max-concurrent-streams), which a call a member would only make busier.
PER_REQUEST_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})
# Room in a merged message for its header and framing, besides the rows' own bytes.
_MESSAGE_SLACK = 64 << 10


def outputs_of(rpc: str, header: pb.RequestHeader) -> set:
    """The per-row outputs (GetInfo's names) that a call of `rpc` with `header` returns."""
    if rpc == "Backward":
        return {"d_hidden"}
    return {_OUTPUT_NAMES.get(o, f"output {o}") for o in header.outputs}


@dataclass(frozen=True)
class Limits:
    """What the server says about a head, for merging: the outputs that are the same bits in any batch,
    the vocabulary (to keep a request with a bad target out of a merged call), and the size of one
    merged call (the server's rows and message limits, and the client's chunk_bytes of hidden states)."""

    invariant: frozenset
    vocab: int
    max_rows: int
    max_message_bytes: int
    max_hidden_bytes: int

    @classmethod
    def of(cls, info: pb.GetInfoResponse, chunk_bytes: int) -> "Limits":
        max_rows = int(info.max_rows_per_request) or (1 << 62)
        return cls(frozenset(info.invariance.across_batches), int(info.head.vocab_size), max_rows,
                   max(1, int(info.max_message_bytes) - _MESSAGE_SLACK), int(chunk_bytes))

    def merges(self, rpc: str, header: pb.RequestHeader) -> bool:
        return outputs_of(rpc, header) <= self.invariant

    def admits(self, m: "Member", ignore_index: int) -> bool:
        """Whether `m` may join a merged call: it fits one, and its targets are ones the server takes (a
        request it would refuse goes alone, so that its status is its own and the others' calls go on)."""
        if m.rows > self.max_rows or m.message_bytes > self.max_message_bytes or \
                m.hidden_bytes > self.max_hidden_bytes:
            return False
        t = m.targets
        if t.size <= 64:  # (a few numpy calls cost more than this loop on small arrays)
            return all(0 <= y < self.vocab or y == ignore_index for y in t.tolist())
        return bool(np.all(((t >= 0) & (t < self.vocab)) | (t == ignore_index)))


class Member:
    """One caller's request in a lane: its rows, deadline (loop time, or None) and the future of its
    rows' answers (the `out` dict of aio.Client._arun, sliced to its rows), which the caller awaits. A
    cancelled caller cancels only that future: the merged call runs in the lane's task, for the others."""

    __slots__ = ("h", "targets", "header", "per_row", "rows", "hidden_bytes", "message_bytes", "deadline", "fut")

    def __init__(self, h: A.HostArray, targets, header, per_row: dict, deadline: Optional[float]):
        self.h, self.targets, self.header, self.per_row = h, targets, header, per_row
        self.rows = h.rows
        self.hidden_bytes = h.rows * h.hidden_size * h.itemsize
        # Targets and per-row floats take at most 5 bytes a value on the wire, and about as much comes back.
        self.message_bytes = self.hidden_bytes + 8 * h.rows * (1 + len(per_row))
        self.deadline = deadline
        self.fut: Optional[asyncio.Future] = None

    def remaining(self, loop) -> Optional[float]:
        return None if self.deadline is None else self.deadline - loop.time()

    def answer(self, out: dict) -> None:
        if not self.fut.done():  # not cancelled, nor timed out, meanwhile
            self.fut.set_result(out)

    def fail(self, e: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(e)


class Lane:
    """The calls of one key: at most DEPTH merged calls in flight (`inflight`: task -> its members), and
    the calls made meanwhile queued. Two in flight let the client's Python work on one batch's answers
    and its callers' next calls while the server computes the other: with one, the server waits for
    the Python and the Python for the server. So a launch with nothing else in flight takes half of a
    queue of SPLIT_MIN or more calls, and the other half goes at once; the two then alternate. One
    timer fails the members whose own deadline passes, in flight or queued (each caller's deadline is
    its own, whatever the merged call's: see aio.Client): one a lane rather than one a call, which at
    tens of thousands of calls a second is a measurable share of the work."""

    DEPTH = 2
    SPLIT_MIN = 32

    def __init__(self, key, lanes: dict, limits: Limits, send: Callable, loop):
        self.key, self.lanes, self.limits, self.send, self.loop = key, lanes, limits, send, loop
        self.queue: deque = deque()
        self.inflight: dict = {}  # task -> its members
        self.scheduled = False
        self.timer: Optional[asyncio.TimerHandle] = None

    def submit(self, m: Member) -> None:
        m.fut = self.loop.create_future()
        self.queue.append(m)
        # The timer is never later than the earliest deadline waiting (a later call's deadline is later,
        # but for the first calls of a lane, which waited for GetInfo).
        if m.deadline is not None and (self.timer is None or m.deadline < self.timer.when()):
            self._arm(m.deadline)
        self._schedule()

    def _schedule(self) -> None:
        # At the end of this loop turn, not now: calls made in the same turn (asyncio.gather) go with it.
        if self.queue and len(self.inflight) < self.DEPTH and not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._launch)

    def _arm(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_at(when, self._expire)

    def _expire(self) -> None:
        """Fails the waiting members whose deadline has passed; the timer then waits for the next one."""
        self.timer = None
        now = self.loop.time()
        flying = (m for batch in self.inflight.values() for m in batch)
        waiting = [m for m in (*flying, *self.queue) if not m.fut.done() and m.deadline is not None]
        for m in waiting:
            if m.deadline <= now:
                m.fail(LceError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        later = [m.deadline for m in waiting if m.deadline > now]
        if later:
            self._arm(min(later))

    def _launch(self) -> None:
        self.scheduled = False
        half = not self.inflight and len(self.queue) >= self.SPLIT_MIN
        batch = self._take((len(self.queue) + 1) // 2 if half else len(self.queue))
        if batch:
            task = self.loop.create_task(self.send(batch))
            self.inflight[task] = batch
            task.add_done_callback(self._sent)
        if self.queue:
            self._schedule()  # the other half (or those left over by the limits)
        elif not self.inflight:
            self._idle()

    def _sent(self, task: asyncio.Task) -> None:
        del self.inflight[task]
        if not task.cancelled():
            task.exception()  # (retrieved: send() hands every error to the members)
        if self.queue:
            self._schedule()
        elif not self.inflight:
            self._idle()

    def _idle(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.lanes.get(self.key) is self:  # a new call of the key makes a new lane
            del self.lanes[self.key]

    def _take(self, most: int) -> list:
        """Up to `most` queued members, in order, within one merged call's rows and bytes (at least one)."""
        batch, rows, msg, hidden = [], 0, 0, 0
        lim = self.limits
        while self.queue and len(batch) < most:
            m = self.queue[0]
            if m.fut.done():  # its caller was cancelled or timed out while it queued
                self.queue.popleft()
                continue
            if batch and (rows + m.rows > lim.max_rows or msg + m.message_bytes > lim.max_message_bytes or
                          hidden + m.hidden_bytes > lim.max_hidden_bytes):
                break
            self.queue.popleft()
            batch.append(m)
            rows, msg, hidden = rows + m.rows, msg + m.message_bytes, hidden + m.hidden_bytes
        return batch


def merge_rows(batch: list):
    """The members' rows as one request: (hidden, targets, per_row), concatenated in order."""
    if len(batch) == 1:
        m = batch[0]
        return m.h, m.targets, m.per_row
    first = batch[0].h
    arr = np.concatenate([m.h.array for m in batch])
    h = A.HostArray(arr, first.wire_dtype, (arr.shape[0],), "numpy")
    targets = np.concatenate([m.targets for m in batch])
    per_row = {k: np.concatenate([m.per_row[k] for m in batch]) for k in batch[0].per_row}
    return h, targets, per_row


def split_answers(out: dict, batch: list) -> None:
    """Hands each member its rows of the merged answer (views: the members' rows do not overlap)."""
    r0 = 0
    for m in batch:
        r1 = r0 + m.rows
        m.answer({k: (v[r0:r1] if v is not None and k != "summary" else None) for k, v in out.items()})
        r0 = r1


def member_error(e: LceError) -> LceError:
    """A member's own copy of the merged call's error (each caller's traceback is its own)."""
    mine = LceError(e.code, e.details, e.rpc)
    mine.__cause__ = e
    return mine
