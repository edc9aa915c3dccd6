"""Float64 numpy reference of the loss head (docs/MATH.md), for the soak's checks of every answer:
logprob, entropy, loss, d_hidden of ForwardBackward / Backward / PolicyLoss, dW, and the AdamW step
(in fp32, in the order kernels/training.cc does it, so that a step of the server's own dW gives the
server's weights)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

import lce_client

_ST_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def to_f64(stored: np.ndarray, dtype: str) -> np.ndarray:
    """Exact values of stored elements (bf16 as uint16 bits) as float64."""
    if dtype == "bf16":
        return lce_client.bf16_bits_to_f32(stored).astype(np.float64)
    return np.asarray(stored).astype(np.float64)


def to_storage(x32: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the dtype's storage (uint16 bits for bf16), rounded to nearest even."""
    if dtype == "fp32":
        return np.ascontiguousarray(x32, dtype=np.float32)
    if dtype == "fp16":
        return np.ascontiguousarray(x32, dtype=np.float16)
    return lce_client.f32_to_bf16_bits(np.ascontiguousarray(x32, dtype=np.float32))


def read_saved_head(index_file: str):
    """A head written by SaveHead (index + shards): (stored weight [V, H], dtype name)."""
    index = json.loads(Path(index_file).read_text())
    parts, dtype = [], None
    for shard in index["shards"]:
        raw = (Path(index_file).parent / shard["file"]).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8:8 + n])[index.get("tensor", "lm_head.weight")]
        dtype = _ST_DTYPES[meta["dtype"]]
        a, b = meta["data_offsets"]
        np_type = {"fp32": "<f4", "fp16": "<f2", "bf16": "<u2"}[dtype]
        parts.append(np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np_type).reshape(meta["shape"]))
    return np.concatenate(parts), dtype


@dataclass
class Forward:
    """One request's materialised logits and what follows from them, all float64."""
    h: np.ndarray        # [N, H]
    a: np.ndarray        # pre-softcap logits [N, V]
    z: np.ndarray        # logits after softcap and temperature
    p: np.ndarray        # softmax
    lse: np.ndarray
    lp: np.ndarray       # 0 on ignored rows
    ent: np.ndarray
    valid: np.ndarray    # bool [N]
    y: np.ndarray        # targets, ignored rows set to 0
    temperature: float
    softcap: float


def forward(w64, h64, targets, temperature=1.0, softcap=0.0, ignore_index=-100) -> Forward:
    y = np.asarray(targets, dtype=np.int64).reshape(-1)
    a = h64 @ w64.T
    z = (softcap * np.tanh(a / softcap) if softcap else a) / temperature
    m = z.max(axis=1, keepdims=True)
    e = np.exp(z - m)
    s = e.sum(axis=1, keepdims=True)
    lse = (m + np.log(s))[:, 0]
    p = e / s
    valid = y != ignore_index
    yy = np.where(valid, y, 0)
    zy = z[np.arange(len(y)), yy]
    lp = np.where(valid, zy - lse, 0.0)
    ent = lse - (p * z).sum(axis=1)
    return Forward(h64, a, z, p, lse, lp, ent, valid, yy, temperature, softcap)


def ce_loss(f: Forward, label_smoothing=0.0, z_loss=0.0) -> np.ndarray:
    loss = -(1 - label_smoothing) * f.lp + label_smoothing * (f.lse - f.z.mean(axis=1)) + z_loss * f.lse ** 2
    return np.where(f.valid, loss, 0.0)


def _onehot(f: Forward) -> np.ndarray:
    oh = np.zeros_like(f.p)
    oh[np.arange(len(f.y)), f.y] = 1.0
    return oh


def ce_grad_z(f: Forward, g: np.ndarray, label_smoothing=0.0, z_loss=0.0) -> np.ndarray:
    """dL/dz of sum_i g_i * loss_i (g_i = 0 on ignored rows)."""
    V = f.p.shape[1]
    g = np.where(f.valid, g, 0.0)[:, None]
    return g * (f.p - (1 - label_smoothing) * _onehot(f) - label_smoothing / V + 2 * z_loss * f.lse[:, None] * f.p)


def generic_grad_z(f: Forward, u: np.ndarray, e: np.ndarray) -> np.ndarray:
    """dL/dz from upstream grads u (of logprob; none on ignored rows) and e (of entropy)."""
    u = np.where(f.valid, u, 0.0)[:, None]
    pz = (f.p * f.z).sum(axis=1, keepdims=True)
    return u * (_onehot(f) - f.p) + e[:, None] * (-f.p * (f.z - pz))


def grad_a(f: Forward, dz: np.ndarray) -> np.ndarray:
    """dL/da: through the temperature and the softcap."""
    da = dz / f.temperature
    if f.softcap:
        da = da * (1 - np.tanh(f.a / f.softcap) ** 2)
    return da


def d_hidden(f: Forward, dz: np.ndarray, w64: np.ndarray) -> np.ndarray:
    return grad_a(f, dz) @ w64


def d_weight(f: Forward, dz: np.ndarray) -> np.ndarray:
    return grad_a(f, dz).T @ f.h


@dataclass
class PolicyRef:
    loss: float
    u: np.ndarray
    e: np.ndarray
    clip_fraction: float
    approx_kl: float
    mean_entropy: float
    mean_ratio: float
    mean_kl: float


def policy_loss(f: Forward, old, adv, seq, ref_lp, *, clip_low, clip_high, dual_clip, aggregation, entropy_coef,
                kl_coef, kl_estimator) -> PolicyRef:
    """docs/MATH.md, "Policy loss": the loss, its upstream grads (u of logprob, e of entropy) and statistics."""
    v = f.valid
    lp, H = f.lp, f.ent
    ratio = np.exp(lp - old)
    unclipped, clipped = -adv * ratio, -adv * np.clip(ratio, 1 - clip_low, 1 + clip_high)
    pg = np.maximum(unclipped, clipped)
    took_clipped = clipped > unclipped
    dpg = np.where(took_clipped, 0.0, -adv * ratio)
    if dual_clip > 1:
        dual = (adv < 0) & (pg > -adv * dual_clip)
        pg = np.where(dual, -adv * dual_clip, pg)
        dpg = np.where(dual, 0.0, dpg)
    d = (ref_lp - lp) if ref_lp is not None else np.zeros_like(lp)
    if kl_coef == 0:
        kl, dkl = np.zeros_like(lp), np.zeros_like(lp)
    elif kl_estimator == "k1":
        kl, dkl = -d, np.ones_like(lp)
    else:
        kl, dkl = np.exp(d) - d - 1, 1 - np.exp(d)
    L = pg + kl_coef * kl - entropy_coef * H
    nseq = int(seq.max()) + 1
    counts = np.bincount(seq[v], minlength=nseq).astype(np.float64)
    if aggregation == "token-mean":
        w = np.full(len(lp), 1.0 / max(1, v.sum()))
    elif aggregation == "seq-mean-token-sum":
        w = np.full(len(lp), 1.0 / nseq)
    else:
        w = 1.0 / (nseq * np.maximum(counts[seq], 1))
    w = np.where(v, w, 0.0)
    n = max(1, int(v.sum()))
    return PolicyRef(loss=float((w * L).sum()), u=w * (dpg + kl_coef * dkl), e=-w * entropy_coef,
                     clip_fraction=float(took_clipped[v].sum() / n), approx_kl=float((old - lp)[v].sum() / n),
                     mean_entropy=float(H[v].sum() / n), mean_ratio=float(ratio[v].sum() / n),
                     mean_kl=float(kl[v].sum() / n))


def away_from_clip_edges(lp, old, clip_low, clip_high, dual_clip, margin=1e-3):
    """old logprobs moved so that no ratio exp(lp - old) lies within `margin` (relative) of an edge where
    the clipped surrogate changes branch (1 - clip_low, 1 + clip_high, dual_clip): there the server's
    fp32 logprob and this float64 one may take different branches, legitimately."""
    old = np.array(old, dtype=np.float64)
    for edge in (1 - clip_low, 1 + clip_high) + ((dual_clip,) if dual_clip > 1 else ()):
        r = np.exp(lp - old)
        near = np.abs(r / edge - 1) < margin
        old[near] -= 3 * margin  # the ratio grows by about 3 * margin: off the edge
    return old.astype(np.float32)


@dataclass
class AdamState:
    """The reference of a head's optimizer state (fp32, as the server's)."""
    p: np.ndarray
    m: np.ndarray
    v: np.ndarray
    t: int = 0


def clip_scale(norm: float, max_grad_norm: float) -> np.float32:
    """kernels/training.cc ClipScale."""
    if max_grad_norm > 0 and norm > np.float32(max_grad_norm):
        return np.float32(np.float64(np.float32(max_grad_norm)) / (norm + 1e-6))
    return np.float32(1.0)


def adamw_step(s: AdamState, grad: np.ndarray, lr, beta1, beta2, eps, weight_decay, grad_scale) -> None:
    """One AdamW step in fp32, each operation rounded on its own, in kernels/training.cc's order."""
    f = np.float32
    lr, beta1, beta2, eps, weight_decay = f(lr), f(beta1), f(beta2), f(eps), f(weight_decay)
    s.t += 1
    bc1 = 1.0 - np.float64(beta1) ** s.t
    bc2 = 1.0 - np.float64(beta2) ** s.t
    step_size, bc2_sqrt, decay = f(np.float64(lr) / bc1), f(np.sqrt(bc2)), f(1) - lr * weight_decay
    g = grad.astype(np.float32) * f(grad_scale)
    s.p *= decay
    s.m[:] = beta1 * s.m + (f(1) - beta1) * g
    s.v[:] = beta2 * s.v + (f(1) - beta2) * g * g
    denom = np.sqrt(s.v) / bc2_sqrt + eps
    s.p -= step_size * s.m / denom


def new_adam(w: np.ndarray) -> AdamState:
    w = np.array(w, dtype=np.float32)
    return AdamState(p=w, m=np.zeros_like(w), v=np.zeros_like(w))


def row_errors(got, want, rtol, atol):
    """Per row: max |got - want| and its bound atol + rtol * max |want| of the row; rows of 1-D inputs
    are the elements."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return None
    if got.ndim == 1:
        return np.abs(got - want), atol + rtol * np.abs(want)
    err = np.abs(got - want).reshape(len(got), -1).max(axis=1)
    return err, atol + rtol * np.abs(want).reshape(len(want), -1).max(axis=1)


def mismatch(got, want, rtol, atol) -> Optional[str]:
    """None when every row of `got` is within its bound of `want`; else what differs and where."""
    r = row_errors(got, want, rtol, atol)
    if r is None:
        return f"shape {np.shape(got)} != {np.shape(want)}"
    err, bound = r
    bad = np.nonzero(~(err <= bound))[0]
    if not len(bad):
        return None
    i = int(bad[0])
    return f"{len(bad)} row(s) off, first row {i}: error {err[i]:.3g} > bound {bound[i]:.3g}"
