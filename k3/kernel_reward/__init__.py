"""The kernel-optimization reward (report §4.2.4): score a candidate kernel for correctness and speed against a
task's reference, expert and roofline, and catch reward hacking.

    from k3.kernel_reward import score
    result = score("rms_norm", open("my_kernel.py").read(), device="cuda")
    result.reward, result.reason

One concept per module: task (what a task is), tasks/ (one file per task), runner (the candidate's process and its
limits; forkserver), worker and guard (inside that process), timing, ceilings (roofline), reward (the formula),
hacks (the detectors), result, scoring (putting them together), cli. Imports k3.ops only. The names below load on
first use, so that ``k3 --help`` does not import torch.
"""

import importlib

_EXPORTS = {"Check": "result", "Result": "result", "FORMULA": "reward", "reward": "reward", "Limits": "runner",
            "expert_time": "scoring", "score": "scoring", "score_many": "scoring", "source_of": "scoring",
            "all_tasks": "tasks", "get": "tasks"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"k3.kernel_reward.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'k3.kernel_reward' has no attribute {name!r}")
