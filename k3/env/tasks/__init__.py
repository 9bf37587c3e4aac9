"""The built-in task families; importing this package registers them (k3.env.task.register_family).

`scripted_solution(task)` gives the tool actions a correct agent takes on `task` (k3.env.tasks.common), for
tests and for cold-start trajectories.
"""

from k3.env.task import Task, get_family
from k3.env.tasks import arith, autonomous, code, kernel  # noqa: F401  (registers the families)


def scripted_solution(task: Task) -> list[dict]:
    return get_family(task.family).scripted_solution(task)
