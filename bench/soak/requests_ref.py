"""The soak's computations: a random request of each kind (score, forward_backward, backward,
policy_loss) on a head, sent through any lce_client.Client road (bytes, several streams, shared
memory, the data plane), and its answer checked row by row against the float64 reference."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

import reference as R
from common import (GRAD_TOL, IGNORE, LOSS_TOL, Checker, HeadRef, Ledger, dhidden_f64, random_batch, random_options,
                    ref_forward)

KINDS = ("score", "forward_backward", "backward", "policy_loss")


@dataclass
class Request:
    kind: str
    head: HeadRef
    version: int
    w64: np.ndarray
    st: np.ndarray                 # hidden states as sent (the head's dtype)
    y: np.ndarray
    f: R.Forward                   # the reference forward of these rows
    kw: dict = field(default_factory=dict)  # the call's arguments besides hidden and targets
    ref: dict = field(default_factory=dict)  # what the answer must be

    def describe(self) -> str:
        shown = {k: v for k, v in self.kw.items() if not isinstance(v, np.ndarray)}
        return f"{self.kind} head={self.head.name} v{self.version} rows={len(self.y)} {shown}"


def pick_rows(rng: np.random.Generator, large: int = 500) -> int:
    """Mostly a few to a few hundred rows; now and then enough for several chunks."""
    return int(rng.integers(1, 257)) if rng.random() < 0.9 else int(rng.integers(257, large + 1))


def make_request(rng: np.random.Generator, head: HeadRef, kind: str, rows: Optional[int] = None,
                 version: Optional[int] = None) -> Request:
    """A random request of `kind` on `head` (at `version`, else its latest) and its reference answer."""
    v, w64 = (version, head.weight(version)) if version is not None else head.latest()
    if w64 is None:
        raise KeyError(f"head {head.name!r} has no published version {version}")
    n = rows or pick_rows(rng)
    st, h64, y = random_batch(rng, head, n, scale=float(rng.choice([0.5, 1.0, 2.0])))
    if not (y != IGNORE).any():
        y[0] = int(rng.integers(0, head.vocab))
    opts = random_options(rng)
    f = ref_forward(w64, h64, y, opts)
    req = Request(kind, head, v, w64, st, y, f, kw=dict(opts))
    {"score": _score, "forward_backward": _forward_backward, "backward": _backward,
     "policy_loss": _policy_loss}[kind](rng, req)
    return req


def _score(rng, req: Request) -> None:
    req.kw["entropy"] = bool(rng.random() < 0.8)
    req.ref = {"logprobs": req.f.lp, "entropy": req.f.ent if req.kw["entropy"] else None}


def _forward_backward(rng, req: Request) -> None:
    f = req.f
    kw = req.kw
    kw["reduction"] = str(rng.choice(["mean", "sum", "none"]))
    kw["label_smoothing"] = float(rng.choice([0.0, 0.0, 0.1]))
    kw["z_loss"] = float(rng.choice([0.0, 0.0, 1e-3]))
    kw["return_logprobs"] = bool(rng.random() < 0.3)
    kw["return_entropy"] = bool(rng.random() < 0.3)
    loss = R.ce_loss(f, kw["label_smoothing"], kw["z_loss"])
    valid = int(f.valid.sum())
    if kw["reduction"] == "mean":
        g, total = np.full(len(loss), 1.0 / valid), loss.sum() / valid
    elif kw["reduction"] == "sum":
        g, total = np.ones(len(loss)), loss.sum()
    else:
        g = rng.standard_normal(len(loss)).astype(np.float32) if rng.random() < 0.5 else None
        if g is not None:
            kw["grad_loss"] = g
        g, total = (np.ones(len(loss)) if g is None else g.astype(np.float64)), loss.sum()
    dz = R.ce_grad_z(f, g, kw["label_smoothing"], kw["z_loss"])
    req.ref = {"loss": total, "per_token_loss": loss, "d_hidden": R.d_hidden(f, dz, req.w64), "dz": dz,
               "valid_tokens": valid}


def _backward(rng, req: Request) -> None:
    n = len(req.y)
    u = rng.standard_normal(n).astype(np.float32) if rng.random() < 0.8 else None
    e = rng.standard_normal(n).astype(np.float32) * 0.1 if rng.random() < 0.6 else None
    if u is not None:
        req.kw["grad_logprob"] = u
    if e is not None:
        req.kw["grad_entropy"] = e
    dz = R.generic_grad_z(req.f, np.zeros(n) if u is None else u.astype(np.float64),
                          np.zeros(n) if e is None else e.astype(np.float64))
    req.ref = {"d_hidden": R.d_hidden(req.f, dz, req.w64)}


def _policy_loss(rng, req: Request) -> None:
    f, kw, n = req.f, req.kw, len(req.y)
    b = int(rng.integers(1, min(n, 8) + 1))
    seq = np.sort(rng.integers(0, b, n)).astype(np.int32)
    o = dict(clip_low=0.2, clip_high=float(rng.choice([0.2, 0.28])), dual_clip=float(rng.choice([0.0, 3.0])),
             aggregation=str(rng.choice(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])),
             entropy_coef=float(rng.choice([0.0, 0.01])), kl_coef=float(rng.choice([0.0, 0.05])),
             kl_estimator=str(rng.choice(["k1", "k3"])))
    old = R.away_from_clip_edges(f.lp, f.lp + rng.normal(0, 0.3, n), o["clip_low"], o["clip_high"], o["dual_clip"])
    adv = rng.standard_normal(n).astype(np.float32)
    ref_lp = (f.lp + rng.normal(0, 0.2, n)).astype(np.float32) if o["kl_coef"] > 0 else None
    kw.update(o, sequence_ids=seq, old_logprobs=old, advantages=adv)
    if ref_lp is not None:
        kw["ref_logprobs"] = ref_lp
    p = R.policy_loss(f, old.astype(np.float64), adv.astype(np.float64), seq,
                      None if ref_lp is None else ref_lp.astype(np.float64), **o)
    dz = R.generic_grad_z(f, p.u, p.e)
    req.ref = {"policy": p, "d_hidden": R.d_hidden(f, dz, req.w64), "dz": dz, "valid_tokens": int(f.valid.sum())}


def issue(client, req: Request, hidden=None, **extra):
    """Sends `req` through `client` (hidden: the array to send, e.g. a view of a shared-memory region)."""
    h = req.st if hidden is None else hidden
    kw = dict(req.kw, head=req.head.name, **extra)
    if req.kind == "score":
        return client.score(h, req.y, **kw)
    if req.kind == "backward":
        return client.backward(h, req.y, **kw)
    if req.kind == "forward_backward":
        return client.forward_backward(h, req.y, **kw)
    old, adv = kw.pop("old_logprobs"), kw.pop("advantages")
    return client.policy_loss(h, req.y, old, adv, **kw)


def check(ledger: Ledger, lane: str, req: Request, res) -> bool:
    """The answer of `req` against its reference; every difference is a failure in the ledger."""
    c = Checker(ledger, f"{lane}/{req.kind}", req.describe())
    ref, f = req.ref, req.f
    gtol = GRAD_TOL[req.head.dtype]
    if req.kind == "score":
        lp, ent = res
        c.values("logprobs", lp, ref["logprobs"])
        if ref["entropy"] is None:
            c.equal("entropy", ent, None)
        else:
            c.values("entropy", ent, ref["entropy"])
        return c.done()
    if req.kind == "backward":
        c.values("d_hidden", dhidden_f64(res, req.head.dtype), ref["d_hidden"], gtol)
        return c.done()
    c.equal("valid_tokens", res.valid_tokens, ref["valid_tokens"])
    c.values("d_hidden", dhidden_f64(res.d_hidden, req.head.dtype), ref["d_hidden"], gtol)
    if res.head_version:
        c.equal("head_version", res.head_version, req.version)
    if req.kind == "forward_backward":
        c.scalar("loss", res.loss, ref["loss"])
        c.values("per_token_loss", res.per_token_loss, ref["per_token_loss"])
        if req.kw["return_logprobs"]:
            c.values("logprobs", res.logprobs, f.lp)
        if req.kw["return_entropy"]:
            c.values("entropy", res.entropy, f.ent)
        return c.done()
    p = ref["policy"]
    c.scalar("loss", res.loss, p.loss)
    c.values("logprobs", res.logprobs, f.lp)
    c.values("entropy", res.entropy, f.ent)
    for name in ("approx_kl", "mean_entropy", "mean_ratio", "mean_kl"):
        c.scalar(name, getattr(res, name), getattr(p, name), LOSS_TOL)
    c.scalar("clip_fraction", res.clip_fraction, p.clip_fraction, dict(rtol=0, atol=1e-9))
    return c.done()
