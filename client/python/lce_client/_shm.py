"""Co-located clients: POSIX shared-memory regions registered with the server (OpenSession).

    with client.shared_memory_session() as s:
        region = s.create(rows * hidden * 2)                 # a new shm object, mapped and registered
        h = region.ndarray((rows, hidden), np.uint16)        # write hidden states here
        h[:] = ...
        lp, ent = client.score(h, targets, hidden_region=region)
        out = s.create(rows * hidden * 2)
        r = client.forward_backward(h, targets, hidden_region=region, d_hidden_region=out)
        # r.d_hidden is a view of `out`, written in place by the server

Linux only (the objects live in /dev/shm). The session's regions are unmapped by the server when the
session ends (close(), the with-block's end, or the client process going away); the client unmaps
and unlinks its objects on close().
"""
from __future__ import annotations

import itertools
import mmap
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

import grpc
import numpy as np

from ._proto import lce_pb2 as pb

_COUNTER = itertools.count()
SESSION_METADATA_KEY = "lce-session"


@dataclass
class Region:
    """A registered shared-memory region: `id` (the server's), `session_id` (its owner), `array` (a
    flat uint8 numpy view of its bytes)."""

    id: int
    session_id: str
    name: str
    shm_name: str
    nbytes: int
    array: np.ndarray
    _mmap: Any = None

    def ndarray(self, shape, dtype, offset: int = 0) -> np.ndarray:
        """A numpy view of the region's bytes from `offset`, of `shape` and `dtype` (no copy)."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"{n} bytes at offset {offset} do not fit region '{self.name}' of {self.nbytes} bytes")
        return self.array[offset:offset + n].view(dt).reshape(shape)

    def offset_of(self, arr: np.ndarray) -> int:
        """Byte offset of the C-contiguous array `arr` within this region (ValueError if it is not in it)."""
        a = np.asarray(arr)
        if not a.flags["C_CONTIGUOUS"]:
            raise ValueError("an array in a region must be C-contiguous")
        base = self.array.__array_interface__["data"][0]
        ptr = a.__array_interface__["data"][0]
        off = ptr - base
        if off < 0 or off + a.nbytes > self.nbytes:
            raise ValueError(f"the array is not inside region '{self.name}' ({self.shm_name})")
        return off


class SharedMemorySession:
    """One OpenSession stream and the regions registered over it. Use as a context manager."""

    def __init__(self, stub, metadata, timeout: Optional[float] = None):
        self._requests: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._regions: List[Region] = []
        self._closed = False
        self._call = stub.OpenSession(iter(self._requests.get, None), metadata=metadata, timeout=timeout)
        first = self._next("OpenSession")
        self.session_id: str = first.session_id
        if not self.session_id:
            raise _lce_error(grpc.StatusCode.INTERNAL, "the server's first session message has no session_id")

    def _next(self, what: str):
        from ._client import _wrap

        try:
            return next(self._call)
        except grpc.RpcError as e:
            raise _wrap(e, what) from e
        except StopIteration:
            raise _lce_error(grpc.StatusCode.UNAVAILABLE, "the session stream ended", what) from None

    def _ask(self, req: pb.SessionRequest, what: str) -> pb.SessionResponse:
        with self._lock:
            if self._closed:
                raise ValueError("the session is closed")
            self._requests.put(req)
            resp = self._next(what)
        if resp.code != 0:
            raise _lce_error(grpc.StatusCode(_code_tuple(resp.code)), resp.message, what)
        return resp

    def register(self, shm_name: str, byte_size: int, offset: int = 0, name: str = "") -> int:
        """Registers an existing shm object (e.g. made by another library); returns the region id."""
        r = self._ask(pb.SessionRequest(register_region=pb.RegisterRegion(
            name=name or shm_name, shm_name=shm_name, offset=offset, byte_size=byte_size)), "RegisterRegion")
        return int(r.region_id)

    def unregister(self, region_id: int) -> None:
        self._ask(pb.SessionRequest(unregister_region=pb.UnregisterRegion(region_id=region_id)), "UnregisterRegion")

    def create(self, nbytes: int, name: str = "") -> Region:
        """Creates a shm object of `nbytes`, maps it here, registers it with the server."""
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        shm_name = f"/lce-{os.getpid()}-{next(_COUNTER)}-{os.urandom(4).hex()}"
        path = "/dev/shm" + shm_name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            rid = self.register(shm_name, nbytes, name=name or shm_name)
        except BaseException:
            mm.close()
            os.unlink(path)
            raise
        region = Region(rid, self.session_id, name or shm_name, shm_name, nbytes,
                        np.frombuffer(mm, dtype=np.uint8), mm)
        self._regions.append(region)
        return region

    def release(self, region: Region) -> None:
        """Unregisters the region and deletes its shm object. Views of it must not be used afterwards."""
        if region in self._regions:
            self._regions.remove(region)
            try:
                if not self._closed:
                    self.unregister(region.id)
            finally:
                _unlink(region.shm_name)

    def close(self) -> None:
        """Ends the session (the server unmaps every region) and deletes this session's shm objects."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(None)  # half-close
        try:
            for _ in self._call:
                pass
        except grpc.RpcError:
            pass
        for r in self._regions:
            _unlink(r.shm_name)
        self._regions.clear()

    def cancel(self) -> None:
        """Cancels the session stream, as a client that goes away would (regions stay linked here)."""
        self._closed = True
        self._call.cancel()
        self._requests.put(None)

    def __enter__(self) -> "SharedMemorySession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unlink(shm_name: str) -> None:
    try:
        os.unlink("/dev/shm" + shm_name)
    except FileNotFoundError:
        pass


def _code_tuple(code: int):
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.value
    return grpc.StatusCode.UNKNOWN.value


def _lce_error(code, details, rpc=""):
    from ._client import LceError

    return LceError(code, details, rpc)
