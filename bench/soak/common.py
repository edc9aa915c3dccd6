"""What the soak's lanes share: the ledger of requests, faults and failures; the heads with their
reference weights; random batches; and the checks of answers against the float64 reference."""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional

import grpc
import numpy as np

import reference as R

IGNORE = -100
# Per-row bounds against float64 (docs/MATH.md: fp32 accumulation; d_hidden rounded to its dtype).
VALUE_TOL = dict(rtol=2e-5, atol=1e-4)
GRAD_TOL = {"fp32": dict(rtol=1e-4, atol=1e-7), "bf16": dict(rtol=1.2e-2, atol=1e-6), "fp16": dict(rtol=2e-3, atol=1e-6)}
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
DW_TOL = dict(rtol=1e-4, atol=1e-7)


class Ledger:
    """Counts of requests by kind (answered and checked), faults by kind (with the outcome seen), and
    every failure: an answer off the reference, an unexpected status, a broken promise."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Dict[str, int] = collections.Counter()
        self.faults: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.failures: list = []
        self.notes: Dict[str, int] = collections.Counter()

    def ok(self, kind: str) -> None:
        with self._lock:
            self.requests[kind] += 1

    def note(self, what: str) -> None:
        """An expected outcome worth counting that is not a checked answer (e.g. a pinned version gone)."""
        with self._lock:
            self.notes[what] += 1

    def fault(self, kind: str, outcome: str, expected: Iterable[str], detail: str = "") -> bool:
        """Records a fault and its outcome; an outcome outside `expected` is a failure. True if expected."""
        expected = set(expected)
        good = outcome in expected
        with self._lock:
            self.faults[kind][outcome] += 1
        if not good:
            self.fail(f"fault {kind}: got {outcome}, expected one of {sorted(expected)}" + (f" ({detail})" if detail else ""))
        return good

    def fail(self, what: str) -> None:
        with self._lock:
            self.failures.append(f"{time.strftime('%H:%M:%S')} {what}")
        print(f"SOAK FAILURE: {what}", flush=True)

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "faults": {k: dict(v) for k, v in self.faults.items()},
                    "notes": dict(self.notes), "failures": list(self.failures)}


def code_name(e: BaseException) -> str:
    """The gRPC status name of an error (LceError or grpc.RpcError), else the exception's type."""
    code = getattr(e, "code", None)
    if callable(code):
        code = code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return type(e).__name__


@dataclass
class HeadRef:
    """A head on the server and its weight as the reference knows it: one version for the static heads;
    for the trained head, each recent version's weight (the trainer publishes them)."""
    name: str
    dtype: str
    vocab: int
    hidden: int
    versions: Dict[int, np.ndarray] = field(default_factory=dict)  # version -> float64 [V, H]
    _lock: threading.Condition = field(default_factory=threading.Condition)

    def publish(self, version: int, w64: np.ndarray, keep: int = 8) -> None:
        with self._lock:
            self.versions[version] = w64
            for v in sorted(self.versions)[:-keep]:
                del self.versions[v]
            self._lock.notify_all()

    def latest(self):
        with self._lock:
            v = max(self.versions)
            return v, self.versions[v]

    def weight(self, version: int, wait: float = 10.0) -> Optional[np.ndarray]:
        """The weight of `version`, waiting a little for the trainer to publish it."""
        deadline = time.monotonic() + wait
        with self._lock:
            while version not in self.versions and version > max(self.versions) and time.monotonic() < deadline:
                self._lock.wait(0.05)
            return self.versions.get(version)


def random_batch(rng: np.random.Generator, head: HeadRef, rows: int, scale: float = 1.0, ignore_frac: float = 0.1):
    """(stored hidden states [rows, H] in the head's dtype, their float64 values, targets with some ignored)."""
    h32 = (rng.standard_normal((rows, head.hidden)) * scale).astype(np.float32)
    st = R.to_storage(h32, head.dtype)
    y = rng.integers(0, head.vocab, rows).astype(np.int64)
    y[rng.random(rows) < ignore_frac] = IGNORE
    return st, R.to_f64(st, head.dtype), y


def random_options(rng: np.random.Generator) -> dict:
    """temperature / softcap, as the clients take them."""
    k = rng.integers(0, 3)
    if k == 0:
        return {}
    if k == 1:
        return {"temperature": float(rng.choice([0.5, 0.7, 1.3]))}
    return {"temperature": float(rng.choice([0.8, 1.2])), "softcap": float(rng.choice([5.0, 15.0]))}


def ref_forward(w64, h64, y, opts: dict) -> R.Forward:
    return R.forward(w64, h64, y, temperature=opts.get("temperature", 1.0), softcap=opts.get("softcap") or 0.0)


def dhidden_f64(d_hidden, dtype: str) -> np.ndarray:
    return R.to_f64(np.asarray(d_hidden), dtype).reshape(len(d_hidden), -1)


class Checker:
    """Compares answers with the reference and files each difference in the ledger under the request's
    kind. Each method returns True when everything matched."""

    def __init__(self, ledger: Ledger, kind: str, context: str):
        self.ledger, self.kind, self.context = ledger, kind, context
        self.good = True

    def values(self, what: str, got, want, tol=VALUE_TOL) -> None:
        m = R.mismatch(got, want, **tol)
        if m is not None:
            self.good = False
            self.ledger.fail(f"{self.kind} {what}: {m} [{self.context}]")

    def scalar(self, what: str, got: float, want: float, tol=LOSS_TOL) -> None:
        if not abs(got - want) <= tol["atol"] + tol["rtol"] * abs(want):
            self.good = False
            self.ledger.fail(f"{self.kind} {what}: {got!r} vs reference {want!r} [{self.context}]")

    def equal(self, what: str, got, want) -> None:
        if got != want:
            self.good = False
            self.ledger.fail(f"{self.kind} {what}: {got!r} != {want!r} [{self.context}]")

    def done(self) -> bool:
        if self.good:
            self.ledger.ok(self.kind)
        return self.good


def unexpected(ledger: Ledger, kind: str, e: BaseException, context: str = "") -> None:
    """A request that should have succeeded failed."""
    ledger.fail(f"{kind}: unexpected {code_name(e)}: {str(e)[:300]} [{context}]")
