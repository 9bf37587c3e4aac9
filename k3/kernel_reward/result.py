"""What scoring a candidate returns: every check with its case, the times, the roofline, the detected hacks, the
reward and the reason, as one record (JSON-ready with `to_dict`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from k3.kernel_reward.hacks import Hack
from k3.kernel_reward.reward import FORMULA

__all__ = ["Check", "Result"]


@dataclass(frozen=True)
class Check:
    """One checked call: its case (label, shape, seed, magnitude), phase, whether it passed and why not."""

    label: str
    shape: dict
    seed: int
    magnitude: str
    phase: str
    passed: bool
    detail: str | None = None


@dataclass
class Result:
    task: str
    candidate: str
    device: str
    passed: bool = False  # every check passed and no hack was detected
    reward: float | None = 0.0  # None: checked only, not timed
    reason: str = ""
    checks: list[Check] = field(default_factory=list)
    hacks: list[Hack] = field(default_factory=list)
    time_s: float | None = None  # median of the timed calls
    times_s: list[float] = field(default_factory=list)
    expert: str | None = None
    expert_time_s: float | None = None
    roofline_time_s: float | None = None
    roofline_fraction: float | None = None  # roofline time / time (1: at the roofline)
    ceilings: str | None = None
    formula: str = FORMULA
    overhead_s: float | None = None  # the harness's wall time for this candidate

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hacks"] = [h.to_dict() for h in self.hacks]
        return d

    def summary(self) -> str:
        """A few lines for people: verdict, times, hacks, reason."""
        n_ok = sum(c.passed for c in self.checks)
        lines = [f"{self.task}: {self.candidate} on {self.device}: reward {self.reward:.3f}"
                 f" ({'passed' if self.passed else 'failed'}; {n_ok}/{len(self.checks)} checks passed)"]
        if self.time_s is not None:
            lines.append(f"  time {self.time_s * 1e3:.4g} ms (median of {len(self.times_s)})"
                         + (f", expert {self.expert_time_s * 1e3:.4g} ms" if self.expert_time_s else "")
                         + (f", roofline {self.roofline_time_s * 1e3:.4g} ms ({self.roofline_fraction:.1%} of it)"
                            if self.roofline_time_s else ""))
        for h in self.hacks:
            lines.append(f"  hack: {h.name}: {h.detail}")
        if self.reason:
            lines.append(f"  reason: {self.reason}")
        return "\n".join(lines)
