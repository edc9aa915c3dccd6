"""lce_client.megatron against Megatron-Core's own output layer (issue 39): groups of 1-3 trainer processes
over torch.distributed (gloo) with megatron's parallel_state initialised for tensor parallelism, sequence
parallelism off and on. The reference is megatron-core's ColumnParallelLinear and
``tensor_parallel.vocab_parallel_cross_entropy`` (the loss of GPTModel.compute_language_model_loss without
fusion) on the same inputs and the same weight shards: the per-token loss [b, s], d_hidden, and the head's
dW after several micro-batches of gradient accumulation (Megatron's pretrain loss: sum(loss * loss_mask) /
loss_mask.sum(), a uniform mask and one with zeros), both with the head trained on the server and with
the gradient returned into the rank's weight shard; logprobs and entropy (verl's Megatron actor) against
a float64 reference; verl's Megatron actor's sequence-parallel path through lce_client.rl. The server's
request log shows one request's work per group: without sequence
parallelism one request a group, with it one a rank, each of its own rows; the hidden-state bytes the
server received are printed beside k copies'. Pipeline parallelism (TP 2 x PP 2, world 4, Megatron's
parallel_state with both sizes): the first stage's ranks send their hidden states to the last stage
with torch.distributed p2p, as Megatron's schedule does; the last stage's group runs Megatron's layer
and ours on them, sends both d_hiddens back (checked on the first stage too, and backpropagated into
its parameter), and the request log, tagged by rank, shows the last stage's group making one group's
requests and the first stage none."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core  # noqa: F401
except Exception as e:  # noqa: BLE001 (any failure to import is a reason to skip)
    pytest.skip(f"megatron-core is not importable ({type(e).__name__}: {e}); "
                "install it: deploy/install-deps.sh", allow_module_level=True)

import lce_client  # noqa: E402
from conftest import Server, serve_weight  # noqa: E402
from helpers import free_port, requests_by_method, sample, scrape  # noqa: E402

S, B, H, V, TEMP, MICRO = 12, 2, 16, 96, 1.5, 3


def _weight():
    g = torch.Generator().manual_seed(7)
    return torch.empty((V, H)).uniform_(-0.5, 0.5, generator=g)


def _batch(step, k):
    """Micro-batch `step`: hidden [s, b, h], labels [b, s], Megatron's loss_mask [b, s] (the last
    micro-batch masks the first position of every rank's sequence shard, so that each rank's upstream
    gradient is per token)."""
    g = torch.Generator().manual_seed(100 + step)
    hidden = torch.empty((S, B, H)).uniform_(-0.5, 0.5, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones((B, S))
    if step == MICRO - 1:
        mask[0, ::S // k] = 0
    return hidden, labels, mask


def _megatron(k, sp):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=k)
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=6, use_cpu_initialization=True,
                             tensor_model_parallel_size=k, sequence_parallel=sp and k > 1,
                             params_dtype=torch.float32)


def _layers(k, sp, train_head, client):
    """(Megatron's ColumnParallelLinear, ours) with this rank's shard of the same weight."""
    from megatron.core import tensor_parallel

    from lce_client.megatron import LinearCrossEntropyModule, remote_output_layer

    init = torch.nn.init.zeros_
    ref = tensor_parallel.ColumnParallelLinear(H, V, config=_megatron(k, False), init_method=init, bias=False)
    if train_head == "local":  # a built model's layer turned into ours, in place
        ours = remote_output_layer(tensor_parallel.ColumnParallelLinear(
            H, V, config=_megatron(k, sp), init_method=init, bias=False), client, head="mg", train_head=train_head)
    else:
        ours = LinearCrossEntropyModule(H, V, config=_megatron(k, sp), init_method=init, bias=False, client=client,
                                        head="mg", train_head=train_head)
    rank, rows = torch.distributed.get_rank(ref.tp_group), V // k
    with torch.no_grad():
        for layer in (ref, ours):
            layer.weight.copy_(_weight()[rank * rows:(rank + 1) * rows])
    return ref, ours


def _megatron_loss(ref, hidden, labels):
    """Megatron's per-token loss [b, s]: the output layer's logits, vocab_parallel_cross_entropy (as
    GPTModel.compute_language_model_loss without fusion)."""
    from megatron.core import tensor_parallel

    logits, _ = ref(hidden)
    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous()).transpose(0, 1)


def _shard(t, k, rank):
    """A rank's sequence-parallel shard of [s, ...]."""
    return t[rank * (S // k):(rank + 1) * (S // k)]


def _train(k, sp, train_head, client, group):
    """MICRO micro-batches of gradient accumulation through Megatron's layer and ours: per-token losses and
    d_hidden equal at each; at the end the weight shard's gradient (local) or the server's dW equal
    Megatron's."""
    import torch.distributed as dist

    from lce_client.megatron import output_processor

    rank = dist.get_rank(group)
    ref, ours = _layers(k, sp, train_head, client)
    for step in range(MICRO):
        hidden, labels, mask = _batch(step, k)
        x_ref = hidden.clone().requires_grad_()
        want = _megatron_loss(ref, x_ref, labels)
        ((want * mask).sum() / mask.sum() / MICRO).backward()
        x = (_shard(hidden, k, rank) if sp and k > 1 else hidden).clone().requires_grad_()
        if step == 0:  # as megatron-core 0.19's GPTModel calls it
            got = output_processor(hidden_states=x, output_layer=ours, labels=labels, config=ours.config)
        else:
            got = ours(x, output_cross_entropy_loss=True, labels=labels)
        assert got.shape == (B, S)
        ((got * mask).sum() / mask.sum() / MICRO).backward()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        want_dh = _shard(x_ref.grad, k, rank) if sp and k > 1 else x_ref.grad
        torch.testing.assert_close(x.grad, want_dh, atol=1e-6, rtol=1e-5)
    _check_head_grad(k, ref, ours, train_head, client, group)


def _check_head_grad(k, ref, ours, train_head, client, group):
    """After the micro-batches: the weight shard's accumulated gradient (local) or the server's dW (the
    group's shards of Megatron's, gathered; then zeroed) equal Megatron's."""
    import torch.distributed as dist

    if train_head == "local":
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-6, rtol=1e-5)
    else:
        parts = [torch.empty_like(ref.weight.grad) for _ in range(k)]
        dist.all_gather(parts, ref.weight.grad, group=group)
        if dist.get_rank(group) == 0:
            np.testing.assert_allclose(client.get_grad(head="mg"), torch.cat(parts).numpy(), rtol=1e-5, atol=1e-7)
            client.zero_grad(head="mg")
    dist.barrier(group=group)


def _rl(k, sp, client, group):
    """logprobs_and_entropy and their backward against float64 torch on the whole weight."""
    import torch.distributed as dist

    from lce_client.megatron import logprobs_output_processor

    rank = dist.get_rank(group)
    _, ours = _layers(k, sp, None, client)
    hidden, labels, _ = _batch(0, k)
    g = torch.Generator().manual_seed(3)
    g_lp, g_ent = torch.empty((B, S)).uniform_(-1, 1, generator=g), torch.empty((B, S)).uniform_(-1, 1, generator=g)
    h64 = hidden.double().requires_grad_()
    logits = (h64 @ _weight().double().T) / TEMP
    lp64 = torch.log_softmax(logits, -1).gather(-1, labels.T.unsqueeze(-1)).squeeze(-1).T
    ent64 = (torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)).T
    (dh64,) = torch.autograd.grad((lp64, ent64), (h64,), (g_lp.double(), g_ent.double()))
    x = (_shard(hidden, k, rank) if sp and k > 1 else hidden).clone().requires_grad_()
    # GPTModel's output_processor with input_ids: the labels are the next tokens.
    lp, ent = logprobs_output_processor(hidden_states=x, output_layer=ours, input_ids=torch.roll(labels, 1, -1),
                                        context={"temperature": TEMP})
    torch.autograd.backward((lp, ent), (g_lp, g_ent))
    torch.testing.assert_close(lp.double(), lp64.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ent64.detach(), atol=1e-5, rtol=1e-5)
    want = _shard(dh64, k, rank) if sp and k > 1 else dh64
    torch.testing.assert_close(x.grad.double(), want, atol=1e-5, rtol=1e-5)
    dist.barrier(group=group)


def _verl(k, client, group):
    """verl's Megatron actor with sequence parallelism (verl/models/mcore/model_forward_fused.py): the
    shards gathered (Megatron's gather_from_sequence_parallel_region: a reduce-scatter back; its own
    needs CUDA), then lce_client.rl.linear_cross_entropy(hidden, weight shard, labels, temperature,
    "none", tp_group) in place of verl's kernel. The gather's reduce-scatter sums the ranks' d_hidden
    parts, so each rank's shard gets its rows of the whole d_hidden once (not k times), and each weight
    shard its rows of dW."""
    import torch.distributed as dist

    import lce_client.rl as rl
    from lce_client.megatron import gather_shards

    rank, rows = dist.get_rank(group), V // k
    hidden, labels, _ = _batch(0, k)
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.empty(S * B).uniform_(-1, 1, generator=g), torch.empty(S * B).uniform_(-1, 1, generator=g)
    h64, w64 = hidden.double().requires_grad_(), _weight().double().requires_grad_()
    logits = (h64.reshape(S * B, H) @ w64.T) / TEMP
    lp64 = torch.log_softmax(logits, -1).gather(-1, labels.T.reshape(-1, 1)).squeeze(-1)
    ent64 = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    dh64, dw64 = torch.autograd.grad((lp64, ent64), (h64, w64), (g_lp.double(), g_ent.double()))
    x = _shard(hidden, k, rank).clone().requires_grad_()
    shard = _weight()[rank * rows:(rank + 1) * rows].clone().requires_grad_()
    rl.set_head(client, head="mg")
    lp, ent = rl.linear_cross_entropy(gather_shards(x, group, sum_grads=True), shard, labels.T.contiguous(), TEMP,
                                      "none", group)
    torch.autograd.backward((lp, ent), (g_lp, g_ent))
    torch.testing.assert_close(lp.double(), lp64.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ent64.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), _shard(dh64, k, rank), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shard.grad.double(), dw64[rank * rows:(rank + 1) * rows], atol=1e-5, rtol=1e-5)
    dist.barrier(group=group)


def _bytes(k, client, group, port):
    """Hidden-state bytes the server receives for one Score of the batch: the group's one request, and
    every rank sending its own copy (what each rank of a group did before issue 39); rank 0's numbers."""
    import torch.distributed as dist

    from lce_client.torch import remote_logprobs

    _, ours = _layers(k, False, None, client)
    hidden, labels, _ = _batch(0, k)
    measured = []
    for call in (lambda: ours.logprobs_and_entropy(hidden, labels),
                 lambda: remote_logprobs(hidden.reshape(S * B, H), labels.T.reshape(-1), client, head="mg")):
        dist.barrier(group=group)
        before = sample(scrape(port), "lce_bytes_received_total")
        dist.barrier(group=group)  # every rank has read the counter before any sends
        with torch.no_grad():
            call()
        dist.barrier(group=group)
        measured.append(sample(scrape(port), "lce_bytes_received_total") - before)
    return measured


def _rank(rank, k, store, target, port, out):
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=k)
    try:
        client = lce_client.Client(target, timeout=60)
        from megatron.core import parallel_state

        from lce_client.megatron import serve_megatron_weight

        _megatron(k, False)
        group = parallel_state.get_tensor_model_parallel_group()
        serve_megatron_weight(_layers(k, False, None, client)[1], client, "mg")  # the shards, gathered: the same head
        for sp in (False, True):
            _train(k, sp, "server", client, group)
            _train(k, sp, "local", client, group)
            _rl(k, sp, client, group)
        _verl(k, client, group)
        group_bytes, copies_bytes = _bytes(k, client, group, port)
        if rank == 0:
            with open(out, "w") as f:
                json.dump([group_bytes, copies_bytes], f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_megatron_output_layer_matches_megatrons_own_with_one_request_per_group(workdir, tmp_path, k):
    port = free_port()
    srv = Server(["--seed-head=8x8", "--head-dtype=fp32", "--log-requests=true", f"--metrics-port={port}"],
                 workdir, f"megatron_{k}")
    try:
        with lce_client.Client(srv.target, timeout=60) as c:
            serve_weight(c, _weight(), "mg")
        before, out = requests_by_method(srv), tmp_path / "bytes.json"
        torch.multiprocessing.spawn(_rank, args=(k, str(tmp_path / "store"), srv.target, port, str(out)), nprocs=k,
                                    join=True)
        calls = {m: n - before.get(m, 0) for m, n in requests_by_method(srv).items()}
        # Per group, without sequence parallelism (one request each) and with it (one a rank, of its rows):
        # the server-trained head: a ForwardBackward a micro-batch and one more for the masked one's
        # per-token upstream gradient, a commit of each uniform one and a discard of the masked one's;
        # the local weight: a Score and a Backward a micro-batch, each rank reading the pending dW and the
        # sender discarding it; RL: a Score and a Backward. Then verl's path (the gathered rows: one
        # Score and one Backward a group, k GetGrads of the weight's rows, one discard) and the bytes'
        # Scores: the group's one, and one a rank.
        sends = 1 + (k if k > 1 else 1)  # SP off: one sender; SP on: k
        assert calls.get("ForwardBackward") == (MICRO + 1) * sends, calls
        assert calls.get("Score") == (MICRO + 1) * sends + 1 + 1 + k, calls
        assert calls.get("Backward") == (MICRO + 1) * sends + 1, calls
        assert calls.get("CommitGrad") == MICRO * sends + MICRO * sends + 1, calls
        assert calls.get("GetGrad") == 2 * (1 + MICRO * k) + k, calls
        group_bytes, copies_bytes = json.loads(out.read_text())
        print(f"\nTP {k}: one Score of [{S * B}, {H}] fp32 hidden states: the group sent {group_bytes:.0f} bytes, "
              f"k copies {copies_bytes:.0f}")
        assert group_bytes >= S * B * H * 4 and copies_bytes == k * group_bytes
    finally:
        srv.stop()


# Pipeline parallelism: TP 2 x PP 2 (world 4). Megatron's rank order puts TP innermost: ranks 0-1 are the
# first stage's TP group, 2-3 the last stage's, and pipeline peers are TP ranks alike (0-2, 1-3).
PP_TP, PP = 2, 2


def _tag(client, rid):
    """Sends x-request-id `rid` with all the client's calls, so the server's request log names the
    sender (rank and phase); the training RPCs use the admin metadata, tagged too."""
    client._metadata = client._admin_metadata = (("x-request-id", rid),)


def _first_stage_param():
    """The first stage's stand-in body, hidden = tanh(raw @ proj): proj is replicated over the TP group
    (as a norm's weight is) and gets the d_hidden the last stage sends back."""
    g = torch.Generator().manual_seed(11)
    return torch.empty((H, H)).uniform_(-0.5, 0.5, generator=g).requires_grad_()


def _pp_first(sp, peer, rank):
    """The first stage, as Megatron's schedule runs it: each micro-batch's hidden states [s, b, h] (with
    sequence parallelism the rank's shard) sent to the last stage, the d_hidden of ours and of Megatron's
    layer received back, equal, and backpropagated into the stage's parameter: its gradients after
    the micro-batches equal."""
    import torch.distributed as dist

    proj, grads = _first_stage_param(), {"ours": 0, "megatron": 0}
    for step in range(MICRO):
        raw, _, _ = _batch(step, PP_TP)
        out = torch.tanh(raw @ proj)
        if sp:
            out = _shard(out, PP_TP, rank)
        dist.send(out.detach().contiguous(), peer)
        got = {name: torch.empty_like(out) for name in grads}
        for name in grads:
            dist.recv(got[name], peer)
        torch.testing.assert_close(got["ours"], got["megatron"], atol=1e-6, rtol=1e-5)
        for name in grads:
            grads[name] = grads[name] + torch.autograd.grad(out, proj, got[name], retain_graph=True)[0]
    torch.testing.assert_close(grads["ours"], grads["megatron"], atol=1e-6, rtol=1e-5)


def _pp_last(sp, train_head, client, group, peer):
    """The last stage: the hidden states received from the first stage through Megatron's layer and ours
    (with sequence parallelism Megatron's layer gathers the shards: here gather_shards, whose backward
    slices the all-reduced d_hidden as the SP layer's reduce-scatter would), the per-token loss and
    d_hidden equal, both d_hiddens sent back; after the micro-batches the head's dW equal."""
    import torch.distributed as dist

    from lce_client.megatron import gather_shards

    ref, ours = _layers(PP_TP, sp, train_head, client)
    for step in range(MICRO):
        _, labels, mask = _batch(step, PP_TP)
        received = torch.empty((S // PP_TP if sp else S, B, H))
        dist.recv(received, peer)
        x_ref, x = received.clone().requires_grad_(), received.clone().requires_grad_()
        want = _megatron_loss(ref, gather_shards(x_ref, group) if sp else x_ref, labels)
        ((want * mask).sum() / mask.sum() / MICRO).backward()
        got = ours(x, output_cross_entropy_loss=True, labels=labels)
        ((got * mask).sum() / mask.sum() / MICRO).backward()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)
        for d in (x.grad, x_ref.grad):
            dist.send(d.contiguous(), peer)
    _check_head_grad(PP_TP, ref, ours, train_head, client, group)


def _pp_rank(rank, store, target):
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=PP_TP * PP)
    try:
        from megatron.core import parallel_state as ps

        from lce_client.megatron import serve_megatron_weight

        ps.initialize_model_parallel(tensor_model_parallel_size=PP_TP, pipeline_model_parallel_size=PP)
        last, tp = ps.is_pipeline_last_stage(), ps.get_tensor_model_parallel_rank()
        stage, group = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        assert (stage, tp) == divmod(rank, PP_TP)  # the layout the comment above PP_TP describes
        client = lce_client.Client(target, timeout=60)  # every rank has one; only the last stage's call
        if last:  # only the last stage (post_process) has an output layer
            _tag(client, f"s{stage}-tp{tp}-load")
            serve_megatron_weight(_layers(PP_TP, False, None, client)[1], client, "mg")
        for sp in (False, True):
            for train_head in ("server", "local"):
                _tag(client, f"s{stage}-tp{tp}-sp{int(sp)}-{train_head}")
                if last:
                    _pp_last(sp, train_head, client, group, ps.get_pipeline_model_parallel_prev_rank())
                else:
                    _pp_first(sp, ps.get_pipeline_model_parallel_next_rank(), tp)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _requests_by_tag(srv) -> dict:
    """{x-request-id: {method: count}} of the request log's lines that a _tag named."""
    out = {}
    for line in srv.log_path.read_text().splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if d.get("request_id", "").startswith("s"):
                by_method = out.setdefault(d["request_id"], {})
                by_method[d["method"]] = by_method.get(d["method"], 0) + 1
    return out


def test_megatron_output_layer_under_pipeline_parallelism_only_the_last_stage_calls(workdir, tmp_path):
    srv = Server(["--seed-head=8x8", "--head-dtype=fp32", "--log-requests=true"], workdir, "megatron_pp")
    try:
        with lce_client.Client(srv.target, timeout=60) as c:
            serve_weight(c, _weight(), "mg")
        torch.multiprocessing.spawn(_pp_rank, args=(str(tmp_path / "store"), srv.target), nprocs=PP_TP * PP,
                                    join=True)
        calls = _requests_by_tag(srv)
        print("\nrequests by rank and phase:", json.dumps(calls, sort_keys=True))
        assert not [t for t in calls if t.startswith("s0-")], calls  # the first stage: none
        # The last stage's TP group, as test_megatron_output_layer_matches_megatrons_own_with_one_request_
        # per_group counts for one group: without sequence parallelism its first rank sends (the
        # server-trained head: a ForwardBackward a micro-batch, one more for the masked one, a commit or
        # discard each; the local weight: a Score, a Backward and a discard each) and the other rank only
        # reads its pending dW; with it each rank sends its own shard; rank 0 reads the server's dW. A
        # client's first computation asks GetInfo once (the data-plane port).
        fb = {"ForwardBackward": MICRO + 1, "CommitGrad": MICRO}
        local = {"Score": MICRO, "Backward": MICRO, "GetGrad": MICRO, "CommitGrad": MICRO}
        read = {"GetGrad": 1, "ZeroGrad": 1}
        want = {"s1-tp0-load": {"UpdateWeights": 1},
                "s1-tp0-sp0-server": {"GetInfo": 1, **fb, **read}, "s1-tp0-sp0-local": local,
                "s1-tp1-sp0-local": {"GetGrad": MICRO},
                "s1-tp0-sp1-server": {**fb, **read}, "s1-tp1-sp1-server": {"GetInfo": 1, **fb},
                "s1-tp0-sp1-local": local, "s1-tp1-sp1-local": local}
        assert calls == want
    finally:
        srv.stop()
