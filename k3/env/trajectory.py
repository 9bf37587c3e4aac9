"""Trajectories: what one episode did, as one JSON record (one line of a JSONL file).

A record holds the task (id, family, split), the harness (name and full config), every message in OpenAI form
(system, user, assistant with reasoning and tool calls, tool results), one step record per assistant turn (its
timings, token usage, finish reason, tool-call outcomes, what the context strategy did, and the policy's extras
such as token ids and log-probs), the answer, the hidden verifier's verdict, the end reason, counts, wall time, and
the trajectories of any sub-agents. Appending a record writes one line and flushes it to disk, so a crash loses at
most the line being written; reading validates every record and names the line and field that is wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

TRAJECTORY_VERSION = 1
END_REASONS = ("submitted", "answered", "max_turns", "max_tokens", "timeout", "error")
COUNT_FIELDS = ("turns", "prompt_tokens", "completion_tokens", "tool_calls", "tool_errors", "submissions")


class TrajectoryError(ValueError):
    """A trajectory record is malformed."""


@dataclass
class Trajectory:
    task_id: str
    family: str
    split: str | None
    harness: str
    harness_config: dict
    messages: list[dict]
    steps: list[dict]
    answer: str | None
    verdict: dict | None          # {"reward", "success", "details", "data"}; None if the verifier never ran
    end_reason: str
    error: str | None = None
    counts: dict = field(default_factory=lambda: {k: 0 for k in COUNT_FIELDS})
    wall_s: float = 0.0
    started_at: str = ""          # ISO 8601, UTC
    public_verdicts: list[dict] = field(default_factory=list)
    subagents: list[dict] = field(default_factory=list)
    version: int = TRAJECTORY_VERSION

    @property
    def reward(self) -> float:
        return float(self.verdict["reward"]) if self.verdict else 0.0

    @property
    def success(self) -> bool:
        return bool(self.verdict and self.verdict["success"])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        validate_record(d)
        return cls(**d)


_TYPES = {"task_id": str, "family": str, "split": (str, type(None)), "harness": str, "harness_config": dict,
          "messages": list, "steps": list, "answer": (str, type(None)), "verdict": (dict, type(None)),
          "end_reason": str, "error": (str, type(None)), "counts": dict, "wall_s": (int, float), "started_at": str,
          "public_verdicts": list, "subagents": list, "version": int}


def validate_record(d) -> None:
    """Raise `TrajectoryError` naming the first field that is missing, unknown or of the wrong type."""
    if not isinstance(d, dict):
        raise TrajectoryError(f"a trajectory record is a JSON object, got {type(d).__name__}")
    for k in d:
        if k not in _TYPES:
            raise TrajectoryError(f"unknown trajectory field {k!r}; fields: {sorted(_TYPES)}")
    for k, t in _TYPES.items():
        if k not in d:
            raise TrajectoryError(f"trajectory field {k!r} is missing")
        if not isinstance(d[k], t) or isinstance(d[k], bool):
            raise TrajectoryError(f"trajectory field {k!r} has type {type(d[k]).__name__}, expected {t}")
    if d["version"] != TRAJECTORY_VERSION:
        raise TrajectoryError(f"trajectory version {d['version']} is not {TRAJECTORY_VERSION}")
    if d["end_reason"] not in END_REASONS:
        raise TrajectoryError(f"trajectory end_reason {d['end_reason']!r} is not one of {list(END_REASONS)}")
    for k in COUNT_FIELDS:
        if not isinstance(d["counts"].get(k), int):
            raise TrajectoryError(f"trajectory counts.{k} is missing or not an integer")
    if d["verdict"] is not None:
        for k in ("reward", "success"):
            if k not in d["verdict"]:
                raise TrajectoryError(f"trajectory verdict.{k} is missing")
    for i, m in enumerate(d["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise TrajectoryError(f"trajectory messages[{i}] has no valid role: {str(m)[:80]}")
        if m["role"] == "tool" and not m.get("tool_call_id"):
            raise TrajectoryError(f"trajectory messages[{i}] is a tool result without tool_call_id")
    for sub in d["subagents"]:
        validate_record(sub)


def append_jsonl(path: str, trajectory: Trajectory) -> None:
    """Append one record as one line, flushed and synced before returning. A record is encoded completely before
    anything is written, so a record that cannot be encoded leaves the file as it was."""
    line = json.dumps(trajectory.to_dict(), ensure_ascii=False, default=str) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str) -> list[Trajectory]:
    """Every record of a JSONL file, validated; an error names the line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TrajectoryError) as e:
                raise TrajectoryError(f"{path}:{n}: {e}") from e
    return out
