"""The reward of a correct, honest kernel from its time (report §4.2.4): 0.5 at the expert's time, rising toward 1
as the time approaches the roofline, falling toward 0 as it gets slower than the expert.

    t <= t_expert:  r = 0.5 + 0.5 * log(t_expert / t) / log(t_expert / t_roof),  clipped to [0.5, 1]
    t >  t_expert:  r = 0.5 * t_expert / t

Log-time above the expert, because each halving of the gap to the roofline is equally hard; a plain ratio below
it, so a kernel twice as slow as the expert gets 0.25 and one ten times slower 0.05. The two halves meet at 0.5
and r never increases with t. A roofline at or above the expert's time means a ceiling was measured too low (a busy
CPU); it is then taken as half the expert's time, so the expert still scores 0.5. A failed check or a detected hack
gives 0 whatever the time.
"""

from __future__ import annotations

import math

__all__ = ["FORMULA", "effective_roofline", "reward"]

FORMULA = ("r = 0 if a check fails or a hack is detected; else for t <= t_expert: r = 0.5 + 0.5 * "
           "log(t_expert/t) / log(t_expert/t_roof) clipped to [0.5, 1] (t_roof taken as t_expert/2 when not below "
           "t_expert); for t > t_expert: r = 0.5 * t_expert / t")


def reward(t: float, t_expert: float, t_roof: float) -> float:
    """The reward of a correct kernel taking `t` seconds, against the expert's `t_expert` and the roofline's
    `t_roof` (all positive)."""
    if not (t > 0 and t_expert > 0 and t_roof > 0):
        raise ValueError(f"times must be positive, got t={t}, t_expert={t_expert}, t_roof={t_roof}")
    if t > t_expert:
        return 0.5 * t_expert / t
    t_roof = effective_roofline(t_expert, t_roof)
    r = 0.5 + 0.5 * math.log(t_expert / t) / math.log(t_expert / t_roof)
    return min(1.0, max(0.5, r))


def effective_roofline(t_expert: float, t_roof: float) -> float:
    """The roofline the formula uses: `t_roof`, or half the expert's time when the expert is not slower than it."""
    return t_roof if t_roof < t_expert else 0.5 * t_expert
