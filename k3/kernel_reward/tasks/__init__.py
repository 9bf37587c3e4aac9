"""The tasks: one module per task in this package, each defining ``TASK``. Adding a task is adding a file."""

from __future__ import annotations

import importlib
import pkgutil

from k3.kernel_reward.task import Task

__all__ = ["all_tasks", "get"]

_tasks: dict[str, Task] | None = None


def all_tasks() -> dict[str, Task]:
    """Every task, by name (the modules of this package, imported on first use)."""
    global _tasks
    if _tasks is None:
        found = {}
        for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            task = importlib.import_module(f"{__name__}.{m.name}").TASK
            found[task.name] = task
        _tasks = found
    return _tasks


def get(name: str) -> Task:
    """The task called `name`; a KeyError listing the tasks otherwise."""
    tasks = all_tasks()
    if name not in tasks:
        raise KeyError(f"no kernel-reward task {name!r}; the tasks are {', '.join(sorted(tasks))}")
    return tasks[name]
