"""The examples run end to end against the real lce_server."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import HAVE_TORCH, REPO, server_binary

EXAMPLES = REPO / "examples"


def _run(args, tmp_path, timeout=600):
    env = dict(os.environ, LCE_SERVER_BIN=str(server_binary()))
    p = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"{args} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


@pytest.mark.skipif(not HAVE_TORCH, reason="train_tiny_lm.py needs torch (pip install torch)")
@pytest.mark.parametrize("frozen", [False, True], ids=["trained-head", "frozen-head"])
def test_train_tiny_lm_remote_matches_local(tmp_path, frozen):
    out = tmp_path / "losses.json"
    png = tmp_path / "curves.png"
    args = [str(EXAMPLES / "train_tiny_lm.py"), "--steps", "8", "--batch", "4", "--context", "32",
            "--json", str(out), "--png", str(png)] + (["--frozen-head"] if frozen else [])
    stdout = _run(args, tmp_path)
    res = json.loads(out.read_text())
    local, remote = res["local"], res["remote"]
    assert len(local) == len(remote) == 8
    for i, (a, b) in enumerate(zip(local, remote)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), f"step {i + 1}: local {a} vs remote {b}"
    assert local[-1] < local[0]  # it trains
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "max |local - remote|" in stdout
    assert "running on:" in stdout and "(front): backend cpu, tp_size 1, head 'default'" in stdout, stdout


@pytest.mark.skipif(not HAVE_TORCH, reason="train_tiny_lm.py needs torch (pip install torch)")
def test_train_tiny_lm_against_replicas_trains_on_the_first(tmp_path, server_factory):
    """--target twice: it says what it ran on (each replica), and the head it trains lives on the first
    (its dW requests and optimizer steps go there; the second is another server, untouched)."""
    a = server_factory(["--seed-head=8x8", "--head-dtype=fp32"], name="tiny_a")
    b = server_factory(["--seed-head=16x8", "--head-dtype=fp32"], name="tiny_b")
    out = tmp_path / "losses.json"
    stdout = _run([str(EXAMPLES / "train_tiny_lm.py"), "--steps", "3", "--batch", "2", "--context", "16",
                   "--json", str(out), "--png", "", "--target", a.target, "--target", b.target], tmp_path)
    assert f"{a.target} (front): backend cpu, tp_size 1, head 'default' 8x8 fp32" in stdout, stdout
    assert f"{b.target}: backend cpu, tp_size 1, head 'default' 16x8 fp32" in stdout, stdout
    res = json.loads(out.read_text())
    assert all(abs(x - y) <= 1e-4 * max(1.0, abs(x)) for x, y in zip(res["local"], res["remote"]))
    import lce_client

    heads = lambda srv: {h.name: h.version for h in lce_client.Client(srv.target).info().heads}  # noqa: E731
    assert heads(a)["tiny_lm"] == 2 + 3  # loaded, updated, then 3 steps
    assert "tiny_lm" not in heads(b)


def test_rollout_logprobs_prints_a_table(tmp_path):
    stdout = _run([str(EXAMPLES / "rollout_logprobs.py"), "--sequences", "2", "--length", "5"], tmp_path)
    lines = stdout.splitlines()
    assert any(ln.split()[:6] == ["seq", "pos", "token", "logprob", "prob", "entropy"] for ln in lines), stdout
    rows = [ln.split() for ln in lines if len(ln.split()) == 6 and ln.split()[0].isdigit()]
    assert len(rows) == 2 * 5
    ignored = [r for r in rows if r[2] == "ignored"]
    assert len(ignored) == 2 and all(float(r[3]) == 0.0 for r in ignored)
    assert all(float(r[3]) < 0 and float(r[5]) > 0 for r in rows if r[2] != "ignored")


@pytest.mark.skipif(not HAVE_TORCH, reason="grpo_hf.py needs torch and transformers")
def test_grpo_hf_trains_the_policy_and_draws_its_reward_curve(tmp_path):
    """examples/grpo_hf.py for 8 steps (about 5 s on 2 cores): generation, old / ref logprobs from the
    service, the fused policy loss, the head's AdamW on the server (one version a step) and the body's
    here; the reward rises above the uniform policy's, the reference head stays frozen, the PNG is drawn."""
    pytest.importorskip("transformers")
    out = tmp_path / "rewards.json"
    png = tmp_path / "grpo.png"
    stdout = _run([str(EXAMPLES / "grpo_hf.py"), "--steps", "8", "--json", str(out), "--png", str(png)], tmp_path)
    res = json.loads(out.read_text())
    h = res["history"]
    assert [r["head_version"] for r in h] == list(range(3, 11))  # LoadHead 1, UpdateWeights 2, a step each
    assert res["ref_version_before"] == res["ref_version_after"] == 1
    first, last = sum(r["reward"] for r in h[:3]) / 3, sum(r["reward"] for r in h[-3:]) / 3
    assert last > first + 0.1 and last > res["good_fraction"] + 0.1, [r["reward"] for r in h]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "running on:" in stdout and "reward curve drawn to" in stdout
