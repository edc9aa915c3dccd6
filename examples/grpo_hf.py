#!/usr/bin/env python3
"""GRPO on a tiny Hugging Face model, with its head on lce-serve: the head is trained on the server, the
body (embeddings, transformer blocks, final norm) here.

Toy task: prompts are random token sequences; the policy samples G completions of T tokens for each
(`model.generate`, logits from the local copy of the head, refreshed from the server every step), and a
completion's reward is the fraction of its tokens in the "good" set (the lowest quarter of the vocabulary).
Each step:

  1. rollout: `model.generate` (sampling, temperature 1)
  2. old logprobs from the service under the policy head, ref logprobs under a frozen reference head
     (`lce_client.rl.per_token_logps`: the body runs here, Score on the server)
  3. group-normalised advantages (GRPO)
  4. the fused policy loss (`lce_client.rl.remote_policy_loss`: clipped surrogate + k3 KL to the reference,
     one PolicyLoss round trip returning the loss and d_hidden, with dW accumulated on the server);
     `loss.backward()` trains the body through d_hidden, AdamW here
  5. AdamW on the server for the head (`OptimizerStep`), then `pull_weights` (SaveHead, read back) so that
     the next rollout samples from the new head

The reward curve is drawn to a PNG.

    python examples/grpo_hf.py                        # starts a local lce_server (CPU engine)
    python examples/grpo_hf.py --target HOST:PORT     # a running one on this host (pull_weights reads the
                                                      # files SaveHead writes: same host or shared disk)
    python examples/grpo_hf.py --steps 60 --png grpo_hf.png --json rewards.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import transformers

import lce_client
import lce_client.rl as rl
from lce_client.hf import apply_remote_head
from lce_client.local import LocalServer


def make_model(vocab: int, hidden: int, layers: int, seed: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()


def run(client: lce_client.Client, args) -> dict:
    V = args.vocab
    model = make_model(V, args.hidden, args.layers, args.seed)
    # The policy head on the server (LoadHead + UpdateWeights of model.lm_head.weight), trained there.
    rh = apply_remote_head(model, client, head="grpo-policy", train_head="server")
    ref = client.load_head("grpo-ref", clone_of="grpo-policy")  # frozen reference: the policy at step 0
    body_params = [p for n, p in model.named_parameters() if n != "lm_head.weight"]
    opt = torch.optim.AdamW(body_params, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    P, G, T, L = args.prompts, args.group, args.tokens, args.prompt_len
    good = V // 4
    history = []
    print(f"{'step':>4} {'reward':>7} {'loss':>9} {'clip%':>6} {'kl_ref':>9} {'head v':>6} {'s':>5}")
    pull_dir = tempfile.mkdtemp(prefix="grpo_hf_")
    for step in range(args.steps):
        t0 = time.perf_counter()
        prompts = torch.randint(0, V, (P, L), generator=g).repeat_interleave(G, dim=0)   # [P*G, L]
        # 1. rollout from the local copy of the head (the server has no sampling call)
        model.eval()
        with torch.no_grad():
            seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                                  top_p=1.0, temperature=1.0, max_new_tokens=T, min_new_tokens=T, pad_token_id=0)
        model.train()
        mask = torch.ones_like(seqs)
        completion = seqs[:, -T:]
        # 2. old (policy) and reference logprobs from the service
        with torch.no_grad():
            old, _ = rl.per_token_logps(model, seqs, mask, T, remote_head=rh)
            ref_lp, _ = rl.per_token_logps(model, seqs, mask, T, client=client, head="grpo-ref")
        # 3. rewards and group-normalised advantages
        reward = (completion < good).float().mean(dim=1).reshape(P, G)
        adv = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)
        adv_tok = adv.reshape(-1, 1).expand(-1, T).contiguous()
        # 4. the fused policy loss on the server: the body gets d_hidden, the head's dW accumulates there
        hidden = model.base_model(input_ids=seqs, attention_mask=mask).last_hidden_state[:, -T - 1:-1, :]
        loss, stats = rl.remote_policy_loss(hidden, completion, old, adv_tok, client, head=rh.head,
                                            ref_logprobs=ref_lp, clip_low=0.2, clip_high=0.28, kl_coef=args.kl_coef,
                                            kl_estimator="k3", aggregation="seq-mean-token-mean",
                                            accumulate_weight_grad=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(body_params, 1.0)
        opt.step()
        # 5. the head's AdamW step on the server, and its new weight back here for the next rollout
        _, head_info, _ = rh.optimizer_step(lr=args.lr, weight_decay=0.0, max_grad_norm=1.0)
        rh.pull_weights(pull_dir)
        row = dict(step=step, reward=float(reward.mean()), loss=loss.item(), clip=stats.clip_fraction,
                   kl_ref=stats.mean_kl, head_version=head_info.version, seconds=time.perf_counter() - t0)
        history.append(row)
        print(f"{step:4d} {row['reward']:7.3f} {row['loss']:9.5f} {100 * row['clip']:6.1f} {row['kl_ref']:9.2e} "
              f"{row['head_version']:6d} {row['seconds']:5.2f}")
    ref_after = client.head_info("grpo-ref", refresh=True)
    first = sum(r["reward"] for r in history[:5]) / max(1, len(history[:5]))
    last = sum(r["reward"] for r in history[-5:]) / max(1, len(history[-5:]))
    print(f"reward: first steps {first:.3f} -> last steps {last:.3f} (random policy: {good / V:.3f}); reference head "
          f"version {ref.version} -> {ref_after.version} (frozen)")
    return {"history": history, "ref_version_before": ref.version, "ref_version_after": ref_after.version,
            "good_fraction": good / V}


def plot(history, path, good_fraction):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    rewards = [r["reward"] for r in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, marker="o", ms=3, lw=1.5, label="mean reward of the rollouts")
    ax.axhline(good_fraction, color="gray", ls="--", lw=1, label="uniform policy")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (fraction of good tokens)")
    ax.set_title("GRPO on a tiny HF Llama, head trained on lce-serve")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="a running lce_server on this host (default: start one, CPU engine)")
    ap.add_argument("--token", help="bearer token (an admin token where the server has auth)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--tokens", type=int, default=8, help="tokens per completion (T)")
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--kl-coef", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--png", default="grpo_hf.png", help="where to draw the reward curve ('' for none)")
    ap.add_argument("--json", help="write the history here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    server = None
    target = args.target
    if target is None:
        server = LocalServer(["--seed-head=8x8", "--head-dtype=fp32", "--cpu-threads=1", "--log-requests=false"])
        target = server.target
        print(f"started lce_server at {target} (CPU engine)")
    try:
        with lce_client.Client(target, token=args.token, timeout=120) as client:
            print("running on:\n" + client.describe())
            out = run(client, args)
    finally:
        if server is not None:
            server.stop()
    if args.png:
        plot(out["history"], args.png, out["good_fraction"])
        print(f"reward curve drawn to {os.path.abspath(args.png)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
