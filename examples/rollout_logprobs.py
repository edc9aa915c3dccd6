#!/usr/bin/env python3
"""A rollout worker's call: per-token logprobs and entropy of sampled sequences, from lce-serve.

An RL rollout worker (verl / OpenRLHF / AReaL / SkyRL style) has, for every sampled sequence, the
policy trunk's final hidden states and the sampled token ids. It needs log pi(token | prefix) and the
entropy of the policy at each position, without materialising [tokens, vocab] logits. Here the
"policy trunk" is a small fixed random network (numpy only, no torch needed) and the "sampled" tokens
are drawn uniformly, stand-ins for the inference engine's hidden states and samples. The point is the call:

    logprobs, entropy = client.score(hidden, tokens, temperature=T)

Usage:
    python examples/rollout_logprobs.py                         # starts a local lce_server (CPU)
    python examples/rollout_logprobs.py --target 127.0.0.1:50051  # a running server (README command)
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import lce_client
from lce_client import Client
from lce_client.local import LocalServer


def trunk_hidden(tokens: np.ndarray, hidden_size: int, seed: int) -> np.ndarray:
    """A stand-in for the policy model's last hidden states: [B, T] tokens -> [B, T, H] float32
    (embedding + a running mean over the prefix + a tanh layer; deterministic in `seed`)."""
    rng = np.random.default_rng(seed)
    vocab = int(tokens.max()) + 1
    emb = rng.standard_normal((vocab, hidden_size)).astype(np.float32)
    mix = (rng.standard_normal((hidden_size, hidden_size)) / np.sqrt(hidden_size)).astype(np.float32)
    x = emb[tokens]
    prefix = np.cumsum(x, axis=1) / np.arange(1, tokens.shape[1] + 1, dtype=np.float32)[None, :, None]
    return (np.tanh(prefix @ mix) * 3.0).astype(np.float32)


def to_head_dtype(h: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp32":
        return h
    if dtype == "fp16":
        return h.astype(np.float16)
    return lce_client.f32_to_bf16_bits(h)  # bf16 bits as uint16: the client sends them as bf16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="host:port of a running lce_server (default: start one locally)")
    ap.add_argument("--token", help="bearer token, if the server requires one")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--length", type=int, default=12, help="sampled tokens per sequence")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=8, help="tokens per sequence to print")
    ap.add_argument("--progress", action="store_true", help="tqdm bar for the transfer")
    args = ap.parse_args()

    server = None
    if args.target is None:
        server = LocalServer(["--seed-head=32000x512", "--seed=0", "--head-dtype=bf16"])
        args.target = server.target
        print(f"started lce_server at {args.target} (CPU engine, seeded head 32000x512 bf16)")
    try:
        with Client(args.target, token=args.token, timeout=120) as client:
            info = client.info()
            head = info.head
            print(f"server {info.server_version} backend={info.backend} tp={info.tp_size}: head '{head.name}' "
                  f"V={head.vocab_size} H={head.hidden_size} {head.dtype} v{head.version}")

            rng = np.random.default_rng(args.seed)
            B, T = args.sequences, args.length
            tokens = rng.integers(0, head.vocab_size, size=(B, T))   # the "sampled" completions
            tokens[0, -2:] = -100                                     # padding: ignored positions
            hidden = to_head_dtype(trunk_hidden(np.maximum(tokens, 0), head.hidden_size, args.seed), head.dtype)

            t0 = time.perf_counter()
            logprobs, entropy = client.score(hidden, tokens, temperature=args.temperature, tqdm=args.progress)
            dt = time.perf_counter() - t0

            print(f"\nscored {B} x {T} tokens in {dt * 1e3:.1f} ms (temperature {args.temperature})\n")
            print(f"{'seq':>3} {'pos':>3} {'token':>7} {'logprob':>10} {'prob':>10} {'entropy':>8}")
            for b in range(B):
                for t in range(min(T, args.show)):
                    tok = tokens[b, t]
                    tok_s = "ignored" if tok == -100 else str(tok)
                    print(f"{b:>3} {t:>3} {tok_s:>7} {logprobs[b, t]:>10.4f} {np.exp(logprobs[b, t]):>10.3g} "
                          f"{entropy[b, t]:>8.4f}")
                if T > args.show:
                    print(f"{'':>3} ... ({T - args.show} more)")
            print(f"\n{'seq':>3} {'tokens':>6} {'sum logprob':>12} {'mean entropy':>13}")
            for b in range(B):
                valid = tokens[b] != -100
                print(f"{b:>3} {int(valid.sum()):>6} {logprobs[b][valid].sum():>12.3f} "
                      f"{entropy[b][valid].mean():>13.4f}")
            print(f"\n(uniform sampling over V={head.vocab_size} would give logprob ~ {-np.log(head.vocab_size):.2f}; "
                  f"max entropy is {np.log(head.vocab_size):.2f})")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
