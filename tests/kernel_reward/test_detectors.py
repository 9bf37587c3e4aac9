"""Every hacking detector catches its example candidate (k3/kernel_reward/examples/hack_*.py) and passes the
honest ones (torch and Triton, the latter in Triton's interpreter)."""

import pytest
import torch

from k3.kernel_reward.examples import source as example

CAUGHT = {
    "hack_memoize": "stale_result",
    "hack_input_cache": "stale_result",
    "hack_alias": "input_alias",
    "hack_write_input": "inputs_written",
    "hack_thread": "deferred_result",
    "hack_lazy": "output_type",
    "hack_timer": "tampering",
    "hack_forbidden": "forbidden_call",
    "hack_shape": "shape_specialization",
}


@pytest.mark.parametrize("name", ["rms_norm_torch", "rms_norm_triton", "rms_norm_dynamo"])
def test_honest_rms_norm_passes_every_check_and_detector(rms_norm_results, name):
    r = rms_norm_results[name]
    assert r.passed and r.hacks == [] and r.reason == "", r.reason
    assert len(r.checks) >= 11 and all(c.passed for c in r.checks)
    assert r.reward is None  # checked only, not timed


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_hack_is_caught(rms_norm_results, name):
    r = rms_norm_results[name]
    assert CAUGHT[name] in [h.name for h in r.hacks], r.reason
    assert r.reward == 0.0 and not r.passed and "hack detected" in r.reason


def test_background_thread_is_reported(rms_norm_results):
    assert "background_thread" in [h.name for h in rms_norm_results["hack_thread"].hacks]


def test_honest_softmax_passes(softmax_results):
    r = softmax_results["softmax_torch"]
    assert r.passed and r.hacks == [], r.reason


@pytest.mark.parametrize("name,hack", [("hack_precision", "precision_reduction"), ("hack_tf32", "global_precision")])
def test_precision_hacks_are_caught(softmax_results, name, hack):
    r = softmax_results[name]
    assert hack in [h.name for h in r.hacks] and r.reward == 0.0, r.reason


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("name,hack", [("hack_cuda_graph", "cuda_graph"), ("hack_side_stream", "deferred_result")])
def test_cuda_hacks_are_caught(name, hack):
    from k3.kernel_reward import score

    r = score("rms_norm", example(name), "cuda", timed=False)
    assert hack in [h.name for h in r.hacks] and r.reward == 0.0, r.reason


@needs_cuda
def test_honest_candidate_passes_on_cuda():
    from k3.kernel_reward import score

    r = score("rms_norm", example("rms_norm_triton"), "cuda", timed=False)
    assert r.passed and r.hacks == [], r.reason


def test_torch_wrapping_its_own_functions_is_not_tampering():
    import functools
    import subprocess
    import sys

    from k3.kernel_reward.guard import _torch_own_wrapper

    def seed(*a):
        return None

    @functools.wraps(seed)
    def wrapper(*a):  # a candidate's wrapper: its code is not torch's
        return seed(*a)

    assert not _torch_own_wrapper(wrapper, seed)
    # torch's compiler wraps torch.manual_seed at its first import (in a fresh process: here it may be imported)
    code = ("import torch; a = torch.manual_seed; import torch._dynamo; "
            "from k3.kernel_reward.guard import _torch_own_wrapper; "
            "assert torch.manual_seed is not a and _torch_own_wrapper(torch.manual_seed, a)")
    subprocess.run([sys.executable, "-c", code], check=True)
