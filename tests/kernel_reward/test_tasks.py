"""Every task is well formed: inputs are a pure function of (shape, seed, magnitude), its CPU expert passes its own
checks against the float64 reference on every case (in this process), and its roofline is positive."""

import importlib

import pytest
import torch

from k3.kernel_reward.ceilings import ceilings, roofline_time
from k3.kernel_reward.task import as_tuple, cases, compare
from k3.kernel_reward.tasks import all_tasks, get

TASKS = sorted(all_tasks())


def _expert(task):
    mod, fn = task.expert("cpu").split(":")
    return getattr(importlib.import_module(mod), fn)


@pytest.mark.parametrize("name", TASKS)
def test_cpu_expert_passes_every_case(name):
    task = get(name)
    kernel = _expert(task)
    for case in cases(task, "cpu"):
        args = task.make(case.shape, case.seed, case.magnitude, "cpu")
        outs, refs = as_tuple(kernel(*args)), as_tuple(task.reference(*args))
        tol = task.precision if case.label == "precision" else task.tolerance
        for o, r, dt in zip(outs, refs, task.out_dtypes):
            assert compare(o, r, dt, tol) is None, (case.describe(), compare(o, r, dt, tol))


@pytest.mark.parametrize("name", TASKS)
def test_inputs_are_reproducible_and_differ_by_seed(name):
    task = get(name)
    shape = task.held_out[-1]
    a, b, c = (task.make(shape, s, "normal", "cpu") for s in (5, 5, 6))
    tensors = [i for i, x in enumerate(a) if isinstance(x, torch.Tensor)]
    assert all(torch.equal(a[i], b[i]) for i in tensors)
    assert any(a[i].dtype.is_floating_point and not torch.equal(a[i], c[i]) for i in tensors)


@pytest.mark.parametrize("name", TASKS)
def test_roofline_is_positive_on_both_devices(name):
    task = get(name)
    for device in ("cpu", "cuda"):
        shape = task.bench_shape(device)
        assert roofline_time(task.flops(shape), task.bytes(shape), ceilings(device)) > 0
    assert task.tolerance.why and task.signature.startswith("kernel(")
