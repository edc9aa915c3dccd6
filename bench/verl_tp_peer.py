#!/usr/bin/env python3
"""verl's fused linear cross-entropy with its tensor-parallel process group, side by side with
lce_tp_bench: the weight split by vocabulary over the ranks (rank r holds rows [r*V/k, (r+1)*V/k)),
the same hidden states and targets on every rank, train = forward + backward (d_hidden, d_weight) of
the mean CE over non-ignored tokens, score = forward only. Median times on rank 0 (do_bench, CUDA
events, the collectives inside).

Run with torch's launcher, one process per GPU:
  python3 -m torch.distributed.run --nproc_per_node=K bench/verl_tp_peer.py --verl-wheel .whl/verl-*.whl \
      --peers .peers/peers.py --shapes 16384x4096x151936
"""
import argparse
import importlib.util
import math
import os

import torch
import torch.distributed as dist
from triton.testing import do_bench

IGNORE = -100


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--verl-wheel", required=True)
    ap.add_argument("--peers", required=True, help="path of ../shared/bench/peers.py (its verl loader is reused)")
    ap.add_argument("--shapes", default="16384x4096x151936")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("peers", args.peers)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    lce = peers.load_verl_kernel(args.verl_wheel)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    pg = dist.group.WORLD if world > 1 else None
    for shape in args.shapes.split(","):
        N, H, V = map(int, shape.split("x"))
        assert V % world == 0, "verl splits the vocabulary evenly"
        g = torch.Generator(device="cuda").manual_seed(0)
        h = (torch.randn(N, H, device="cuda", generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, V, (N,), device="cuda", generator=g)
        t[torch.rand(N, device="cuda", generator=g) < 0.05] = IGNORE
        rows = V // world
        w = (torch.randn(rows, H, device="cuda") / math.sqrt(H)).to(torch.bfloat16).requires_grad_()
        valid = (t != IGNORE).float()

        def train():
            h.grad = w.grad = None
            lp, _ = lce(h, w, t.clamp(min=0), 1.0, "none", pg)
            (-(lp * valid).sum() / valid.sum()).backward()

        def score():
            with torch.no_grad():
                lce(h.detach(), w.detach(), t.clamp(min=0), 1.0, "none", pg)

        t_train = do_bench(train, warmup=10, rep=100, return_mode="median")
        t_score = do_bench(score, warmup=10, rep=100, return_mode="median")
        if rank == 0:
            print(f"verl k={world} {N}x{H}x{V}: train {t_train:8.2f} ms  score {t_score:8.2f} ms", flush=True)
        del h, w, t
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
