"""Learning-rate schedule: linear warmup over the first 1% of training, then cosine decay (report §3.3)."""

from __future__ import annotations

import math


def lr_multiplier(progress: float, warmup_frac: float = 0.01, min_ratio: float = 0.1) -> float:
    """Multiplier of the peak learning rate at `progress` in [0, 1] of the run.

    Warmup rises linearly from 0 (exclusive) to 1 over `warmup_frac`; the cosine then falls to `min_ratio`.
    """
    p = min(max(progress, 0.0), 1.0)
    if warmup_frac > 0 and p < warmup_frac:
        return max(p / warmup_frac, 1e-3)
    q = (p - warmup_frac) / max(1.0 - warmup_frac, 1e-12)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * q))
