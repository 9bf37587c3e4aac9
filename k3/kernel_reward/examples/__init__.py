"""Example candidates: honest ones (torch, Triton), broken ones (wrong, crash, raises, hang, oom) and one per
hack the detectors catch (hack_*). The tests, the README and the benchmark use them."""

import os

DIR = os.path.dirname(os.path.abspath(__file__))


def path(name: str) -> str:
    return os.path.join(DIR, f"{name}.py")


def source(name: str) -> str:
    with open(path(name)) as f:
        return f.read()
