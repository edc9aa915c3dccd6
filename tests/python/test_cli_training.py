"""lce_cli's training commands end to end against the real lce_server (CPU engine): a seeded head loaded,
its gradient zeroed, accumulated by a forward-backward with --accumulate-weight-grad, read with get-grad
(.npy, safetensors, raw), stepped, saved and loaded back, and its weight replaced from a file; a head with
a bias (load-head --bias, update-weights --bias-file, get-grad --bias); each step checked against a twin
head driven the same way by the Python client (the CPU engine is deterministic, so the answers are equal
bit for bit), and the admin token."""
from __future__ import annotations

import math
import re
from pathlib import Path

import grpc
import numpy as np
import pytest

import lce_client
import lce_client.local
from helpers import cli

VOCAB, HIDDEN = 96, 48


@pytest.fixture
def server(server_factory):
    return server_factory([f"--seed-head=64x{HIDDEN}", "--head-dtype=fp32"], name="cli_train")


def batch(rows, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, HIDDEN)).astype(np.float32), rng.integers(0, VOCAB, rows).astype(np.int32)


def test_cli_trains_a_head_like_the_python_client(server, tmp_path):
    t = f"--target={server.target}"
    c = lce_client.Client(server.target, timeout=60)
    out = cli("load-head", t, "--head=pol", f"--seeded={VOCAB}x{HIDDEN}", "--seed=4", "--dtype=fp32")
    assert "head 'pol' version 1" in out and f"vocab {VOCAB} x hidden {HIDDEN}" in out, out
    c.load_head("twin", seeded=(VOCAB, HIDDEN, 4, "fp32"))
    probe_h, probe_y = batch(9, seed=1)

    def same_scores():
        a, _ = c.score(probe_h, probe_y, head="pol")
        b, _ = c.score(probe_h, probe_y, head="twin")
        return np.array_equal(a, b)

    assert same_scores()
    # A gradient: zeroed, then accumulated by the CLI's forward-backward from files.
    h, y = batch(21, seed=2)
    h.tofile(tmp_path / "h.raw")
    y.tofile(tmp_path / "y.raw")
    cli("zero-grad", t, "--head=pol")
    out = cli("forward-backward", t, "--head=pol", f"--hidden-file={tmp_path / 'h.raw'}",
              f"--targets-file={tmp_path / 'y.raw'}", "--reduction=sum", "--accumulate-weight-grad=1",
              "--head-version=1")
    c.zero_grad("twin")
    r = c.forward_backward(h, y, reduction="sum", head="twin", accumulate_weight_grad=True)
    assert f"loss (sum) {r.loss:.6f}" in out, out
    want = c.get_grad("twin")
    assert np.abs(want).max() > 0
    for name in ("g.npy", "g.safetensors", "g.raw"):
        out = cli("get-grad", t, "--head=pol", f"--output={tmp_path / name}")
        assert f"{VOCAB} x {HIDDEN} fp32" in out, out
    np.testing.assert_array_equal(np.load(tmp_path / "g.npy"), want)
    np.testing.assert_array_equal(lce_client.local.read_safetensors(tmp_path / "g.safetensors")["grad"], want)
    np.testing.assert_array_equal(np.fromfile(tmp_path / "g.raw", "<f4").reshape(VOCAB, HIDDEN), want)
    np.testing.assert_array_equal(c.get_grad("pol"), want)

    # One AdamW step with clipping and weight decay; the gradient is zeroed after it (--zero-grad=1).
    out = cli("step", t, "--head=pol", "--lr=0.01", "--weight-decay=0.1", "--max-grad-norm=0.5", "--beta2=0.99")
    norm, info, step = c.optimizer_step("twin", lr=0.01, weight_decay=0.1, max_grad_norm=0.5, beta2=0.99)
    m = re.search(r"step (\d+): grad norm (\S+) \(before clipping\); head 'pol' version (\d+)", out)
    assert m, out
    assert (int(m.group(1)), int(m.group(3))) == (step, info.version) == (1, 2)
    assert float(m.group(2)) == pytest.approx(norm, rel=1e-8)
    assert same_scores()
    assert "|dW| 0.000000000e+00" in cli("get-grad", t, "--head=pol")
    cli("forward-backward", t, "--head=pol", "--head-version=1", "--rows=3", code=1)  # version 1 is gone

    # Saved on the server, loaded back under another name: the same head.
    out = cli("save-head", t, "--head=pol", f"--directory={tmp_path / 'saved'}")
    shard = re.search(r"file (\S+)", out).group(1)
    assert Path(shard).is_file() and "index " in out
    cli("load-head", t, "--head=back", f"--safetensors-file={shard}")
    a, _ = c.score(probe_h, probe_y, head="pol")
    b, _ = c.score(probe_h, probe_y, head="back")
    np.testing.assert_array_equal(a, b)


def test_cli_update_weights_from_files(server, tmp_path):
    t = f"--target={server.target}"
    c = lce_client.Client(server.target, timeout=60)
    for name in ("a", "b"):
        c.load_head(name, seeded=(VOCAB, HIDDEN, 9, "fp32"))
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((VOCAB, HIDDEN)) * 0.1).astype(np.float32)
    probe_h, probe_y = batch(7, seed=6)
    files = {"w.npy": lambda p: np.save(p, w), "w.raw": lambda p: w.tofile(p),
             "w.safetensors": lambda p: lce_client.local.write_safetensors(str(p), {"lm_head.weight": w})}
    version = 1
    for name, write in files.items():
        write(tmp_path / name)
        out = cli("update-weights", t, "--head=a", f"--weight-file={tmp_path / name}", f"--expected-version={version}")
        version += 1
        assert f"head 'a' version {version}" in out, out
        c.update_weights(w, head="b")
        np.testing.assert_array_equal(c.score(probe_h, probe_y, head="a")[0], c.score(probe_h, probe_y, head="b")[0])
    out = cli("update-weights", t, "--head=a", f"--weight-file={tmp_path / 'w.npy'}", "--expected-version=1", code=1)
    assert "FAILED_PRECONDITION" in out, out
    # bf16 bits (<u2) into an fp32 head: converted exactly.
    bits = lce_client.f32_to_bf16_bits(w)
    np.save(tmp_path / "w16.npy", bits)
    cli("update-weights", t, "--head=a", f"--weight-file={tmp_path / 'w16.npy'}")
    c.update_weights(lce_client.bf16_bits_to_f32(bits), head="b")
    np.testing.assert_array_equal(c.score(probe_h, probe_y, head="a")[0], c.score(probe_h, probe_y, head="b")[0])
    # A file of the wrong shape is the server's INVALID_ARGUMENT; one that is not a tensor a usage error.
    np.save(tmp_path / "small.npy", w[:5])
    assert "INVALID_ARGUMENT" in cli("update-weights", t, "--head=a", f"--weight-file={tmp_path / 'small.npy'}", code=1)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    assert "not a .npy file" in cli("update-weights", t, "--head=a", f"--weight-file={tmp_path / 'junk.npy'}", code=2)


def test_cli_trains_a_bias_like_the_python_client(server, tmp_path):
    t = f"--target={server.target}"
    c = lce_client.Client(server.target, timeout=60)
    out = cli("load-head", t, "--head=pb", f"--seeded={VOCAB}x{HIDDEN}", "--seed=3", "--dtype=fp32", "--bias=1")
    assert f"head 'pb' version 1: vocab {VOCAB} x hidden {HIDDEN} DTYPE_FLOAT32 with bias" in out, out
    c.load_head("twin", seeded=(VOCAB, HIDDEN, 3, "fp32"), bias=True)
    rng = np.random.default_rng(8)
    w = (rng.standard_normal((VOCAB, HIDDEN)) * 0.1).astype(np.float32)
    b = rng.standard_normal(VOCAB).astype(np.float32)
    np.save(tmp_path / "w.npy", w)
    np.save(tmp_path / "b.npy", b)  # 1-D, as PyTorch's bias
    out = cli("update-weights", t, "--head=pb", f"--weight-file={tmp_path / 'w.npy'}",
              f"--bias-file={tmp_path / 'b.npy'}")
    assert "head 'pb' version 2" in out, out
    c.update_weights(w, head="twin", bias=b)
    h, y = batch(13, seed=9)
    np.testing.assert_array_equal(c.score(h, y, head="pb")[0], c.score(h, y, head="twin")[0])
    assert np.asarray(c.score(h, y, head="pb")[0]).any()
    # dB accumulated by the CLI's forward-backward, read back with get-grad --bias.
    h.tofile(tmp_path / "h.raw")
    y.tofile(tmp_path / "y.raw")
    cli("zero-grad", t, "--head=pb")
    c.zero_grad("twin")
    cli("forward-backward", t, "--head=pb", f"--hidden-file={tmp_path / 'h.raw'}",
        f"--targets-file={tmp_path / 'y.raw'}", "--reduction=mean", "--accumulate-weight-grad=1")
    c.forward_backward(h, y, head="twin", accumulate_weight_grad=True)
    want = c.get_grad("twin", bias=True)
    assert np.abs(want).max() > 0
    out = cli("get-grad", t, "--head=pb", "--bias=1", f"--output={tmp_path / 'db.npy'}")
    norm = math.sqrt(sum(float(x) * float(x) for x in want))  # summed in row order, as lce_cli does
    assert f"bias gradient of head 'pb': {VOCAB} x 1 fp32, |dB| {norm:.9e}" in out, out
    np.testing.assert_array_equal(np.load(tmp_path / "db.npy").reshape(-1), want)
    np.testing.assert_array_equal(c.get_grad("pb"), c.get_grad("twin"))
    # A raw fp32 bias file; the wrong length is the server's INVALID_ARGUMENT, a bias on a head without
    # one too; --bias without --seeded is a usage error.
    b2 = b[::-1].copy()
    b2.tofile(tmp_path / "b2.raw")
    cli("update-weights", t, "--head=pb", f"--weight-file={tmp_path / 'w.npy'}", f"--bias-file={tmp_path / 'b2.raw'}")
    c.update_weights(w, head="twin", bias=b2)
    np.testing.assert_array_equal(c.score(h, y, head="pb")[0], c.score(h, y, head="twin")[0])
    b[:5].tofile(tmp_path / "short.raw")
    assert "INVALID_ARGUMENT" in cli("update-weights", t, "--head=pb", f"--weight-file={tmp_path / 'w.npy'}",
                                     f"--bias-file={tmp_path / 'short.raw'}", code=1)
    c.load_head("plain", seeded=(VOCAB, HIDDEN, 3, "fp32"))
    assert "INVALID_ARGUMENT" in cli("update-weights", t, "--head=plain", f"--weight-file={tmp_path / 'w.npy'}",
                                     f"--bias-file={tmp_path / 'b.npy'}", code=1)
    assert "--bias goes with --seeded" in cli("load-head", t, "--head=x", "--clone-of=pb", "--bias=1", code=2)


def test_cli_training_commands_use_the_admin_token(server_factory, tmp_path):
    (tmp_path / "scoring.tok").write_text("scoring-token-0123456789\n")
    (tmp_path / "admin.tok").write_text("admin-token-0123456789ab\n")
    srv = server_factory([f"--seed-head=64x{HIDDEN}", "--head-dtype=fp32",
                          f"--auth-token-file={tmp_path / 'scoring.tok'}",
                          f"--admin-token-file={tmp_path / 'admin.tok'}"], name="cli_admin")
    t, tok = f"--target={srv.target}", f"--token-file={tmp_path / 'scoring.tok'}"
    assert "PERMISSION_DENIED" in cli("zero-grad", t, tok, code=1)
    cli("zero-grad", t, tok, f"--admin-token-file={tmp_path / 'admin.tok'}")
    cli("forward-backward", t, tok, f"--admin-token-file={tmp_path / 'admin.tok'}", "--rows=4",
        "--accumulate-weight-grad=1")
    out = cli("step", t, tok, f"--admin-token-file={tmp_path / 'admin.tok'}", "--lr=0.001")
    assert "version 2" in out, out
    c = lce_client.Client(srv.target, timeout=30, token="scoring-token-0123456789",
                          admin_token="admin-token-0123456789ab")
    c.zero_grad()
    assert c.info().head.version == 2
    with pytest.raises(lce_client.LceError) as ei:
        lce_client.Client(srv.target, timeout=30, token="scoring-token-0123456789").zero_grad()
    assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
