"""Verifiable tasks (report §4.2.3-4.2.6): the interface every task family implements.

A `Task` is one problem instance: the prompt the agent reads, the image its sandbox starts from, the tools it may
use, its budget, and its verifiers. Verifiers live on the host, never in the sandbox: the hidden one runs after the
episode, in a fork of the final sandbox into which it copies whatever hidden material it needs (hidden tests), so
the agent can neither read nor change it. A public verifier (autonomous execution tasks) gives diagnostic feedback
through the `submit` tool, a limited number of times.

A `TaskFamily` generates instances: `instances(split, n, seed)` is a pure function of its arguments, "train" and
"test" (held out) never share an instance.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Iterator

from k3.env.sandbox import Sandbox

SPLITS = ("train", "test")


@dataclass
class Verdict:
    """The verifier's judgement. `reward` is what RL trains on (usually 1.0 success / 0.0 failure, a kernel's
    reward in [0, 1]); `details` is diagnostic text (never shown to the agent for the hidden verifier)."""
    reward: float
    success: bool
    details: str = ""
    data: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"reward": self.reward, "success": self.success, "details": self.details, "data": self.data}


@dataclass
class Budget:
    turns: int = 16             # assistant messages
    tokens: int = 8192          # completion tokens over the whole episode
    wall_seconds: float = 600.0


@dataclass
class Task:
    """One problem. `image` maps workspace-relative paths to file contents (the sandbox's starting state).
    `verify(sandbox)` is the hidden verifier, called on a fork of the final sandbox with the agent's submitted
    answer (None if it never submitted); `public_verify` (optional) answers `submit` calls during the episode,
    at most `max_submissions` times."""
    id: str
    family: str
    prompt: str
    verify: Callable[[Sandbox, str | None], Verdict]
    image: dict[str, str | bytes] = field(default_factory=dict)
    tools: tuple[str, ...] | None = None        # names of the tools allowed (None: the harness's own set)
    budget: Budget = field(default_factory=Budget)
    public_verify: Callable[[Sandbox, str | None], Verdict] | None = None
    max_submissions: int = 1
    metadata: dict = field(default_factory=dict)
    split: str | None = None                    # "train" or "test" when drawn from a family (kept in trajectories)


class TaskFamily(abc.ABC):
    name: str = ""
    description: str = ""

    @abc.abstractmethod
    def instances(self, split: str, n: int, seed: int = 0) -> Iterator[Task]:
        """`n` instances of `split` ("train" or "test"), deterministic in (split, n, seed)."""


_FAMILIES: dict[str, Callable[[], TaskFamily]] = {}


def register_family(name: str):
    """Class decorator: make a family available by name to `k3 env run --tasks NAME`."""
    def deco(cls):
        cls.name = name
        _FAMILIES[name] = cls
        return cls
    return deco


def families() -> dict[str, Callable[[], TaskFamily]]:
    import k3.env.tasks  # noqa: F401  (registers the built-in families)
    return dict(_FAMILIES)


def get_family(name: str) -> TaskFamily:
    fams = families()
    if name not in fams:
        raise ValueError(f"unknown task family {name!r}; known: {sorted(fams)}")
    return fams[name]()


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
