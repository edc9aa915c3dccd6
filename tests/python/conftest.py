"""Fixtures: the real lce_server binary (CPU engine) on a free port, heads written as safetensors by the
test (so the torch reference has the exact weight), and a float64 torch reference from materialised
logits.

The binary: $LCE_SERVER_BIN, else build/bin/lce_server under the repository root.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lce_client  # noqa: E402
import lce_client.local  # noqa: E402

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:  # pragma: no cover
    HAVE_TORCH = False

requires_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (pip install torch): the "
                                    "reference and the autograd wrappers need it")

VOCAB, HIDDEN = 389, 48
DTYPES = ["fp32", "bf16", "fp16"]
_ST_DTYPE = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}


def server_binary() -> Path:
    env = os.environ.get("LCE_SERVER_BIN")
    p = Path(env) if env else REPO / "build" / "bin" / "lce_server"
    if not p.is_file() or not os.access(p, os.X_OK):
        pytest.fail(f"lce_server binary not found at {p}: build it (ninja -C build lce_server) or set LCE_SERVER_BIN",
                    pytrace=False)
    return p


def to_storage(w32: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the head dtype's storage (uint16 bits for bf16)."""
    if dtype == "fp32":
        return np.ascontiguousarray(w32, dtype=np.float32)
    if dtype == "fp16":
        return np.ascontiguousarray(w32, dtype=np.float16)
    return lce_client.f32_to_bf16_bits(w32)


def to_f64(stored: np.ndarray, dtype: str) -> np.ndarray:
    """The exact values of stored elements, as float64."""
    if dtype == "bf16":
        return lce_client.bf16_bits_to_f32(stored).astype(np.float64)
    return stored.astype(np.float64)


def write_safetensors(path: Path, tensors: dict) -> None:
    """{name: (array, safetensors dtype)} -> file, through the package's own writer (uint16 arrays are
    bf16 bits); the declared dtype must be the one the array's type implies."""
    for name, (arr, st_dtype) in tensors.items():
        implied = {"float32": "F32", "float16": "F16", "uint16": "BF16"}.get(np.asarray(arr).dtype.name)
        assert implied == st_dtype, f"{name}: a {np.asarray(arr).dtype} array is not {st_dtype}"
    lce_client.local.write_safetensors(str(path), {name: arr for name, (arr, _) in tensors.items()})


def _backend_args() -> list:
    """The CPU engine on one thread; LCE_TEST_BACKEND=cuda runs the same tests against a CUDA server (on a
    GPU machine: bench/device.sh py-gpu)."""
    backend = os.environ.get("LCE_TEST_BACKEND", "cpu")
    if backend == "cpu":
        return ["--backend=cpu", "--cpu-threads=1"]
    # The tests compare answers across batchings bit for bit: the CPU engine's default, a CUDA flag.
    return [f"--backend={backend}", "--batch-invariant=true"]


class Server:
    def __init__(self, args, workdir: Path, name: str = "srv"):
        self.port_file = workdir / f"{name}.port"
        self.log_path = workdir / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.port_file.unlink(missing_ok=True)  # a stale file from an earlier server of the same name
        cmd = [str(server_binary()), "--host=127.0.0.1", "--port=0", f"--port-file={self.port_file}",
               *_backend_args(), "--shutdown-grace-seconds=2"] + list(args)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lce_server exited with {self.proc.returncode}: {self.log_path.read_text()}")
            if self.port_file.exists() and self.port_file.read_text().strip():
                break
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"lce_server did not start in 60 s: {self.log_path.read_text()}")
            time.sleep(0.02)
        self.port = int(self.port_file.read_text().strip())
        self.target = f"127.0.0.1:{self.port}"
        # The metrics port, where the args name one.
        self.metrics_port = next((int(a.split("=", 1)[1]) for a in args if a.startswith("--metrics-port=")), None)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class TpGroup:
    """A tensor-parallel group of k lce_server ranks (Gloo over loopback, CPU engine, one thread each),
    every rank started with `args`; `front` is rank 0's Server (k = 1: a plain server)."""

    def __init__(self, args, workdir: Path, name: str, k: int):
        tp = []
        self.peers = []
        if k > 1:
            rdv = workdir / f"{name}_rdv"
            rdv.mkdir(exist_ok=True)
            tp = [f"--tp-size={k}", f"--tp-rendezvous={rdv}"]
        try:
            for r in range(1, k):
                log = open(workdir / f"{name}_r{r}.log", "w")
                self.peers.append((subprocess.Popen([str(server_binary()), "--backend=cpu", "--cpu-threads=1",
                                                     "--host=127.0.0.1", "--port=0", *args, *tp, f"--tp-rank={r}"],
                                                    stdout=log, stderr=subprocess.STDOUT), log))
            self.front = Server([*args, *tp, *(["--tp-rank=0"] if k > 1 else [])], workdir, name)
        except Exception:
            self._stop_peers(kill=True)
            raise
        self.target = self.front.target

    def stop(self):
        """The front stops its peers as it shuts down."""
        self.front.stop()
        self._stop_peers(kill=False)

    def _stop_peers(self, kill: bool):
        for p, log in self.peers:
            if kill:
                p.kill()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()


class Head:
    """A head served by its own lce_server, with its exact weight for the reference."""

    def __init__(self, dtype, server, w_stored, bias=None):
        self.dtype = dtype
        self.server = server
        self.target = server.target
        self.w_stored = w_stored
        self.w64 = to_f64(w_stored, dtype)
        self.bias = bias

    def client(self, **kw) -> "lce_client.Client":
        return lce_client.Client(self.target, timeout=60, **kw)

    def hidden(self, rows, seed=0, scale=1.0, shape=None):
        """Random hidden states in the head's dtype: (storage array for numpy calls, float64 values)."""
        rng = np.random.default_rng(seed)
        h32 = (rng.standard_normal((rows, HIDDEN)) * scale).astype(np.float32)
        st = to_storage(h32, self.dtype)
        if shape is not None:
            st = st.reshape(shape + (HIDDEN,))
        return st, to_f64(st, self.dtype).reshape(-1, HIDDEN)


def make_weight(dtype, seed=1234, vocab=VOCAB, hidden=HIDDEN, scale=0.6):
    rng = np.random.default_rng(seed)
    return to_storage((rng.standard_normal((vocab, hidden)) * scale / np.sqrt(hidden) * 4).astype(np.float32), dtype)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("lce")


def serve_heads(workdir, name: str, seed: int, extra_args=()):
    """Generator for fixtures: one server per dtype, each serving a head (weights seeded `seed` + the
    dtype's index) from a safetensors file this test wrote, with `extra_args` (or what calling it
    returns, anew for each server); yields {dtype: Head} and stops the servers after."""
    out, servers = {}, []
    try:
        for i, dt in enumerate(DTYPES):
            w = make_weight(dt, seed=seed + i)
            path = workdir / f"{name}_{dt}.safetensors"
            write_safetensors(path, {"lm_head.weight": (w, _ST_DTYPE[dt])})
            args = [f"--head-file={path}", "--head-tensor=lm_head.weight",
                    *(extra_args() if callable(extra_args) else extra_args)]
            srv = Server(args, workdir, f"{name}_{dt}")
            servers.append(srv)
            out[dt] = Head(dt, srv, w)
        yield out
    finally:
        for s in servers:
            s.stop()


def targets_for_rows(rows, seed=0, ignore_every=7):
    """Targets uniform in [0, VOCAB) with every `ignore_every`-th row ignored (-100)."""
    y = np.random.default_rng(seed).integers(0, VOCAB, rows).astype(np.int64)
    y[::ignore_every] = -100
    return y


@pytest.fixture(scope="session")
def heads(workdir):
    """One server per dtype, each serving a head from a safetensors file this test wrote."""
    yield from serve_heads(workdir, "head", 100)


@pytest.fixture(params=DTYPES)
def head(request, heads):
    return heads[request.param]


@pytest.fixture
def server_factory(workdir):
    started = []

    def start(args, name="extra"):
        s = Server(args, workdir, f"{name}_{len(started)}")
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


# --------------------------------------------------------------------------------- TLS certificates
def _openssl(*args, cwd):
    import subprocess

    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (apt-get install openssl): no certificates for the TLS test")
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=lce-test-ca",
             cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn in (("server", "localhost"), ("client", "lce-test-client")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", *(["-extfile", "san.ext"] if name == "server" else []), cwd=d)
    return d


# ------------------------------------------------------------------------------ float64 reference
def reference(w64, h64, targets, *, temperature=1.0, softcap=0.0, ignore_index=-100, label_smoothing=0.0,
              z_loss=0.0, bias=None):
    """Materialised logits in float64 torch, as docs/MATH.md; returns a dict of differentiable tensors
    (hidden is a leaf with requires_grad) so tests take gradients by autograd."""
    import torch

    h = torch.tensor(h64, dtype=torch.float64, requires_grad=True)
    W = torch.tensor(w64, dtype=torch.float64)
    y = torch.as_tensor(np.asarray(targets).reshape(-1), dtype=torch.int64)
    a = h @ W.T
    if bias is not None:
        a = a + torch.tensor(bias, dtype=torch.float64)
    z = (softcap * torch.tanh(a / softcap) if softcap else a) / temperature
    lse = torch.logsumexp(z, dim=-1)
    valid = y != ignore_index
    yy = torch.where(valid, y, torch.zeros_like(y))
    lp = torch.where(valid, z.gather(1, yy[:, None])[:, 0] - lse, torch.zeros_like(lse))
    p = torch.softmax(z, dim=-1)
    ent = lse - (p * z).sum(-1)
    loss = -(1 - label_smoothing) * lp + label_smoothing * (lse - z.mean(-1)) + z_loss * lse ** 2
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return {"h": h, "logprobs": lp, "entropy": ent, "loss": loss, "valid": valid, "lse": lse}


def grad_of(scalar, h):
    import torch

    (g,) = torch.autograd.grad(scalar, h, retain_graph=True)
    return g.numpy()


def as_f64(x, dtype=None):
    """numpy / torch (any dtype, bf16 included) -> float64 numpy."""
    if hasattr(x, "detach"):
        import torch

        return x.detach().to("cpu", torch.float64).numpy()
    x = np.asarray(x)
    if dtype == "bf16" or x.dtype == np.uint16:
        return lce_client.bf16_bits_to_f32(x).astype(np.float64)
    return x.astype(np.float64)


def assert_close(got, want, *, rtol, atol, what=""):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = float(np.abs(want).max(initial=0.0))
    err = float(np.abs(got - want).max(initial=0.0))
    assert err <= atol + rtol * scale, f"{what}: max abs error {err:.3g} > {atol} + {rtol}*{scale:.3g}"


# Tolerances for d_hidden by dtype: it is rounded to the dtype on the way back.
GRAD_RTOL = {"fp32": 1e-5, "bf16": 1.2e-2, "fp16": 2e-3}


def serve_weight(client, weight, name: str, bias=None) -> None:
    """The server's head `name` := a torch weight [vocab, hidden] of fp32 / bf16 / fp16 (LoadHead of that
    shape and dtype, then UpdateWeights with the exact values), as a peer project's test initialises its
    own head; its gradient starts at zero."""
    import torch

    V, H = weight.shape
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[weight.dtype]
    client.load_head(name, seeded=(V, H, 0, dtype), bias=bias is not None)
    client.update_weights(weight.detach().cpu().contiguous(), head=name, bias=bias)
    client.zero_grad(head=name)


def own_server_client(workdir, name: str, timeout: float = 120):
    """Generator for module fixtures: a server of the module's own (a placeholder 8x8 head; the tests
    load theirs with serve_weight) and a client of it; the server stops after."""
    srv = Server(["--seed-head=8x8", "--head-dtype=fp32"], workdir, name)
    try:
        with lce_client.Client(srv.target, timeout=timeout) as c:
            yield c
    finally:
        srv.stop()
