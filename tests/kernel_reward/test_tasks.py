"""Every task is well formed: inputs are a pure function of (shape, seed, magnitude), its CPU expert passes its own
checks against the float64 reference on every case (in this process), and its roofline is positive."""

import importlib

import pytest
import torch

from k3.kernel_reward.ceilings import ceilings, roofline_time
from k3.kernel_reward.task import as_tuple, cases, compare
from k3.kernel_reward.tasks import all_tasks, get

TASKS = sorted(all_tasks())


def _expert(task, device="cpu"):
    mod, fn = task.expert(device).split(":")
    return getattr(importlib.import_module(mod), fn)


def _passes_every_case(task, kernel, device):
    for case in cases(task, device):
        args = task.make(case.shape, case.seed, case.magnitude, device)
        outs, refs = as_tuple(kernel(*args)), as_tuple(task.reference(*args))
        tol = task.precision if case.label == "precision" else task.tolerance
        for o, r, dt in zip(outs, refs, task.out_dtypes):
            assert compare(o, r, dt, tol) is None, (case.describe(), compare(o, r, dt, tol))


@pytest.mark.parametrize("name", TASKS)
def test_cpu_expert_passes_every_case(name):
    task = get(name)
    _passes_every_case(task, _expert(task), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", TASKS)
def test_cuda_expert_passes_every_case(name):
    """The GPU experts (fla's and k3's kernels) on every case, in this process: an expert that fails or does not
    compile on a held-out shape would score 0 as a candidate, which the harness must never do to a correct one."""
    task = get(name)
    _passes_every_case(task, _expert(task, "cuda"), "cuda")


def test_attn_res_expert_takes_narrow_rows_to_torch():
    """fla's fused kernel does not compile D = 1: the expert's narrow-row branch must not reach it (on CPU tensors
    it would fail at fla's CUDA check) and must be exact."""
    from k3.kernel_reward.tasks import attn_res as t

    for shape in ({"N": 1, "T": 1, "D": 1}, {"N": 4, "T": 3, "D": t.MIN_FLA_D - 1}):
        sources, w = t.make(shape, 0, "normal", "cpu")
        assert compare(t.expert(sources, w), t.reference(sources, w), torch.bfloat16, t.TASK.tolerance) is None


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


def test_kda_chunk_expert_takes_narrow_heads_to_torch():
    """chunk_kda does not compile K < 16: the expert's narrow-head branch must not reach fla (on CPU tensors fla would
    fail) and must pass the task's tolerance."""
    from k3.kernel_reward.tasks import kda_chunk as t

    task = t.TASK
    args = task.make(task.held_out[0], 0, "normal", "cpu")
    assert args[0].shape[-1] < t.MIN_FLA_K
    for o, r, dt in zip(as_tuple(t.expert(*args)), as_tuple(task.reference(*args)), task.out_dtypes):
        assert compare(o, r, dt, task.tolerance) is None
