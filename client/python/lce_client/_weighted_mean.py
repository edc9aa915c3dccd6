"""A class-weighted mean with a z-loss, as both client paths (Client.forward_backward and the torch op)
ask the server for it (docs/MATH.md, "Class weights").

The convention is Liger-Kernel's (src/liger_kernel/ops/cross_entropy.py, linkedin/Liger-Kernel at
ead96b61, liger_cross_entropy_kernel: `loss = loss / sum_non_ignore_weight` but
`z_loss = z_loss / n_non_ignore`, "z_loss is not scaled by weight"): the cross-entropy part is divided
by PyTorch's Σ w_{y_i} over the non-ignored rows (CrossEntropyLoss(weight=)), the z-loss by the count
N_valid of those rows. The server takes no weighted mean; the client asks for the rows' sum with every
row's upstream gradient 1/divisor and the z-loss coefficient λ·divisor/N_valid, so that one pass gives
Σ_i w_{y_i}·ce_i / divisor + λ·Σ_i lse_i² / N_valid, its d_hidden and its dW."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WeightedMean:
    """divisor: Σ w_{y_i} over the non-ignored rows (PyTorch's denominator); where that sum is 0 (PyTorch
    gives nan) N_valid instead, and 1 with no valid row (the loss is then 0). z_loss: the coefficient to
    send, λ·divisor/N_valid. z_scale: N_valid/divisor, which brings a row's z-loss as the server computed
    it (with the sent coefficient) back to λ·lse_i²."""

    divisor: float
    z_loss: float
    z_scale: float


def weighted_mean(class_weights, targets, ignore_index: int, z_loss: float) -> WeightedMean:
    """The WeightedMean of [V] class_weights over these targets (any shape). Targets outside [0, V) are
    left out of the sum: the server rejects the call with its own message."""
    cw = np.asarray(class_weights, dtype=np.float32).reshape(-1)
    y = np.asarray(targets).reshape(-1)
    y = y[y != ignore_index]
    n = int(y.size)
    if n == 0:
        return WeightedMean(divisor=1.0, z_loss=float(z_loss), z_scale=1.0)
    y = y[(y >= 0) & (y < cw.size)]
    total = float(cw[y].astype(np.float64).sum())
    divisor = total if total != 0.0 else float(n)
    return WeightedMean(divisor=divisor, z_loss=float(z_loss) * divisor / n, z_scale=n / divisor)
