"""CUDA IPC regions (RegisterRegion.cuda_ipc_handle): a CPU server refuses them with UNIMPLEMENTED (and the
session goes on); on a machine with a GPU, a server with --backend=cuda reads hidden states from, and
writes d_hidden into, the client's torch CUDA tensors, with the same answers as the bytes path (also for
tensors at offsets inside their allocation, for split requests, and through the torch wrappers), and a
released tensor's memory goes back to PyTorch's allocator."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

import lce_client
from lce_client._shm import _cuda_ipc_handle
from conftest import HIDDEN, VOCAB, make_weight, requires_torch, write_safetensors

try:
    import torch

    HAVE_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    torch = None
    HAVE_CUDA = False

requires_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA GPU visible to torch (torch.cuda.is_available() "
                                   "is False): the CUDA IPC path needs a GPU and a server with --backend=cuda")


# ------------------------------------------------------------------------------------------------ CPU
def test_cuda_ipc_region_on_a_cpu_server_is_unimplemented(heads):
    head = heads["fp32"]
    st, _ = head.hidden(4, seed=1)
    y = np.array([1, 2, 3, 4])
    with head.client() as c, c.shared_memory_session() as s:
        with pytest.raises(lce_client.LceError) as ei:
            s.register_cuda_ipc(bytes(64), 1024, name="fake")
        assert ei.value.code == grpc.StatusCode.UNIMPLEMENTED, ei.value
        assert "fake" in ei.value.details
        # the session goes on: host regions still work
        region = s.create(st.nbytes)
        h = region.ndarray(st.shape, st.dtype)
        h[...] = st
        np.testing.assert_array_equal(c.score(h, y, hidden_region=region)[0], c.score(st, y)[0])


def test_cuda_ipc_handle_checks():
    with pytest.raises(ValueError, match="64 bytes"):
        lce_client.SharedMemorySession.register_cuda_ipc(None, b"\0" * 10, 16)
    raw = bytes(range(64))
    assert _cuda_ipc_handle(raw) == raw                              # older torch: the bare handle
    assert _cuda_ipc_handle(b"\x02c" + raw) == raw                   # newer torch: version, type 'c', handle
    with pytest.raises(ValueError, match="expandable"):
        _cuda_ipc_handle(b"\x02e" + raw + b"\0" * 20)
    with pytest.raises(ValueError):
        _cuda_ipc_handle(b"\0" * 7)


@requires_torch
def test_register_cuda_needs_a_cuda_tensor(heads):
    with heads["fp32"].client() as c, c.shared_memory_session() as s:
        with pytest.raises(TypeError, match="CUDA"):
            s.register_cuda(torch.zeros(4, HIDDEN))
        with pytest.raises(TypeError):
            s.register_cuda(np.zeros((4, HIDDEN), np.float32))


# ------------------------------------------------------------------------------------------------ GPU
@pytest.fixture(scope="module")
def cuda_head(tmp_path_factory):
    """A bf16 head served by `lce_server --backend=cuda` (skips, saying why, where that cannot start)."""
    if not HAVE_CUDA:
        pytest.skip("no CUDA GPU visible to torch")
    from conftest import Head, Server

    workdir = tmp_path_factory.mktemp("cuda_ipc")
    w = make_weight("bf16", seed=77)
    path = workdir / "head_bf16.safetensors"
    write_safetensors(path, {"lm_head.weight": (w, "BF16")})
    try:
        srv = Server([f"--head-file={path}", "--head-tensor=lm_head.weight", "--backend=cuda", "--device=0"],
                     workdir, "cuda_ipc")
    except RuntimeError as e:
        pytest.skip(f"lce_server did not start with --backend=cuda (a build without CUDA?): {e}")
    try:
        yield Head("bf16", srv, w)
    finally:
        srv.stop()


def _batch(rows, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)
    y = torch.randint(0, VOCAB, (rows,), generator=g)
    y[::9] = -100
    return h, y


def _same(a, b, what, rtol=0.0, atol=0.0):
    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@requires_cuda
def test_cuda_ipc_answers_equal_bytes_path(cuda_head):
    rows = 301
    h_cpu, y = _batch(rows, 1)
    dev = torch.device("cuda", 0)
    gl = torch.randn(rows, generator=torch.Generator().manual_seed(2))
    ge = torch.randn(rows, generator=torch.Generator().manual_seed(3))
    with cuda_head.client(chunk_bytes=64 * HIDDEN * 2) as c, c.shared_memory_session() as s:
        # the hidden states 3 rows into a larger tensor, which itself starts 5 rows into its storage
        base = torch.zeros(rows + 10, HIDDEN, dtype=torch.bfloat16, device=dev)
        big = base[5:]
        assert big.storage_offset() == 5 * HIDDEN
        region = s.register_cuda(big)
        assert region.is_cuda and region.nbytes == big.numel() * 2
        h = big[3:3 + rows]
        h.copy_(h_cpu.to(dev))
        out_t = torch.full((rows + 4, HIDDEN), float("nan"), dtype=torch.bfloat16, device=dev)
        out = s.register_cuda(out_t)

        lp0, ent0 = c.score(h_cpu, y)
        lp1, ent1 = c.score(h, y.to(dev), hidden_region=region)
        assert lp1.device == dev
        _same(lp1, lp0, "logprobs")
        _same(ent1, ent0, "entropy")

        r0 = c.forward_backward(h_cpu, y, return_logprobs=True)
        r1 = c.forward_backward(h, y.to(dev), return_logprobs=True, hidden_region=region, d_hidden_region=out,
                                d_hidden_offset=2 * HIDDEN * 2)
        assert r1.loss == pytest.approx(r0.loss, rel=1e-6) and r1.valid_tokens == r0.valid_tokens
        _same(r1.per_token_loss, r0.per_token_loss, "per_token_loss", rtol=1e-6, atol=1e-6)
        assert r1.d_hidden.device == dev and r1.d_hidden.dtype == torch.bfloat16
        assert r1.d_hidden.data_ptr() == out_t[2:].data_ptr(), "d_hidden is a view of the registered tensor"
        _same(r1.d_hidden, r0.d_hidden, "d_hidden", rtol=1e-2, atol=1e-6)
        _same(out_t[2:2 + rows], r0.d_hidden, "d_hidden in place", rtol=1e-2, atol=1e-6)
        assert torch.isnan(out_t[:2].float()).all() and torch.isnan(out_t[2 + rows:].float()).all()

        d0 = c.backward(h_cpu, y, gl, ge)
        d1 = c.backward(h, y, gl, ge, hidden_region=region, d_hidden_region=out)
        _same(d1, d0, "backward d_hidden", rtol=1e-2, atol=1e-6)
        d2 = c.backward(h, y, gl, ge, hidden_region=region)  # d_hidden over the wire, to the GPU
        _same(d2, d0, "backward d_hidden (wire)", rtol=1e-2, atol=1e-6)

        adv = torch.randn(rows, generator=torch.Generator().manual_seed(4))
        p0 = c.policy_loss(h_cpu, y, r0.logprobs, adv)
        p1 = c.policy_loss(h, y, r0.logprobs, adv, hidden_region=region, d_hidden_region=out)
        assert p1.loss == pytest.approx(p0.loss, rel=1e-5, abs=1e-7)
        _same(p1.d_hidden, p0.d_hidden, "policy d_hidden", rtol=1e-2, atol=1e-6)

        # split over three streams, still reading the GPU memory
        c3 = cuda_head.client(chunk_bytes=32 * HIDDEN * 2, streams=3, min_stream_bytes=64 * HIDDEN * 2)
        r3 = c3.forward_backward(h, y, hidden_region=region, d_hidden_region=out)
        assert r3.loss == pytest.approx(r0.loss, rel=1e-6)
        _same(r3.d_hidden, r0.d_hidden, "split d_hidden", rtol=1e-2, atol=1e-6)
        c3.close()

        # a tensor outside the region, and a host array with a CUDA region, are refused here
        with pytest.raises(ValueError):
            c.score(torch.zeros_like(h), y, hidden_region=region)
        with pytest.raises(TypeError):
            c.score(h_cpu, y, hidden_region=region)

        s.release(region)
        with pytest.raises(lce_client.LceError) as ei:
            c.score(h, y, hidden_region=region)
        assert ei.value.code == grpc.StatusCode.NOT_FOUND


@requires_cuda
def test_torch_wrappers_over_cuda_ipc(cuda_head):
    from lce_client.torch import RemoteLinearCrossEntropy, remote_logprobs

    rows = 130
    h_cpu, y = _batch(rows, 5)
    dev = torch.device("cuda", 0)
    with cuda_head.client() as c, c.shared_memory_session() as s:
        grads = []
        for session in (None, s):
            h = h_cpu.to(dev).float().requires_grad_(True)  # fp32 in: cast to the head's bf16 for the server
            loss = RemoteLinearCrossEntropy(c, cuda_session=session)(h, y.to(dev))
            lp, ent = remote_logprobs(h, y.to(dev), c, cuda_session=session)
            (loss + (lp * 0.3).sum() - 0.01 * ent.sum()).backward()
            grads.append((float(loss), h.grad.clone()))
        assert grads[1][0] == pytest.approx(grads[0][0], rel=1e-6)
        _same(grads[1][1], grads[0][1], "hidden.grad", rtol=2e-2, atol=1e-5)


@requires_cuda
def test_released_cuda_region_gives_its_memory_back(cuda_head):
    dev = torch.device("cuda", 0)
    with cuda_head.client() as c, c.shared_memory_session() as s:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
        t = torch.ones(16 << 20, dtype=torch.float32, device=dev)  # 64 MiB, a cudaMalloc block of its own
        region = s.register_cuda(t)
        s.release(region)
        del t, region
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated(dev) == before, "the block stayed in torch's IPC limbo"
