#!/usr/bin/env python3
"""A tensor-parallel Megatron-Core output layer served by lce-serve, trained side by side with Megatron's own.

Each of the --tp ranks (processes over torch.distributed gloo, CPU) holds a small body (an embedding and
an MLP, the same on every rank, as Megatron's replicated parts) and two output layers with the same
vocab shard [V/tp, H] of one weight: Megatron's ``ColumnParallelLinear`` + ``vocab_parallel_cross_entropy``
(GPTModel.compute_language_model_loss), and the same kind of layer turned into
``lce_client.megatron.LinearCrossEntropyModule`` by ``remote_output_layer`` — the swap a Megatron user
makes:

    from lce_client.megatron import remote_output_layer, output_processor, serve_megatron_weight
    remote_output_layer(model.output_layer, client, head="policy", train_head="local")
    serve_megatron_weight(model.output_layer, client, "policy", load=True)    # every TP rank, once
    loss = model(input_ids, position_ids, attention_mask, labels=labels, output_processor=output_processor)

Both train with AdamW for --steps steps (Megatron's loss: sum(loss * loss_mask) / loss_mask.sum()); the
script prints both loss curves and their largest difference. --train-head local: the shard's gradient
comes back from the server into the weight (Megatron's optimizer steps it; serve_megatron_weight then
sends it); server: the head trains on the server (Client.optimizer_step, the same AdamW). --sp: sequence
parallelism (each rank sends its shard of the sequence). Pipeline parallelism needs nothing more: only
the last stage has the output layer.

--rl verl|areal: an RL step instead of the loss (a clipped-ratio policy loss with per-sequence advantages
and an entropy bonus, over logprobs and entropy at --temperature), Megatron's side from the logits
(logprobs: -vocab_parallel_cross_entropy of logits / T; entropy of the gathered logits). verl: the
sequence shards gathered and lce_client.rl.linear_cross_entropy(hidden, weight shard, labels, T, "none",
tp_group), the call verl's Megatron actor makes (docs/INTEGRATIONS.md); areal: GPTModel's output processor
lce_client.megatron.logprobs_output_processor in place of AReaL's gather_logprobs_entropy on the logits.

    python examples/megatron_tp.py --tp 2                  # starts a local lce_server (CPU engine)
    python examples/megatron_tp.py --tp 2 --sp --train-head server --target 127.0.0.1:50051
    torchrun --nproc-per-node 2 examples/megatron_tp.py --target 127.0.0.1:50051
"""
from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed as dist

HEAD = "megatron_tp"


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (processes; torchrun's world size)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--train-head", choices=["local", "server"], default="local")
    ap.add_argument("--target", help="host:port of a running lce_server (default: start one locally)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-2)
    ap.add_argument("--rl", choices=["verl", "areal"], help="an RL step through that framework's call")
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    if args.rl == "verl" and args.train_head != "local":
        ap.error("--rl verl: verl's call returns the weight's gradient (--train-head local)")
    return args


def megatron_layers(args, k):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=k)
    layers = []
    for sp in (False, args.sp and k > 1):
        cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=k,
                                params_dtype=torch.float32, use_cpu_initialization=True,
                                tensor_model_parallel_size=k, sequence_parallel=sp)
        torch.manual_seed(0)  # the same whole weight on every rank and in both layers; each keeps its shard
        layers.append(tensor_parallel.ColumnParallelLinear(args.hidden, args.vocab, config=cfg, bias=False,
                                                           init_method=torch.nn.init.xavier_normal_))
    return layers


def body(args):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Embedding(args.vocab, args.hidden), torch.nn.Linear(args.hidden, args.hidden),
                               torch.nn.Tanh())


def batch(args, step):
    """Random tokens whose next token is a fixed function of them (something to learn), and Megatron's
    loss_mask with a few zeros."""
    g = torch.Generator().manual_seed(step)
    inputs = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    mask = (torch.rand((args.batch, args.seq), generator=g) > 0.1).float()
    return inputs, (inputs * 7 + 3) % args.vocab, mask


def train(args, group, layer, loss_fn, client=None):
    """Losses of --steps AdamW steps of a fresh body and `layer` (the head on the server trains there)."""
    net = body(args)
    params = list(net.parameters()) + ([layer.weight] if client is None or args.train_head == "local" else [])
    opt = torch.optim.AdamW(params, lr=args.lr)
    rank, k = dist.get_rank(group), dist.get_world_size(group)
    losses = []
    for step in range(args.steps):
        inputs, labels, mask = batch(args, step)
        hidden = net(inputs).transpose(0, 1)  # [s, b, h], Megatron's layout
        if args.rl:
            lp, ent = loss_fn(layer, hidden, labels, rank, k, args)  # [b, s] each
            loss = policy_loss(lp, ent, mask, step)
        else:
            per_token = loss_fn(layer, hidden, labels, rank, k)  # [b, s]
            loss = (per_token * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.sp and k > 1:  # the replicated body under SP: Megatron all-reduces such grads over TP
            for p in net.parameters():
                dist.all_reduce(p.grad, group=group)
        opt.step()
        if client is not None and args.train_head == "server" and rank == 0:
            client.optimizer_step(head=HEAD, lr=args.lr, weight_decay=0.01)  # torch AdamW's defaults
        if client is not None and args.train_head == "local":
            from lce_client.megatron import serve_megatron_weight

            serve_megatron_weight(layer, client, HEAD)  # the stepped shards, to the server
        dist.barrier(group=group)
        losses.append(loss.item())
    return losses


def policy_loss(lp, ent, mask, step):
    """A PPO-style clipped surrogate over the tokens (the rollout's logprobs = these, detached) with
    per-sequence advantages of +-1, minus an entropy bonus: per-token upstream gradients of both."""
    adv = torch.tensor([1.0, -1.0]).repeat(lp.shape[0])[:lp.shape[0], None] * (1 if step % 2 else -1)
    ratio = torch.exp(lp - lp.detach())
    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return -((surrogate + 0.01 * ent) * mask).sum() / mask.sum()


def megatron_logprobs(layer, hidden, labels, rank, k, args):
    from megatron.core import tensor_parallel

    from lce_client.megatron import gather_shards

    logits, _ = layer(hidden)
    logits = logits / args.temperature
    whole = gather_shards(logits, layer.tp_group, dim=-1)  # every rank: the same loss of them
    # (a copy: Megatron's cross-entropy works on its logits in place)
    lp = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels.T.contiguous()).T
    ent = torch.logsumexp(whole, -1) - (torch.softmax(whole, -1) * whole).sum(-1)
    return lp, ent.T


def remote_logprobs(layer, hidden, labels, rank, k, args):
    if layer.sequence_parallel:
        hidden = hidden.chunk(k)[rank]
    if args.rl == "areal":
        from lce_client.megatron import logprobs_output_processor

        return logprobs_output_processor(hidden_states=hidden, output_layer=layer, labels=labels,
                                         context={"temperature": args.temperature})
    from lce_client.megatron import gather_shards
    from lce_client.rl import linear_cross_entropy

    if layer.sequence_parallel:  # verl gathers the shards first
        hidden = gather_shards(hidden, layer.tp_group, sum_grads=True)  # Megatron's SP gather
    lp, ent = linear_cross_entropy(hidden, layer.weight, labels.T.contiguous(), args.temperature, "none",
                                   layer.tp_group)
    s, b = labels.shape[1], labels.shape[0]
    return lp.view(s, b).T, ent.view(s, b).T


def megatron_loss(layer, hidden, labels, rank, k):
    from megatron.core import tensor_parallel

    logits, _ = layer(hidden)
    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels.T.contiguous()).T


def remote_loss(layer, hidden, labels, rank, k):
    from lce_client.megatron import output_processor

    if layer.sequence_parallel:  # the rank's shard of the sequence, as Megatron's SP body hands it over
        hidden = hidden.chunk(k)[rank]
    return output_processor(hidden_states=hidden, output_layer=layer, labels=labels, config=layer.config)


def run(rank, k, init, target, args):
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=k)
    try:
        import lce_client
        import lce_client.rl as rl
        from lce_client.megatron import remote_output_layer, serve_megatron_weight

        group = dist.new_group(list(range(k)))
        ref, ours = megatron_layers(args, k)
        client = lce_client.Client(target, timeout=120)
        remote_output_layer(ours, client, head=HEAD, train_head=args.train_head)
        serve_megatron_weight(ours, client, HEAD, load=True)
        if args.rl:
            rl.set_head(client, head=HEAD)
        want = train(args, group, ref, megatron_logprobs if args.rl else megatron_loss)
        got = train(args, group, ours, remote_logprobs if args.rl else remote_loss, client)
        if rank == 0:
            print(f"TP {k}, SP {'on' if args.sp and k > 1 else 'off'}, head trained {args.train_head}"
                  + (f", RL through {args.rl}'s call" if args.rl else ""))
            print("step  megatron     lce-serve")
            for i, (a, b) in enumerate(zip(want, got)):
                print(f"{i:4d}  {a:.7f}  {b:.7f}")
            print(f"max |megatron - lce-serve| = {max(abs(a - b) for a, b in zip(want, got)):.2e}")
    finally:
        dist.destroy_process_group()


def main():
    from lce_client.local import run_on_ranks

    args = parse()
    server_args = ["--seed-head=8x8", "--head-dtype=fp32", "--cpu-threads=1"]
    run_on_ranks(run, args.tp, args.target, (args,), server_args=server_args)


if __name__ == "__main__":
    main()
