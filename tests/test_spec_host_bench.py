"""benchmarks/spec_host.py: the host's work per speculative cycle, the model's forwards left out, on the static-buffer
steps the graphs capture; and StageTimes' host mode (no device waits, no profiler ranges)."""

import pytest
import torch
from helpers import load_benchmark

from k3.config import K3Config
from k3.data.tokenizer import K3Tokenizer
from k3.model.model import K3ForCausalLM
from k3.ops.registry import Backends
from k3.serve.speculative.decoder import StageTimes

bench = load_benchmark("spec_host")


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("triton")  # the paged MLA decode of the static steps, in Triton's interpreter
    cfg = K3Config.from_preset("tiny")
    m = K3ForCausalLM(cfg, backends=Backends(per_op={"mla_decode": "triton", "moe": "grouped"})).init_weights(seed=0)
    bench.make_draft_right_(m.eval())
    return m


@pytest.mark.parametrize("arm", ["ahead", "after", "vahead"])
def test_the_host_time_per_cycle_leaves_the_forwards_out(model, arm, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    r = bench.measure(model, K3Tokenizer.byte_level(), 2, arm, 24, 20, 3)
    assert r["arm"] == arm and r["cycles"] > 0
    assert r["tokens_per_cycle"] == 4.0  # the right draft: every draft accepted
    host = r["host_ms"]
    assert set(host) == set(StageTimes.STAGES) | {"engine"}
    assert all(v >= 0 for v in host.values()) and host["verify"] > 0 and host["accept"] > 0
    assert r["total_ms"] == pytest.approx(sum(host.values()), abs=0.01)
    assert r["after_read_back_ms"] == pytest.approx(r["total_ms"] - host["ahead"], abs=0.01)
    # the forwards (in Triton's interpreter here) take far longer than the host's work, and are left out of it
    assert r["model_ms"] > r["total_ms"]
    # drafting ahead runs in the ahead arms: the proposals of the cycles but the first and the last (near
    # max_tokens, fewer drafts) taken from it; verifying ahead in vahead, used where launched but near max_tokens
    got, ver = r["drafted_ahead"], r["verified_ahead"]
    if arm == "after":
        assert got == {"ahead": 0, "taken": 0} and ver == {"launched": 0, "used": 0}
    else:
        assert got["ahead"] >= got["taken"] >= 2 * (r["cycles"] - 2) > 0
        assert (ver["launched"] >= ver["used"] > 0) == (arm == "vahead")
    # the methods timed as left out are themselves again afterwards
    for owner, name in bench.LEFT_OUT:
        assert not getattr(vars(owner)[name], "__name__", "").startswith("call")


def test_an_unknown_arm_is_refused(model):
    with pytest.raises(ValueError, match="arm='sideways'"):
        bench.measure(model, K3Tokenizer.byte_level(), 1, "sideways", 24, 20, 3)


def test_host_mode_neither_waits_nor_marks_profiler_ranges():
    def ranges(st):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with st.stage("verify"):
                torch.ones(4).sum()
        return [e.name for e in prof.events() if e.name.startswith("spec.")]

    assert ranges(StageTimes("cpu")) == ["spec.verify"]
    host = StageTimes("cpu", sync=False)
    assert ranges(host) == [] and host.seconds["verify"] > 0
