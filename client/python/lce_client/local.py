"""Helpers for running an lce_server next to the caller (examples, tests, notebooks), a group of ranks
against one (run_on_ranks), and for writing heads as safetensors files.

    with LocalServer(["--seed-head=32000x512", "--head-dtype=bf16"]) as srv:
        client = Client(srv.target)
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

_ST_DTYPES = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<u2"): "BF16"}


def find_server_binary(explicit: Optional[str] = None) -> str:
    """$LCE_SERVER_BIN, else `lce_server` on PATH, else build/bin/lce_server in the current directory,
    the running script's directory, or one above them (the repository's build)."""
    for cand in (explicit, os.environ.get("LCE_SERVER_BIN")):
        if cand:
            return cand
    on_path = shutil.which("lce_server")
    if on_path:
        return on_path
    here = Path.cwd()
    script = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] else here
    for d in [here, *here.parents, script, *script.parents]:
        p = d / "build" / "bin" / "lce_server"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    raise FileNotFoundError("lce_server not found: set LCE_SERVER_BIN, put it on PATH, or build it (ninja -C build)")


class LocalServer:
    """Starts `lce_server --port=0 --port-file=...` on 127.0.0.1 and waits until it serves; SIGTERM on
    stop(). `args` are extra flags (e.g. the head: --seed-head=VxH or --head-file=PATH)."""

    def __init__(self, args: Sequence[str] = (), binary: Optional[str] = None, backend: str = "cpu",
                 startup_timeout: float = 60.0, log_path: Optional[str] = None):
        self._tmp = tempfile.TemporaryDirectory(prefix="lce_server_")
        port_file = Path(self._tmp.name) / "port"
        self.log_path = log_path or str(Path(self._tmp.name) / "server.log")
        self._log = open(self.log_path, "w")
        cmd = [find_server_binary(binary), "--host=127.0.0.1", "--port=0", f"--port-file={port_file}",
               f"--backend={backend}", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + startup_timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"lce_server exited with {self.proc.returncode}:\n{Path(self.log_path).read_text()}")
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"lce_server did not start within {startup_timeout}s")
            time.sleep(0.02)
        self.port = int(port_file.read_text().strip())
        self.target = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        self._tmp.cleanup()

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_on_ranks(fn: Callable, world_size: int, target: Optional[str] = None, args: tuple = (),
                 server_args: Sequence[str] = ("--seed-head=8x8", "--cpu-threads=1")) -> None:
    """Runs fn(rank, world_size, init_method, target, *args) on every rank of a torch.distributed group
    (the tensor-parallel examples and benchmarks). Under torchrun (RANK in the environment) this process
    is one rank: fn runs once with init "env://", and `target` (a running server) is required. Otherwise
    fn runs in `world_size` spawned processes meeting through a file:// store, against `target`, or with
    none against a LocalServer(server_args) started here and stopped when they end."""
    if "RANK" in os.environ:
        if not target:
            raise SystemExit("under torchrun, pass --target (a running lce_server)")
        fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", target, *args)
        return
    import torch.multiprocessing

    with tempfile.TemporaryDirectory(prefix="lce_ranks_") as tmp:
        server = None if target else LocalServer(server_args)
        try:
            if server is not None:
                print(f"started lce_server at {server.target} (CPU engine)", file=sys.stderr)
            torch.multiprocessing.spawn(fn, args=(world_size, f"file://{tmp}/store", target or server.target, *args),
                                        nprocs=world_size, join=True)
        finally:
            if server is not None:
                server.stop()


def write_safetensors(path: str, tensors: dict) -> None:
    """Writes {name: array} as a safetensors file. Arrays: float32, float16, or uint16 holding bf16 bits
    (or torch tensors of float32 / float16 / bfloat16)."""
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        if hasattr(arr, "detach"):
            import torch

            t = arr.detach().to("cpu").contiguous()
            arr = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
        arr = np.ascontiguousarray(arr)
        st = _ST_DTYPES.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if st is None:
            raise TypeError(f"{name}: unsupported dtype {arr.dtype}")
        raw = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


_NP_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def read_safetensors(path: str) -> dict:
    """{name: array} of a safetensors file (float32, float16, or bf16 as uint16 bits), without copying
    more than the file's bytes."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, m in header.items():
        if name == "__metadata__":
            continue
        if m["dtype"] not in _NP_DTYPES:
            raise TypeError(f"{path}: {name} is {m['dtype']}, not F32, F16 or BF16")
        a, b = m["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=_NP_DTYPES[m["dtype"]]).reshape(m["shape"])
    return out


def read_saved_head(index_file: str, tensor: str = "lm_head.weight") -> np.ndarray:
    """The weight [vocab, hidden] of a head written by SaveHead (Client.save_head's index file): its shards
    in row order, as float32 (bf16 and fp16 converted)."""
    index = json.loads(Path(index_file).read_text())
    parts = []
    for shard in index["shards"]:
        arr = read_safetensors(str(Path(index_file).parent / shard["file"]))[tensor]
        if arr.dtype == np.uint16:
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        parts.append(arr.astype(np.float32))
    return np.concatenate(parts)
