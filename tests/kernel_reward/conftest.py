"""Shared fixtures: each example candidate is scored once per session (a batch per task: the checks of several
candidates in parallel processes forked from one fresh interpreter), and the tests read the results."""

import pytest

from k3.kernel_reward.examples import source

RMS_NORM = ["rms_norm_torch", "rms_norm_triton", "rms_norm_dynamo", "wrong", "crash", "raises", "hang", "oom",
            "hack_memoize", "hack_input_cache", "hack_alias", "hack_write_input", "hack_thread", "hack_lazy", "hack_timer",
            "hack_forbidden", "hack_shape"]
SOFTMAX = ["softmax_torch", "hack_precision", "hack_tf32"]
HANG_LIMIT_S = 45.0  # the check phase's limit in these batches: the hang candidate runs into it


def _batch(task, names, **limits):
    from k3.kernel_reward import Limits, score_many

    results = score_many(task, [(n, source(n)) for n in names], "cpu", jobs=3, timed=False,
                         limits=Limits(start="forkserver", **limits))
    return dict(zip(names, results))


@pytest.fixture(scope="session")
def rms_norm_results():
    # 3 GiB of address space: torch takes ~1 GiB, the oom candidate runs into the rest
    return _batch("rms_norm", RMS_NORM, check_s=HANG_LIMIT_S, memory_bytes=3 << 30)


@pytest.fixture(scope="session")
def softmax_results():
    return _batch("softmax", SOFTMAX)
