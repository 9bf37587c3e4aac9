"""Shared fixtures: each example candidate is scored once per session (a batch per task: the checks of several
candidates in parallel processes forked from one fresh interpreter), and the tests read the results."""

import pytest

from k3.kernel_reward.examples import source

RMS_NORM = ["rms_norm_torch", "rms_norm_triton", "rms_norm_dynamo", "wrong", "crash", "raises", "hang", "oom",
            "hack_memoize", "hack_input_cache", "hack_alias", "hack_write_input", "hack_thread", "hack_lazy", "hack_timer",
            "hack_forbidden", "hack_shape"]
SOFTMAX = ["softmax_torch", "hack_precision", "hack_tf32"]
CHECK_LIMIT_S = 45.0  # the check phase's limit of the rms_norm batch (start-up, import, correctness on loaded cores)
HANG_LIMIT_S = 5.0  # the hang candidate's own batch: it runs into this limit (a batch of its own, so the others
#                     do not wait for it in one of the batch's process slots)


def _batch(task, names, **limits):
    from k3.kernel_reward import Limits, score_many

    results = score_many(task, [(n, source(n)) for n in names], "cpu", jobs=3, timed=False,
                         limits=Limits(start="forkserver", **limits))
    return dict(zip(names, results))


@pytest.fixture(scope="session")
def rms_norm_results():
    # 3 GiB of address space: torch takes ~1 GiB, the oom candidate runs into the rest
    others = [n for n in RMS_NORM if n != "hang"]
    results = _batch("rms_norm", others, check_s=CHECK_LIMIT_S, memory_bytes=3 << 30)
    results.update(_batch("rms_norm", ["hang"], check_s=HANG_LIMIT_S, memory_bytes=3 << 30))
    return {n: results[n] for n in RMS_NORM}


@pytest.fixture(scope="session")
def softmax_results():
    return _batch("softmax", SOFTMAX)
