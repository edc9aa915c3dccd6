"""Run by check_wheel.sh in a fresh venv, from a scratch directory: the installed lce_client (not the
source tree's) scores rows of a head this script writes, against a float64 reference, and reports the
server's version. Usage: python wheel_smoke.py write HEAD.safetensors | python wheel_smoke.py score TARGET HEAD.safetensors
"""
import sys
import sysconfig

import numpy as np

import lce_client
import lce_client.local

VOCAB, HIDDEN, ROWS = 257, 32, 16


def head_weight() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.5


def reference(w: np.ndarray, h: np.ndarray, y: np.ndarray):
    """float64 logprob of each row's target and entropy of its softmax."""
    z = h.astype(np.float64) @ w.astype(np.float64).T
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    p = np.exp(z - lse[:, None])
    return z[np.arange(len(y)), y] - lse, lse - (p * z).sum(1)


def main() -> None:
    site = sysconfig.get_paths()["purelib"]
    if not lce_client.__file__.startswith(site):
        sys.exit(f"FAIL: lce_client imported from {lce_client.__file__}, not the venv's {site}")
    if sys.argv[1] == "write":
        lce_client.local.write_safetensors(sys.argv[2], {"lm_head.weight": head_weight()})
        return
    target = sys.argv[2]
    rng = np.random.default_rng(1)
    h = rng.standard_normal((ROWS, HIDDEN)).astype(np.float32)
    y = rng.integers(0, VOCAB, ROWS).astype(np.int32)
    client = lce_client.Client(target, timeout=30)
    info = client.info()
    logprobs, entropy = client.score(h, y)
    want_lp, want_ent = reference(head_weight(), h, y)
    err = max(np.abs(logprobs - want_lp).max(), np.abs(entropy - want_ent).max())
    print(f"lce_client {lce_client.__version__} from {lce_client.__file__}; server {info.server_version}; "
          f"{ROWS} rows scored, max |error| vs float64 {err:.2e}")
    if err > 1e-4:
        sys.exit(f"FAIL: logprob/entropy off the float64 reference by {err}")
    if info.server_version != lce_client.__version__:
        sys.exit(f"FAIL: lce_client {lce_client.__version__} but the server reports {info.server_version}")
    print(lce_client.__version__)


if __name__ == "__main__":
    main()
