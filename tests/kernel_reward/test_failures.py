"""A wrong kernel scores 0 with a reason naming the failing case; crashing, raising, hanging and unbounded
allocation score 0 with their reason, and the harness carries on (the candidates after them in the same batch are
scored normally)."""

import pytest


def test_wrong_kernel_names_the_failing_shape_and_seed(rms_norm_results):
    r = rms_norm_results["wrong"]
    assert r.reward == 0.0 and not r.passed
    assert "benchmark case (shape rows=64, dim=1024; seed 0; magnitude normal)" in r.reason
    first = next(c for c in r.checks if not c.passed)
    assert first.shape == {"rows": 64, "dim": 1024} and first.seed == 0 and "exceeds the tolerance" in first.detail


@pytest.mark.parametrize("name,words", [
    ("crash", ["crash", "SIGABRT"]),
    ("raises", ["exception", "ValueError", "does not support these inputs"]),
    ("hang", ["timeout", "time limit of"]),
    ("oom", ["memory", "can't allocate memory"]),
])
def test_failure_scores_zero_with_its_reason(rms_norm_results, name, words):
    r = rms_norm_results[name]
    assert r.reward == 0.0 and not r.passed
    for w in words:
        assert w in r.reason, r.reason


def test_harness_keeps_running_after_failures(rms_norm_results):
    # every candidate got a result, and those after the failing ones were scored on their merits
    names = list(rms_norm_results)
    after = names[names.index("oom") + 1:]
    assert after and all(rms_norm_results[n].checks for n in after)
