"""Co-located clients: POSIX shared-memory regions registered with the server (OpenSession).

    with client.shared_memory_session() as s:
        region = s.create(rows * hidden * 2)                 # a new memfd, mapped and handed to the server
        h = region.ndarray((rows, hidden), np.uint16)        # write hidden states here
        h[:] = ...
        lp, ent = client.score(h, targets, hidden_region=region)
        out = s.create(rows * hidden * 2)
        r = client.forward_backward(h, targets, hidden_region=region, d_hidden_region=out)
        # r.d_hidden is a view of `out`, written in place by the server

Linux only. Memory goes to the server as a file descriptor: create() makes a memfd (no name in
/dev/shm that another process could open) and hands it over the server's shm socket
(SessionResponse.shm_socket; SCM_RIGHTS, with the session's id and secret; wire format:
proto/lce/v1/shm_socket_wire.h). Registration by shm name (register()) only works on servers started
with --allow-shm-by-name. The session's regions are unmapped by the server when the session ends
(close(), the with-block's end, or the client process going away); the client closes its memfds
on close().

GPU memory (servers with the CUDA backend, on the same host):

    h = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")   # cudaMalloc'd by torch
    region = s.register_cuda(h)                          # its cudaIpcMemHandle_t, opened by the server
    out = s.register_cuda(torch.empty_like(h))
    r = client.forward_backward(h, targets, hidden_region=region, d_hidden_region=out)
    # r.d_hidden is a view of out's tensor, written in place by the server

The client synchronizes the device's current CUDA stream before it sends a request that uses a CUDA
region; writes made on other streams must be synchronized by the caller (torch.cuda.synchronize()).
The tensor must stay alive, and its storage unresized, while it is registered: the region holds a
reference to it until it is released or the session is closed. CUDA IPC shares the whole cudaMalloc block the
tensor lies in (PyTorch's caching allocator may place other tensors there) with the server process. A CPU server
answers UNIMPLEMENTED.
"""
from __future__ import annotations

import itertools
import mmap
import os
import queue
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

import grpc
import numpy as np

from ._errors import LceError, _wrap
from ._proto import lce_pb2 as pb

_COUNTER = itertools.count()
SESSION_METADATA_KEY = "lce-session"
# A request that names a session's regions proves it is the session's with the session's secret (the
# id alone opens nothing: issue 35, item 12).
SESSION_SECRET_METADATA_KEY = "lce-session-secret"
CUDA_IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)
# The shm socket's request (then the name) and reply (then the message): proto/lce/v1/shm_socket_wire.h.
SHM_SOCKET_REQUEST = struct.Struct("<4sI32s32sqq")
SHM_SOCKET_REPLY = struct.Struct("<iIQ")
SHM_SOCKET_MAX_NAME = 256
assert SHM_SOCKET_REQUEST.size == 88 and SHM_SOCKET_REPLY.size == 16

# PyTorch's CUDA IPC bookkeeping (torch/multiprocessing/reductions.py): _share_cuda_() puts the storage
# behind a reference counter in a shared-memory file, set to 1 for the consumer, and a freed storage's
# block stays reserved ("limbo") until a consumer decrements it. The server is no torch consumer, so
# the client decrements it once the last region over that storage is released (and never twice).
_IPC_LOCK = threading.Lock()
_IPC_LIVE: dict = {}        # (ref_counter_handle, ref_counter_offset) -> live regions over it
_IPC_RELEASED: set = set()  # counters already given back


@dataclass
class Region:
    """A registered shared-memory region: `id` (the server's), `session_id` (its owner), `array` (a
    flat uint8 numpy view of its bytes)."""

    id: int
    session_id: str
    name: str
    shm_name: str
    nbytes: int
    array: Optional[np.ndarray]
    _mmap: Any = None
    # CUDA IPC regions (SharedMemorySession.register_cuda): the registered tensor (kept alive here),
    # the device address of the region's first byte, and torch's IPC reference counter of its storage.
    tensor: Any = None
    device_ptr: int = 0
    _ipc_key: Any = None
    cuda: bool = False  # GPU memory; stays True after release (the tensor is dropped then)
    # Regions made by create(): the memfd (open until release or close; the client may resize it
    # like any file, and the server then refuses the region) and its name in /proc/<pid>/maps.
    fd: int = -1
    memfd_name: str = ""
    # The session's secret, sent beside its id with each request that names the region.
    session_secret: str = ""

    @property
    def map_name(self) -> str:
        """How the region's memory shows in /proc/<pid>/maps (of this process and the server)."""
        return f"/memfd:{self.memfd_name} " if self.memfd_name else "/dev/shm" + self.shm_name

    @property
    def is_cuda(self) -> bool:
        """True for a region of GPU memory (registered by register_cuda), released or not."""
        return self.cuda

    def ndarray(self, shape, dtype, offset: int = 0) -> np.ndarray:
        """A numpy view of the region's bytes from `offset`, of `shape` and `dtype` (no copy)."""
        if self.is_cuda:
            raise TypeError(f"region '{self.name}' is GPU memory: use region.tensor_view(shape, dtype, offset)")
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"{n} bytes at offset {offset} do not fit region '{self.name}' of {self.nbytes} bytes")
        return self.array[offset:offset + n].view(dt).reshape(shape)

    def tensor_view(self, shape, dtype, offset: int = 0):
        """CUDA regions: a torch view of the region's bytes from `offset`, of `shape` and torch `dtype`."""
        if not self.is_cuda:
            raise TypeError(f"region '{self.name}' is host shared memory: use region.ndarray(shape, dtype, offset)")
        import torch

        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"{n} bytes at offset {offset} do not fit region '{self.name}' of {self.nbytes} bytes")
        flat = self.tensor.detach().reshape(-1).view(torch.uint8)
        return flat[offset:offset + n].view(dtype).reshape(shape)

    def offset_of(self, arr: Any) -> int:
        """Byte offset of the C-contiguous array `arr` within this region (ValueError if it is not in it);
        for a CUDA region, `arr` is a contiguous torch tensor on the region's device."""
        if self.is_cuda:
            from ._arrays import is_torch_tensor

            # A released region has dropped its tensor: the request still names it, and the server
            # answers NOT_FOUND.
            if not is_torch_tensor(arr) or (self.tensor is not None and arr.device != self.tensor.device):
                where = self.tensor.device if self.tensor is not None else "a GPU"
                raise ValueError(f"region '{self.name}' is memory of {where}: the array must be a "
                                 "torch tensor on that device inside it")
            if not arr.is_contiguous():
                raise ValueError("an array in a region must be C-contiguous")
            off = int(arr.data_ptr()) - self.device_ptr
            nbytes = arr.numel() * arr.element_size()
            if off < 0 or off + nbytes > self.nbytes:
                raise ValueError(f"the tensor is not inside CUDA region '{self.name}'")
            return off
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
        # Proves on the data plane and the shm socket that a connection belongs to this session.
        self.secret: str = first.session_secret
        self.shm_socket: str = first.shm_socket
        if not self.session_id:
            raise _lce_error(grpc.StatusCode.INTERNAL, "the server's first session message has no session_id")

    def _next(self, what: str):
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

    def register_fd(self, fd: int, byte_size: int, offset: int = 0, name: str = "") -> int:
        """Hands `byte_size` bytes from `offset` of the file `fd` (a memfd, or an shm object opened
        read-write; this process keeps its descriptor) to the server over its shm socket; returns the
        region id. FAILED_PRECONDITION: the server has no shm socket; UNAVAILABLE: it is not on this host."""
        if not self.shm_socket:
            raise _lce_error(grpc.StatusCode.FAILED_PRECONDITION, "the server has no shm socket (lce_server "
                             "--shm-socket) to hand shared memory to", "RegisterRegion")
        label = (name or "memfd").encode()[:SHM_SOCKET_MAX_NAME]
        head = SHM_SOCKET_REQUEST.pack(b"LCF1", len(label), self.session_id.encode("ascii"),
                                       self.secret.encode("ascii"), int(offset), int(byte_size)) + label
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(30)
                sock.connect(self.shm_socket)
                sent = socket.send_fds(sock, [head], [fd])  # the descriptor goes with the first byte
                if sent < len(head):
                    sock.sendall(head[sent:])
                reply = _recv_exactly(sock, SHM_SOCKET_REPLY.size)
                code, length, region_id = SHM_SOCKET_REPLY.unpack(reply)
                message = _recv_exactly(sock, length).decode("utf-8", "replace")
        except OSError as e:
            raise _lce_error(grpc.StatusCode.UNAVAILABLE, f"shm socket {self.shm_socket}: {e} (the server must run "
                             "on this host)", "RegisterRegion") from e
        if code != 0:
            raise _lce_error(grpc.StatusCode(_code_tuple(code)), message, "RegisterRegion")
        return int(region_id)

    def register(self, shm_name: str, byte_size: int, offset: int = 0, name: str = "") -> int:
        """Registers an existing shm object (e.g. made by another library) by its name; returns the region
        id. Only servers started with --allow-shm-by-name accept it (PERMISSION_DENIED otherwise): hand
        the object over with register_fd() instead."""
        r = self._ask(pb.SessionRequest(register_region=pb.RegisterRegion(
            name=name or shm_name, shm_name=shm_name, offset=offset, byte_size=byte_size)), "RegisterRegion")
        return int(r.region_id)

    def register_cuda_ipc(self, handle: bytes, byte_size: int, offset: int = 0, name: str = "") -> int:
        """Registers `byte_size` bytes from `offset` of a CUDA allocation of this process, given the
        64-byte cudaIpcMemHandle_t of the allocation (from cudaIpcGetMemHandle; offset counts from the
        allocation's start); returns the region id. Low level: register_cuda(tensor) does this for a
        torch tensor and returns a Region usable in requests. Servers without CUDA answer UNIMPLEMENTED."""
        handle = bytes(handle)
        if len(handle) != CUDA_IPC_HANDLE_SIZE:
            raise ValueError(f"a cudaIpcMemHandle_t has {CUDA_IPC_HANDLE_SIZE} bytes, got {len(handle)}")
        r = self._ask(pb.SessionRequest(register_region=pb.RegisterRegion(
            name=name or "cuda-ipc", cuda_ipc_handle=handle, offset=offset, byte_size=byte_size)), "RegisterRegion")
        return int(r.region_id)

    def register_cuda(self, tensor, name: str = "") -> Region:
        """Registers the GPU memory of a contiguous torch CUDA tensor (CUDA IPC, no copies): pass the
        returned region as hidden_region= (with the tensor itself, or a contiguous slice of it, as
        `hidden`) or d_hidden_region= (d_hidden is then written into the tensor's memory and returned
        as a view of it). The region holds a reference to the tensor until it is released or the
        session closed (do not resize or free its storage meanwhile). The client synchronizes the
        device's current CUDA stream before each request that uses the region; work on other streams
        must be synchronized by the caller (torch.cuda.synchronize()). CUDA IPC shares the whole
        cudaMalloc block that holds the tensor with the server process."""
        from ._arrays import is_torch_tensor

        if not is_torch_tensor(tensor) or tensor.device.type != "cuda":
            raise TypeError("register_cuda takes a torch tensor on a CUDA device")
        if not tensor.is_contiguous():
            raise ValueError("register_cuda needs a contiguous tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= 0:
            raise ValueError("register_cuda needs a non-empty tensor")
        share = tensor.untyped_storage()._share_cuda_()
        # (device, handle, storage_size_bytes, storage_offset_bytes, ref_counter_handle, ref_counter_offset,
        #  event_handle, event_sync_required)
        raw = _cuda_ipc_handle(share[1])
        offset = int(share[3]) + int(tensor.storage_offset()) * tensor.element_size()
        key = (share[4], share[5]) if share[4] is not None else None
        label = name or f"cuda:{tensor.device.index}:{tensor.data_ptr():#x}"
        rid = self.register_cuda_ipc(raw, nbytes, offset=offset, name=label)
        if key is not None:
            with _IPC_LOCK:
                if key in _IPC_RELEASED:
                    key = None  # torch's counter was given back already: the tensor's lifetime rules
                else:
                    _IPC_LIVE[key] = _IPC_LIVE.get(key, 0) + 1
        region = Region(rid, self.session_id, label, "", nbytes, None, None, cuda=True, tensor=tensor,
                        session_secret=self.secret,
                        device_ptr=int(tensor.data_ptr()), _ipc_key=key)
        self._regions.append(region)
        return region

    def allocate_server_memory(self, byte_size: int, name: str = "") -> int:
        """Has the server allocate `byte_size` bytes of its own memory for this session (GPU memory on a
        GPU server, pinned host memory otherwise), for remote clients to fill and drain over the data
        plane (lce_client._data_plane; Client(data_plane=True) does all this itself). Returns the
        region id; the memory goes with the region (unregister) or the session. FAILED_PRECONDITION:
        the server has no data plane; RESOURCE_EXHAUSTED: beyond its per-session limit."""
        if byte_size <= 0:
            raise ValueError("byte_size must be positive")
        r = self._ask(pb.SessionRequest(register_region=pb.RegisterRegion(
            name=name or "server-memory", server_memory=True, byte_size=byte_size)), "RegisterRegion")
        return int(r.region_id)

    def unregister(self, region_id: int) -> None:
        self._ask(pb.SessionRequest(unregister_region=pb.UnregisterRegion(region_id=region_id)), "UnregisterRegion")

    def create(self, nbytes: int, name: str = "") -> Region:
        """Creates shared memory of `nbytes` (a memfd: no name another process could open), maps it here
        and hands it to the server as a file descriptor."""
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        label = f"lce-{os.getpid()}-{next(_COUNTER)}-{os.urandom(4).hex()}"
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        try:
            rid = self.register_fd(fd, nbytes, name=name or label)
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        region = Region(rid, self.session_id, name or label, "", nbytes, np.frombuffer(mm, dtype=np.uint8), mm,
                        session_secret=self.secret,
                        fd=fd, memfd_name=label)
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
                _forget(region)

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
            _forget(r)
        self._regions.clear()

    def cancel(self) -> None:
        """Cancels the session stream, as a client that goes away would (regions stay linked here; the
        memory of CUDA regions stays reserved by PyTorch, as the server may still have it open)."""
        self._closed = True
        self._call.cancel()
        self._requests.put(None)

    def __enter__(self) -> "SharedMemorySession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _forget(region: Region) -> None:
    """After the server has let go of a region: close its memfd (the mapping stays valid), or give back
    torch's IPC reference of its storage (once the last region over it is gone) and drop the tensor."""
    if not region.is_cuda:
        fd, region.fd = region.fd, -1
        if fd >= 0:
            os.close(fd)
        return
    key, region._ipc_key = region._ipc_key, None
    region.tensor = None
    if key is None:
        return
    with _IPC_LOCK:
        left = _IPC_LIVE.get(key, 1) - 1
        if left > 0:
            _IPC_LIVE[key] = left
            return
        _IPC_LIVE.pop(key, None)
        _IPC_RELEASED.add(key)
    try:
        import torch

        torch.UntypedStorage._release_ipc_counter_cuda(key[0], key[1])
    except Exception:  # best effort, as torch's own consumers do
        pass


def _cuda_ipc_handle(handle) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside torch's storage handle: raw in older torch; newer torch
    writes a version byte and a type byte ('c': a cudaMalloc block) before it."""
    b = bytes(handle)
    if len(b) == CUDA_IPC_HANDLE_SIZE:
        return b
    if len(b) == CUDA_IPC_HANDLE_SIZE + 2 and b[1] == ord("c"):
        return b[2:]
    if len(b) >= 2 and b[1] == ord("e"):
        raise ValueError("the tensor lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
                         "True), which has no cudaIpcMemHandle_t: allocate it with expandable segments off")
    raise ValueError(f"unrecognised CUDA IPC handle from torch ({len(b)} bytes)")


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError("the server closed the shm socket early")
        out += got
    return bytes(out)


def _code_tuple(code: int):
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.value
    return grpc.StatusCode.UNKNOWN.value


def _lce_error(code, details, rpc=""):
    return LceError(code, details, rpc)
