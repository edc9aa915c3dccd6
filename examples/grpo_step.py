#!/usr/bin/env python3
"""GRPO against lce-serve: the policy head is trained on the server, a frozen reference copy of it
gives the KL penalty, and each step is one PolicyLoss round trip plus one OptimizerStep.

Toy task: for each prompt (a fixed random hidden-state sequence, standing in for a trunk's output),
G completions of T tokens are sampled; the reward of a completion is the fraction of its tokens that
equal a "good" token. GRPO advantages are the group-normalised rewards, broadcast over the tokens.
The policy should learn to put more probability on the good token; the reference must not move.

    python examples/grpo_step.py                      # starts a local server (CPU engine)
    python examples/grpo_step.py --target HOST:PORT   # or uses a running one or a TP group (its default head)
    python examples/grpo_step.py --target A:P,B:P     # data-parallel replicas of one training job

It prints what it ran on (GetInfo of each replica: backend, tensor-parallel size, head). Rollout scores are
spread over the replicas and pinned to the policy version just trained (a replica that is not at that
version answers FAILED_PRECONDITION rather than score with a stale head); PolicyLoss with dW, and the
optimizer step, go to the first target.
"""
from __future__ import annotations

import argparse

import numpy as np

import lce_client
from lce_client.local import LocalServer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append",
                    help="running lce_server or group (default: start one with a seeded fp32 head); replicas of one "
                         "training job: several, comma-separated or --target again")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per completion (T)")
    ap.add_argument("--good-token", type=int, default=7)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    server = None
    target = ",".join(args.target) if args.target else None
    if target is None:
        server = LocalServer(["--seed-head=512x64", "--head-dtype=fp32", "--seed=3", "--log-requests=false"])
        target = server.target
    try:
        return run(lce_client.Client(target, timeout=120), args)
    finally:
        if server is not None:
            server.stop()


def run(client: lce_client.Client, args) -> dict:
    print("running on:\n" + client.describe())
    info = client.info()
    V, H = info.head.vocab_size, info.head.hidden_size
    policy = info.head.name
    version = info.head.version
    ref = client.load_head("ref", clone_of=policy)  # frozen reference: a copy of the policy now
    rng = np.random.default_rng(args.seed)
    P, G, T = args.prompts, args.group, args.tokens
    # Hidden states per prompt position (fixed features); every completion of a prompt sees them.
    prompt_h = rng.standard_normal((P, T, H)).astype(np.float32)
    hidden = np.repeat(prompt_h[:, None], G, axis=1).reshape(P * G * T, H)
    seq_ids = np.repeat(np.arange(P * G, dtype=np.int32), T)
    good = np.full(P * G * T, args.good_token, dtype=np.int32)

    history = []
    print(f"{'step':>4} {'reward':>7} {'loss':>9} {'clip%':>6} {'approx_kl':>10} {'kl_ref':>8} {'logp(good)':>11} "
          f"{'version':>7}")
    for step in range(args.steps):
        # Rollout: sample tokens (half from the good token's neighbourhood, so rewards vary), score them.
        tokens = np.where(rng.random(P * G * T) < 0.15, args.good_token, rng.integers(0, V, P * G * T)).astype(np.int32)
        old_lp, _ = client.score(hidden, tokens, head=policy, entropy=False, head_version=version)
        ref_lp, _ = client.score(hidden, tokens, head="ref", entropy=False)
        reward = (tokens.reshape(P, G, T) == args.good_token).mean(axis=2)          # [P, G]
        adv = (reward - reward.mean(axis=1, keepdims=True)) / (reward.std(axis=1, keepdims=True) + 1e-6)
        adv_tok = np.repeat(adv.reshape(-1), T).astype(np.float32)
        # One fused round trip: loss, statistics, and dW accumulated into the policy head's buffer.
        r = client.policy_loss(hidden, tokens, old_lp, adv_tok, sequence_ids=seq_ids, ref_logprobs=ref_lp,
                               clip_low=0.2, clip_high=0.28, aggregation="seq-mean-token-mean",
                               entropy_coef=0.0, kl_coef=0.01, kl_estimator="k3", head=policy,
                               accumulate_weight_grad=True)
        grad_norm, head, _ = client.optimizer_step(policy, lr=args.lr, max_grad_norm=1.0, zero_grad=True)
        version = head.version
        good_lp, _ = client.score(hidden, good, head=policy, entropy=False, head_version=version)
        row = dict(step=step, reward=float(reward.mean()), loss=r.loss, clip=r.clip_fraction, approx_kl=r.approx_kl,
                   kl_ref=r.mean_kl, good_logprob=float(good_lp.mean()), version=head.version, grad_norm=grad_norm)
        history.append(row)
        print(f"{step:4d} {row['reward']:7.3f} {r.loss:9.5f} {100 * r.clip_fraction:6.1f} {r.approx_kl:10.2e} "
              f"{r.mean_kl:8.2e} {row['good_logprob']:11.4f} {head.version:7d}")
    ref_now = client.head_info("ref", refresh=True)
    ref_lp_good, _ = client.score(hidden, good, head="ref", entropy=False)
    print(f"policy: log p(good token) {history[0]['good_logprob']:.4f} -> {history[-1]['good_logprob']:.4f}; "
          f"reference (version {ref_now.version}, frozen): {float(ref_lp_good.mean()):.4f}")
    return {"history": history, "ref_version_before": ref.version, "ref_version_after": ref_now.version,
            "ref_good_logprob": float(ref_lp_good.mean())}


if __name__ == "__main__":
    main()
