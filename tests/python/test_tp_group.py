"""Tensor-parallel trainers against one server (issue 39's CPU test): k trainer processes of one
torch.distributed group (gloo) whose ranks hold the same rows, as Megatron's output layer without
sequence parallelism. The group makes one request's work on the server (counted in the server's request
log), every rank gets the right answers (float64 reference: verl's formulas, as in
test_verl_contract.py), each rank's weight shard gets its rows of the gradient, and a head trained on the
server gets dW once, not k times. With sequence parallelism each rank sends its own shard of the rows
(k requests that together hold each row once) and gets its rows' d_hidden and the group's loss."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lce_client  # noqa: E402
from conftest import Server, serve_weight  # noqa: E402
from helpers import requests_by_method  # noqa: E402

T, H, V, TEMP = 29, 16, 96, 1.5


def _inputs():
    g = torch.Generator().manual_seed(5)
    hidden = torch.empty((1, T, H)).uniform_(-0.5, 0.5, generator=g)
    weight = torch.empty((V, H)).uniform_(-0.5, 0.5, generator=g)
    labels = torch.randint(0, V, (1, T), generator=g)
    g_ent = torch.empty((T,)).uniform_(-0.5, 0.5, generator=g)
    g_lp = torch.empty((T,)).uniform_(-1, 1, generator=g)
    return hidden, weight, labels, g_ent, g_lp


def _reference(hidden, weight, labels, g_ent, g_lp):
    h = hidden.reshape(T, H).double().requires_grad_()
    w = weight.double().requires_grad_()
    logits = h @ w.T / TEMP
    lp = -torch.nn.functional.cross_entropy(logits, labels.reshape(T), reduction="none")
    ent = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    dh, dw = torch.autograd.grad((ent, lp), (h, w), (g_ent.double(), g_lp.double()))
    return lp.detach(), ent.detach(), dh, dw


def _rank(rank, k, store, target):
    import torch.distributed as dist

    import lce_client.rl as rl
    from lce_client.torch import remote_linear_cross_entropy, remote_logprobs

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=k)
    try:
        group = dist.new_group(list(range(k)))
        client = lce_client.Client(target, timeout=60)
        hidden, weight, labels, g_ent, g_lp = _inputs()
        ref_lp, ref_ent, ref_dh, ref_dw = _reference(hidden, weight, labels, g_ent, g_lp)
        rows = V // k
        shard = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_()  # verl's TP layout
        h = hidden.clone().requires_grad_()
        rl.set_head(client, head="tp")
        lp, ent = rl.linear_cross_entropy(h, shard, labels, TEMP, "none", group)
        dh, dw = torch.autograd.grad((ent, lp), (h, shard), (g_ent, g_lp))
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
        # verl's contract (its tests/utils/test_special_linear_cross_entropy_tp.py all-reduces each rank's
        # d_hidden before comparing): the group's sum is the whole d_hidden.
        dist.all_reduce(dh, group=group)
        torch.testing.assert_close(dh.reshape(T, H).double(), ref_dh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dw.double(), ref_dw[rank * rows:(rank + 1) * rows], atol=1e-5, rtol=1e-5)
        # The head trained on the server through the group: dW of the group's loss, added once.
        dist.barrier(group=group)
        if rank == 0:
            client.zero_grad(head="tp")
        dist.barrier(group=group)
        lp, ent = remote_logprobs(hidden.reshape(T, H).clone().requires_grad_(), labels.reshape(T), client,
                                  temperature=TEMP, head="tp", accumulate_weight_grad=True, process_group=group)
        torch.autograd.backward((ent, lp), (g_ent, g_lp))
        dist.barrier(group=group)
        if rank == 0:
            np.testing.assert_allclose(client.get_grad(head="tp"), ref_dw.numpy(), rtol=1e-5, atol=1e-6)
            client.zero_grad(head="tp")
        dist.barrier(group=group)
        # The loss path (pretraining / SFT): one ForwardBackward a group, (loss / 2)'s d_hidden on every
        # rank, dW once with the backward's scale.
        x = hidden.reshape(T, H).clone().requires_grad_()
        loss = remote_linear_cross_entropy(x, labels.reshape(T), client, temperature=TEMP, head="tp",
                                           accumulate_weight_grad=True, process_group=group)
        (loss / 2).backward()
        hr = hidden.reshape(T, H).double().requires_grad_()
        w = weight.double().requires_grad_()
        ref = torch.nn.functional.cross_entropy(hr @ w.T / TEMP, labels.reshape(T)) / 2
        ref.backward()
        torch.testing.assert_close(loss.double() / 2, ref.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(x.grad.double(), hr.grad, atol=1e-6, rtol=1e-5)
        dist.barrier(group=group)
        if rank == 0:
            np.testing.assert_allclose(client.get_grad(head="tp"), w.grad.numpy(), rtol=1e-5, atol=1e-7)
            client.zero_grad(head="tp")
        dist.barrier(group=group)
        # Sequence parallelism: each rank holds (and sends) its shard of the rows, gets its rows' d_hidden
        # and the group's mean loss; dW of every row once.
        rows_of = torch.tensor_split(torch.arange(T), k)[rank]
        xs = hidden.reshape(T, H)[rows_of].clone().requires_grad_()
        loss = remote_linear_cross_entropy(xs, labels.reshape(T)[rows_of], client, temperature=TEMP, head="tp",
                                           accumulate_weight_grad=True, process_group=group, sequence_parallel=True)
        (loss / 2).backward()
        torch.testing.assert_close(loss.double() / 2, ref.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(xs.grad.double(), hr.grad[rows_of], atol=1e-6, rtol=1e-5)
        dist.barrier(group=group)
        if rank == 0:
            np.testing.assert_allclose(client.get_grad(head="tp"), w.grad.numpy(), rtol=1e-5, atol=1e-7)
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_tp_group_makes_one_request_and_every_rank_gets_its_answers(workdir, tmp_path, k):
    srv = Server(["--seed-head=8x8", "--head-dtype=fp32", "--log-requests=true"], workdir, f"tp_group_{k}")
    try:
        with lce_client.Client(srv.target, timeout=60) as c:
            serve_weight(c, _inputs()[1], "tp")
        before = requests_by_method(srv)
        torch.multiprocessing.spawn(_rank, args=(k, str(tmp_path / "store"), srv.target), nprocs=k, join=True)
        calls = {m: n - before.get(m, 0) for m, n in requests_by_method(srv).items()}
        # One Score and one Backward a group forward and backward, twice (the local weight, then the head
        # trained on the server), and one ForwardBackward, whatever k; k GetGrads of the local weight's
        # pending contribution and three checks of the head's dW; CommitGrad: the local weight's discard
        # and the loss's commit.
        assert calls.get("Score") == 2 and calls.get("Backward") == 2, calls
        # Sequence parallelism: one ForwardBackward and one commit a rank, each of its own rows.
        assert calls.get("ForwardBackward") == 1 + k and calls.get("CommitGrad") == 1 + 1 + k, calls  # + a discard
        assert calls.get("GetGrad") == k + 3, calls
    finally:
        srv.stop()


def _meet(rank, k, init, target, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=k)
    try:
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        vocab = lce_client.Client(target, timeout=30).head_info().vocab_size
        (out / f"rank{rank}.json").write_text(json.dumps({"world": k, "sum": float(total), "vocab": vocab}))
    finally:
        dist.destroy_process_group()


def test_run_on_ranks_spawns_a_group_against_a_local_server(tmp_path, monkeypatch):
    """lce_client.local.run_on_ranks (the Megatron example's and benchmark's launcher): without a target
    it starts a server with the flags given and runs every rank against it; under torchrun (RANK set) it
    runs this process's rank once, and needs a target."""
    from conftest import server_binary
    from lce_client.local import run_on_ranks

    monkeypatch.setenv("LCE_SERVER_BIN", str(server_binary()))
    monkeypatch.delenv("RANK", raising=False)
    run_on_ranks(_meet, 2, None, (tmp_path,), server_args=["--seed-head=24x8", "--cpu-threads=1"])
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got == [{"world": 2, "sum": 3.0, "vocab": 24}] * 2
    calls = []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    run_on_ranks(lambda *a: calls.append(a), 4, "host:1", ("x",))
    assert calls == [(1, 4, "env://", "host:1", "x")]
    with pytest.raises(SystemExit, match="--target"):
        run_on_ranks(lambda *a: calls.append(a), 4, None)
