#!/usr/bin/env python3
"""Train a tiny causal LM twice from the same seed: once with its LM head and loss served by lce-serve,
once with a local nn.Linear head and F.cross_entropy. Both loss curves are printed side by side and
drawn to a PNG; they should lie on top of each other.

The model: a character-level transformer (token + position embeddings, a few pre-norm blocks, final
LayerNorm) on the Zen of Python, which ships with Python. The LM head W [vocab, hidden] lives on the
server as head "tiny_lm" (created with LoadHead and set to the local head's initial weight with
UpdateWeights). Each remote step is one ForwardBackward RPC through RemoteLinearCrossEntropy: the loss
comes back, d_hidden flows into the trunk's autograd graph, and (by default) the server accumulates dW
and takes an AdamW step on its copy of the head with OptimizerStep: the same AdamW the local run applies
to its nn.Linear. With --frozen-head both runs keep the head fixed and train only the trunk.

Usage:
    python examples/train_tiny_lm.py                          # starts a local lce_server (CPU engine)
    python examples/train_tiny_lm.py --target 127.0.0.1:50051 # a running server or TP group (README command)
    python examples/train_tiny_lm.py --target a:50051,b:50051 # data-parallel replicas (the first is the front)
    python examples/train_tiny_lm.py --steps 300 --png curves.png --json losses.json

It prints what it ran on: each replica's backend, tensor-parallel size and default head (GetInfo).
"""
from __future__ import annotations

import argparse
import codecs
import contextlib
import copy
import io
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from lce_client import Client
from lce_client.local import LocalServer
from lce_client.torch import RemoteLinearCrossEntropy

HEAD_NAME = "tiny_lm"


def corpus() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # the Zen of Python, rot13-encoded in this.s
    return codecs.decode(this.s, "rot13")


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, mask):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Trunk(nn.Module):
    """Everything but the LM head: tokens [B, T] -> final hidden states [B, T, H]."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, context: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(context, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        mask = torch.triu(torch.full((T, T), float("-inf"), device=idx.device), diagonal=1)
        for b in self.blocks:
            x = b(x, mask)
        return self.ln(x)


def batches(data: torch.Tensor, steps: int, batch: int, context: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + context] for s in start])
        y = torch.stack([data[s + 1:s + context + 1] for s in start])
        yield x, y


def train_local(trunk, head_w, data, args):
    trunk = copy.deepcopy(trunk)
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(head_w)
    head.weight.requires_grad_(not args.frozen_head)
    params = list(trunk.parameters()) + ([] if args.frozen_head else [head.weight])
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay)
    losses = []
    for x, y in batches(data, args.steps, args.batch, args.context, args.seed):
        h = trunk(x)
        loss = F.cross_entropy(head(h).reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_remote(trunk, head_w, data, args, client: Client):
    trunk = copy.deepcopy(trunk)
    # The head on the server: a fresh fp32 head of the right shape, then exactly the local initial weight.
    client.load_head(HEAD_NAME, seeded=(args.vocab, args.hidden, args.seed, "fp32"))
    client.update_weights(head_w, head=HEAD_NAME)
    lce = RemoteLinearCrossEntropy(client, head=HEAD_NAME, reduction="mean",
                                   accumulate_weight_grad=not args.frozen_head)
    opt = torch.optim.AdamW(trunk.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay)
    if not args.frozen_head:
        client.zero_grad(head=HEAD_NAME)
    losses = []
    for x, y in batches(data, args.steps, args.batch, args.context, args.seed):
        h = trunk(x)
        loss = lce(h, y)  # one ForwardBackward RPC: loss now, d_hidden kept for backward
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if not args.frozen_head:  # AdamW on the server's fp32 master copy of the head, then zero its grad
            client.optimizer_step(head=HEAD_NAME, lr=args.lr, beta1=0.9, beta2=0.999, eps=1e-8,
                                  weight_decay=args.weight_decay, zero_grad=True)
        losses.append(loss.item())
    return losses


def plot(local, remote, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    steps = range(1, len(local) + 1)
    ax.plot(steps, local, label="local nn.Linear head + F.cross_entropy", lw=2.5, alpha=0.6)
    ax.plot(steps, remote, label="remote head (lce-serve)", lw=1.0, ls="--", color="k")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.plot(steps, [abs(a - b) for a, b in zip(local, remote)], color="tab:red", lw=1)
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_ylabel("|local - remote|\n(zeros not drawn)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", action="append",
                    help="host:port of a running lce_server or group (default: start one locally); replicas: "
                         "several, comma-separated or --target again (training calls go to the first)")
    ap.add_argument("--token", help="bearer token (an admin token when the server has auth: LoadHead etc.)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frozen-head", action="store_true", help="keep the LM head fixed; train the trunk only")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: reproducible and polite)")
    ap.add_argument("--every", type=int, default=0, help="print every N steps (default: ~20 lines)")
    ap.add_argument("--png", default="train_tiny_lm.png", help="where to draw the curves ('' for none)")
    ap.add_argument("--json", help="write {'local': [...], 'remote': [...]} here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    text = corpus()
    args.vocab = 128  # ASCII
    data = torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)

    torch.manual_seed(args.seed)
    trunk = Trunk(args.vocab, args.hidden, args.layers, args.heads, args.context)
    head_w = nn.Linear(args.hidden, args.vocab, bias=False).weight.detach().clone()
    n_params = sum(p.numel() for p in trunk.parameters()) + head_w.numel()
    print(f"tiny LM: {n_params / 1e3:.1f}k parameters (head {args.vocab}x{args.hidden}), {len(data)} chars of "
          f"the Zen of Python, {args.steps} steps of {args.batch}x{args.context} tokens, "
          f"head {'frozen' if args.frozen_head else 'trained (AdamW on the server)'}")

    server = None
    target = ",".join(args.target) if args.target else None
    if target is None:
        server = LocalServer(["--seed-head=8x8", "--head-dtype=fp32", "--cpu-threads=1"])
        target = server.target
        print(f"started lce_server at {target} (CPU engine)")
    try:
        with Client(target, token=args.token, timeout=120) as client:
            print("running on:\n" + client.describe())
            t0 = time.perf_counter()
            local = train_local(trunk, head_w, data, args)
            t1 = time.perf_counter()
            remote = train_remote(trunk, head_w, data, args, client)
            t2 = time.perf_counter()
    finally:
        if server is not None:
            server.stop()

    every = args.every or max(1, args.steps // 20)
    print(f"\n{'step':>5} {'local':>10} {'remote':>10} {'|diff|':>10}")
    for i in range(len(local)):
        if i % every == 0 or i == len(local) - 1:
            print(f"{i + 1:>5} {local[i]:>10.5f} {remote[i]:>10.5f} {abs(local[i] - remote[i]):>10.2e}")
    max_diff = max(abs(a - b) for a, b in zip(local, remote))
    print(f"\nmax |local - remote| over {len(local)} steps: {max_diff:.3e}   "
          f"(uniform over {args.vocab} chars: {math.log(args.vocab):.3f})")
    print(f"time: local {t1 - t0:.1f}s, remote {t2 - t1:.1f}s")
    if args.png:
        plot(local, remote, args.png, f"tiny LM on the Zen of Python: local vs remote head "
             f"({'frozen' if args.frozen_head else 'trained'} head)")
        print(f"curves drawn to {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"local": local, "remote": remote, "max_abs_diff": max_diff}, f)


if __name__ == "__main__":
    main()
