"""Conversions between the caller's arrays (numpy or torch) and the wire format.

Hidden states travel as raw little-endian bytes of the head's dtype; the client never makes a copy of
the whole batch: it takes a flat uint8 view of a C-contiguous host array and hands out memoryview
slices of it, one per chunk.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ._proto import lce_pb2 as pb

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("lce_client needs a little-endian host (the wire format is little-endian)")

# Wire dtype <-> short name <-> numpy storage dtype (bf16 is stored as uint16 in numpy).
_DTYPE_NAMES = {pb.DTYPE_FLOAT32: "fp32", pb.DTYPE_BFLOAT16: "bf16", pb.DTYPE_FLOAT16: "fp16"}
_NAME_TO_DTYPE = {
    "fp32": pb.DTYPE_FLOAT32, "float32": pb.DTYPE_FLOAT32, "f32": pb.DTYPE_FLOAT32,
    "bf16": pb.DTYPE_BFLOAT16, "bfloat16": pb.DTYPE_BFLOAT16,
    "fp16": pb.DTYPE_FLOAT16, "float16": pb.DTYPE_FLOAT16, "f16": pb.DTYPE_FLOAT16, "half": pb.DTYPE_FLOAT16,
}
_STORAGE = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_BFLOAT16: np.dtype("<u2"), pb.DTYPE_FLOAT16: np.dtype("<f2")}


def dtype_name(wire: int) -> str:
    return _DTYPE_NAMES.get(wire, "unspecified")


def parse_dtype(d: Any) -> int:
    """A wire DType from 'bf16' / 'fp16' / 'fp32', a numpy dtype, a torch dtype or a DType value."""
    if isinstance(d, int) and d in _DTYPE_NAMES:
        return d
    if isinstance(d, str):
        key = d.lower()
        if key in _NAME_TO_DTYPE:
            return _NAME_TO_DTYPE[key]
        raise ValueError(f"unknown dtype {d!r}: use bf16, fp16 or fp32")
    name = str(d).replace("torch.", "")
    if name in _NAME_TO_DTYPE:
        return _NAME_TO_DTYPE[name]
    raise TypeError(f"unsupported hidden dtype {d}: lce-serve takes bf16, fp16 or fp32")


def is_torch_tensor(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "detach") and hasattr(x, "device")


@dataclass
class HostArray:
    """A caller's hidden-state array as C-contiguous host memory of the wire dtype."""

    array: np.ndarray          # [rows, hidden] in storage dtype (uint16 for bf16)
    wire_dtype: int
    lead_shape: tuple          # the caller's leading dims (rows = prod(lead_shape))
    kind: str                  # "numpy" or "torch"
    device: Any = None         # torch device of the caller's tensor
    torch_dtype: Any = None    # torch dtype of the caller's tensor
    keepalive: Any = None      # the host tensor whose memory `array` views

    @property
    def rows(self) -> int:
        return self.array.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.array.shape[1]

    @property
    def itemsize(self) -> int:
        return self.array.itemsize

    def byte_view(self) -> memoryview:
        """A flat memoryview of the rows' bytes (no copy)."""
        return memoryview(self.array.reshape(-1).view(np.uint8))


@dataclass
class DeviceArray:
    """A caller's hidden states left in GPU memory (a contiguous torch CUDA tensor, not copied): for
    requests whose hidden states the server reads from a registered CUDA IPC region."""

    tensor: Any                # [rows, hidden] view of the caller's tensor, of the wire dtype
    wire_dtype: int
    lead_shape: tuple
    kind: str = "torch"
    device: Any = None
    torch_dtype: Any = None

    @property
    def rows(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.tensor.shape[1])

    @property
    def itemsize(self) -> int:
        return int(self.tensor.element_size())

    def byte_view(self) -> memoryview:  # pragma: no cover - guarded by the callers
        raise TypeError("hidden states in GPU memory travel through a CUDA IPC region, not as bytes")


def device_hidden(hidden: Any) -> DeviceArray:
    """Wraps a contiguous torch CUDA tensor [..., H] without copying it (for CUDA IPC regions)."""
    if not is_torch_tensor(hidden) or hidden.device.type != "cuda":
        raise TypeError("hidden_region is a CUDA region: pass the torch CUDA tensor that lies in it as hidden "
                        f"(got {type(hidden).__name__}"
                        f"{' on ' + str(hidden.device) if is_torch_tensor(hidden) else ''})")
    t = hidden.detach()
    if t.dim() < 1:
        raise ValueError("hidden must have shape [..., hidden_size]")
    if not t.is_contiguous():
        raise ValueError("hidden in a CUDA region must be contiguous")
    wire = parse_dtype(t.dtype)
    return DeviceArray(t.reshape(-1, t.shape[-1]), wire, tuple(t.shape[:-1]), "torch", t.device, t.dtype)


def host_hidden(hidden: Any, dtype: Optional[Any] = None) -> HostArray:
    """Wraps `hidden` ([..., H], numpy or torch, any device) as host memory without copying where it can.

    `dtype` names the wire dtype for numpy arrays that hold raw bf16 bits as uint16/int16.
    """
    if is_torch_tensor(hidden):
        import torch

        t = hidden.detach()
        if t.dim() < 1:
            raise ValueError("hidden must have shape [..., hidden_size]")
        wire = parse_dtype(t.dtype)
        device, tdtype = t.device, t.dtype
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()
        if wire == pb.DTYPE_BFLOAT16:
            arr = t.view(torch.int16).numpy().view(np.uint16)
        else:
            arr = t.numpy()
        lead = tuple(t.shape[:-1])
        return HostArray(arr.reshape(-1, arr.shape[-1]), wire, lead, "torch", device, tdtype, t)
    arr = np.asarray(hidden)
    if arr.ndim < 1:
        raise ValueError("hidden must have shape [..., hidden_size]")
    if dtype is not None:
        wire = parse_dtype(dtype)
        want = _STORAGE[wire]
        if arr.dtype.itemsize != want.itemsize or arr.dtype.kind not in ("f", "u", "i", "V"):
            raise TypeError(f"hidden of numpy dtype {arr.dtype} cannot carry {dtype_name(wire)} values")
        if arr.dtype.kind == "f" and arr.dtype != want:
            raise TypeError(f"hidden is {arr.dtype}, not {dtype_name(wire)}")
    elif arr.dtype == np.float32:  # (the cheap comparisons first: small calls are made at high rates)
        wire = pb.DTYPE_FLOAT32
    elif arr.dtype == np.uint16 or arr.dtype.name == "bfloat16":  # raw bf16 bits, or ml_dtypes.bfloat16
        wire = pb.DTYPE_BFLOAT16
    elif arr.dtype == np.float16:
        wire = pb.DTYPE_FLOAT16
    else:
        raise TypeError(
            f"unsupported hidden dtype {arr.dtype}: send float32 or float16 numpy arrays, raw bf16 bits as "
            "uint16, or torch tensors"
        )
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    lead = tuple(arr.shape[:-1])
    flat = arr.reshape(-1, arr.shape[-1]).view(_STORAGE[wire])
    return HostArray(flat, wire, lead, "numpy")


_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)  # (np.iinfo is slow to make)


def _fits_int32(arr: np.ndarray) -> bool:
    if arr.size <= 64:  # (small calls come at high rates: Python beats two numpy reductions on a few values)
        vals = arr.ravel().tolist()
        return _INT32_MIN <= min(vals) and max(vals) <= _INT32_MAX
    return bool(arr.max() <= _INT32_MAX and arr.min() >= _INT32_MIN)


def host_rows(x: Any, rows: int, what: str, np_dtype, lead_shape: tuple) -> np.ndarray:
    """A per-row array (targets or upstream grads) as a flat C-contiguous numpy array of `rows`."""
    if is_torch_tensor(x):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.to("cpu")
        if np_dtype == np.float32:
            import torch

            x = x.to(torch.float32)
        x = x.contiguous().numpy()
    arr = np.asarray(x)
    if arr.size != rows:
        raise ValueError(f"{what} has {arr.size} elements, hidden has {rows} rows (shape {lead_shape})")
    if np_dtype == np.int32:
        if arr.dtype.kind not in ("i", "u"):
            raise TypeError(f"{what} must be integer token ids, got {arr.dtype}")
        if arr.size and arr.dtype.itemsize >= 4 and arr.dtype != np.int32 and not _fits_int32(arr):
            raise ValueError(f"{what} does not fit int32")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np_dtype)


def new_rows_out(rows: int) -> np.ndarray:
    return np.zeros(rows, dtype=np.float32)


# The per-row answers a ChunkResult may carry: name -> (dtype, values a row: 1, or the header's top_k).
ROW_OUTPUTS = {"logprobs": (np.float32, 1), "entropy": (np.float32, 1), "loss": (np.float32, 1),
               "z_loss": (np.float32, 1), "argmax": (np.int32, 1), "top_tokens": (np.int32, "k"),
               "top_logprobs": (np.float32, "k")}


def new_outputs(rows: int, top_k: int) -> dict:
    """A request's per-row answers, zeroed, filled chunk by chunk as they arrive."""
    return {name: np.zeros((rows,) if width == 1 else (rows, top_k), dtype=dt)
            for name, (dt, width) in ROW_OUTPUTS.items()}


def new_hidden_out(rows: int, hidden_size: int, wire: int) -> np.ndarray:
    return np.empty((rows, hidden_size), dtype=_STORAGE[wire])


def storage_dtype(wire: int) -> np.dtype:
    return _STORAGE[wire]


def torch_dtype(wire: int):
    """The torch dtype of a wire dtype (imports torch)."""
    import torch

    return {pb.DTYPE_FLOAT32: torch.float32, pb.DTYPE_BFLOAT16: torch.bfloat16, pb.DTYPE_FLOAT16: torch.float16}[wire]


def to_caller_rows(arr: np.ndarray, like: HostArray):
    """Per-row outputs ([rows] or [rows, k]) in the caller's kind and row shape ([...] or [..., k]): numpy, or a
    torch tensor on the caller's device."""
    arr = arr.reshape(tuple(like.lead_shape) + arr.shape[1:])
    if like.kind == "torch":
        import torch

        t = torch.from_numpy(arr)
        return t.to(like.device) if like.device is not None and like.device.type != "cpu" else t
    return arr


def to_caller_hidden(arr: np.ndarray, like: HostArray):
    """d_hidden in the caller's kind: numpy of the wire dtype (uint16 bits for bf16 unless ml_dtypes
    is present), or a torch tensor with the caller's device and dtype. A torch tensor `arr` (d_hidden
    written in place into a CUDA IPC region) is returned as a view, whatever the caller's kind."""
    if is_torch_tensor(arr):
        t = arr.reshape(like.lead_shape + (arr.shape[-1],))
        if like.kind == "torch" and like.torch_dtype is not None and t.dtype != like.torch_dtype:
            t = t.to(like.torch_dtype)
        return t
    arr = arr.reshape(like.lead_shape + (arr.shape[-1],))
    if like.kind == "torch":
        import torch

        if like.wire_dtype == pb.DTYPE_BFLOAT16:
            t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr)
        if like.device is not None and like.device.type != "cpu":
            t = t.to(like.device)
        if like.torch_dtype is not None and t.dtype != like.torch_dtype:
            t = t.to(like.torch_dtype)
        return t
    if like.wire_dtype == pb.DTYPE_BFLOAT16:
        try:
            import ml_dtypes  # optional

            return arr.view(ml_dtypes.bfloat16)
        except ImportError:
            return arr
    return arr


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Helper for numpy users: bf16 bits (uint16) to float32 values."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Helper for numpy users: float32 to bf16 bits (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r
