"""benchmarks/spec_decode.py's prompts, divergence report and stage times: prompts are consecutive windows of held-out
text (a long document gives several), bad --prompts files are refused naming file:line, a divergence names the first
differing position and the plain run's top-2 logit margin there, and `stage_times` breaks the speculative cycle down
into its stages without changing the engine's output."""

import json

import pytest
import torch
from helpers import load_benchmark

from k3.config import K3Config
from k3.model.model import K3ForCausalLM

bench = load_benchmark("spec_decode")


class _Bytes:
    def encode(self, text):
        return list(text.encode())


def test_prompts_are_consecutive_windows_of_the_given_documents(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij")  # two windows of 4 (the last 2 bytes are left)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "klmnopqr"}) + "\n\n" + json.dumps({"text": "st"}) + "\n")
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    got = bench.heldout_prompts(_Bytes(), 4, 4, files)
    assert [bytes(p).decode() for p in got] == ["abcd", "efgh", "klmn", "opqr"]
    with pytest.raises(SystemExit, match="give only 4 windows of 4 tokens, 5 are needed"):
        bench.heldout_prompts(_Bytes(), 5, 4, files)


@pytest.mark.parametrize("name,content,why", [
    ("bad.jsonl", '{"text": "ok"}\n{not json\n', "bad.jsonl:2: not JSON"),
    ("bad.jsonl", '{"text": 3}\n', 'bad.jsonl:1: expected an object with a string "text" field'),
    ("bad.csv", "a,b\n", "bad.csv: --prompts takes"),
])
def test_bad_prompt_files_are_refused_by_name(tmp_path, name, content, why):
    (tmp_path / name).write_text(content)
    with pytest.raises(SystemExit, match=why.replace(".", r"\.")):
        bench.heldout_prompts(_Bytes(), 10, 1, [str(tmp_path / name)])


def test_divergence_is_the_first_differing_position_and_the_plain_top2_margin():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("tiny")).init_weights(seed=0).eval()
    prompts = [[5, 6, 7], [8, 9]]
    plain = [[1, 2, 3, 4], [10, 11]]
    other = [[1, 2, 30, 4], [10, 11]]  # request 0 differs at position 2, request 1 not at all
    got = bench.divergence(model, prompts, plain, other)
    assert [(d["request"], d["position"]) for d in got] == [(0, 2)]
    with torch.no_grad():
        top2 = model(torch.tensor([[5, 6, 7, 1, 2]])).logits[0, -1].topk(2).values
    assert got[0]["top2_margin"] == pytest.approx(float(top2[0] - top2[1]), abs=1e-4) and got[0]["top2_margin"] >= 0
    # one output a prefix of the other: they differ where the shorter ends
    assert bench.divergence(model, [[5]], [[1, 2]], [[1]])[0]["position"] == 1


def test_stage_times_break_the_cycle_down_and_leave_the_output_unchanged():
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig
    from k3.serve.speculative.decoder import StageTimes

    cfg = K3Config.from_preset("tiny").replace(vocab_size=512)
    model = K3ForCausalLM(cfg).init_weights(seed=0).eval()
    prompts = [list(range(3, 40)), list(range(50, 70))]

    def engine():
        eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=8.0, speculative="mtp", speculative_auto=False,
                                                  scheduler=SchedulerConfig(max_num_seqs=2)))
        eng.eos_id = None
        return eng

    want, _ = bench.run(engine(), prompts, 12)
    eng = engine()
    v0 = eng.metrics.spec_verifications
    eng.speculative.stage_times = st = StageTimes("cpu")
    got, _ = bench.run(eng, prompts, 12)
    assert got == want  # the timer changes nothing in the output
    # a cycle is one `verify` call of a step: the step's verifications (both requests', or one's)
    v = eng.metrics.spec_verifications - v0
    assert 0 < st.cycles <= v <= 2 * st.cycles
    ms = bench.stage_times(eng, prompts, 12, "cpu")
    assert eng.speculative.stage_times is None  # profiling is off again afterwards
    assert set(ms) == set(StageTimes.STAGES) | {"cycle"}
    assert all(ms[k] >= 0 for k in StageTimes.STAGES) and ms["draft"] > 0 and ms["verify"] > 0
    assert ms["cycle"] == pytest.approx(sum(ms[k] for k in StageTimes.STAGES), abs=0.01)
    # under the profiler: each stage's operators (kernels on a GPU), per cycle, the costliest first
    ks = bench.profiled_stages(eng, prompts, 12, torch.device("cpu"), top=3)
    assert eng.speculative.stage_times is None
    assert {"draft", "verify", "accept"} <= set(ks) <= set(StageTimes.STAGES)
    verify = ks["verify"]
    assert verify["kind"] == "host operators" and verify["count"] > 0 and verify["ms"] > 0
    assert 0 < len(verify["top"]) <= 3 and all(name.startswith("aten::") for name, _, _ in verify["top"])
    assert [t[2] for t in verify["top"]] == sorted((t[2] for t in verify["top"]), reverse=True)


def test_stage_kernels_attribute_device_kernels_to_their_stage():
    # a profile's events without device events of their own: kernels hang on the operators that launched them,
    # inside the stage ranges; counts and times are per cycle, the costliest first
    from types import SimpleNamespace as E

    def ev(name, children=(), kernels=()):
        return E(name=name, cpu_children=list(children), kernels=[E(name=n, duration=us) for n, us in kernels],
                 self_cpu_time_total=1.0)

    mm = ev("aten::mm", kernels=[("gemm", 30.0)])
    launch = ev("cudaGraphLaunch", kernels=[("kda_step", 10.0), ("gemm", 20.0)])
    verify = [ev("spec.verify", [mm, launch]) for _ in range(2)]
    draft = ev("spec.draft", [ev("aten::add", kernels=[("add", 4.0)])])
    outside = ev("aten::copy_", kernels=[("copy", 99.0)])  # not in any stage
    got = bench.stage_kernels([*verify, draft, outside], cycles=2, top=2)
    assert set(got) == {"verify", "draft"}
    assert got["verify"] == dict(kind="kernels", count=3.0, ms=0.06, top=[["gemm", 2.0, 0.05], ["kda_step", 1.0, 0.01]])
    assert got["draft"]["count"] == 0.5 and got["draft"]["top"] == [["add", 0.5, 0.002]]


def test_stage_kernels_count_device_events_by_time_inside_their_stage():
    # a GPU profile: kernels are device events with their own times; each counts in the stage whose range holds its
    # start, whether an operator launched it, a CUDA graph replay or Triton (through the driver, under no operator)
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    def cpu(name, start, end):
        return E(name=name, device_type=DeviceType.CPU, time_range=Interval(start, end), cpu_children=[], kernels=[])

    def dev(name, start, us):
        return E(name=name, device_type=DeviceType.CUDA, time_range=Interval(start, start + us))

    events = [cpu("spec.draft", 0, 100), cpu("spec.verify", 100, 300), cpu("spec.draft", 300, 350),
              cpu("spec.verify", 350, 500), cpu("aten::mm", 110, 120),
              dev("gemm", 120, 30.0), dev("kda_verify_step_kernel", 200, 10.0), dev("gemm", 360, 20.0),  # verify
              dev("add", 10, 4.0), dev("copy", 600, 99.0),  # a draft's kernel; a copy outside every stage
              dev("spec.verify", 100, 200.0)]  # the range's own copy on the device's timeline: not a kernel
    got = bench.stage_kernels(events, cycles=2, top=2)
    assert got["verify"] == dict(kind="kernels", count=1.5, ms=0.03,
                                 top=[["gemm", 1.0, 0.025], ["kda_verify_step_kernel", 0.5, 0.005]])
    assert got["draft"] == dict(kind="kernels", count=0.5, ms=0.002, top=[["add", 0.5, 0.002]])


def test_graphs_off_says_why_an_engine_ran_eagerly():
    from types import SimpleNamespace as E

    assert bench.graphs_off(E(runner=E(graphs=E(disabled=None)))) is None
    why = "capturing the decode step of 1 requests failed (RuntimeError: ...)"
    assert bench.graphs_off(E(runner=E(graphs=E(disabled=why)))) == why
    assert "no CUDA graphs" in bench.graphs_off(E(runner=E(graphs=None)))


def test_stage_times_average_over_cycles_and_refuse_an_unknown_stage():
    from k3.serve.speculative.decoder import StageTimes

    st = StageTimes("cpu")
    for _ in range(4):
        st.cycles += 1
        with st.stage("draft"):
            sum(range(1000))
    ms = st.per_cycle_ms()
    assert ms["draft"] > 0 and ms["verify"] == 0 and ms["cycle"] == ms["draft"]
    with pytest.raises(KeyError, match="unknown stage 'nonsense'"), st.stage("nonsense"):
        pass


def test_a_run_traces_an_auto_engines_steps_by_the_switchs_arm():
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig
    from k3.serve.speculative.switch import SpecSwitch

    cfg = K3Config.from_preset("tiny").replace(vocab_size=512)
    model = K3ForCausalLM(cfg).init_weights(seed=0).eval()

    def engine(auto):
        eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=8.0, speculative="mtp", speculative_auto=auto,
                                                  scheduler=SchedulerConfig(max_num_seqs=1)))
        eng.eos_id = None
        return eng

    want, _ = bench.run(engine(False), [list(range(3, 30))], 16)
    eng = engine(True)
    # probe 1 step per arm, then re-probe every 4th step: both arms run in a 16-token generation
    eng.speculative.switch = SpecSwitch(probe_steps=1, window=4, reprobe_every=4)
    decide = eng.speculative.decide
    trace = []
    got, _ = bench.run(eng, [list(range(3, 30))], 16, trace)
    assert got == want and eng.speculative.decide == decide  # the switch is answered as before afterwards
    assert [t[0] for t in trace] == list(range(len(trace))) and sum(t[3] for t in trace) == 16
    summary = bench.steps_by_arm(trace, slowest=3)
    spec, plain = summary["speculative"], summary["plain"]
    assert spec["steps"] >= 1 and plain["steps"] >= 1 and spec["steps"] + plain["steps"] == len(trace) - 1
    for arm in (spec, plain):
        assert 0 < arm["mean_ms"] <= arm["max_ms"]
    top = summary["slowest"]
    assert len(top) == 3 and [s[2] for s in top] == sorted((s[2] for s in top), reverse=True)
    assert top[0][2] == max(spec["max_ms"], plain["max_ms"])
    # an engine without speculation: every step plain
    off = LLMEngine(model, None, EngineConfig(cache_memory_mb=8.0, scheduler=SchedulerConfig(max_num_seqs=1)))
    off.eos_id = None
    trace = []
    bench.run(off, [list(range(3, 30))], 5, trace)
    assert {t[1] for t in trace} == {"plain"}


def test_host_profile_lists_the_serving_functions_by_host_time_per_step():
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig

    cfg = K3Config.from_preset("tiny").replace(vocab_size=512)
    model = K3ForCausalLM(cfg).init_weights(seed=0).eval()
    eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=8.0, speculative="mtp",
                                              scheduler=SchedulerConfig(max_num_seqs=2)))
    eng.eos_id = None
    want, _ = bench.run(eng, [list(range(3, 30))], 8)
    got = bench.host_profile(eng, [list(range(3, 30))], 8, top=5)
    assert "step" not in vars(eng)  # the engine's own step again
    assert got["steps"] >= 2 and len(got["top"]) == 5
    names = [f for f, _, _ in got["top"]]
    assert any(f.startswith("k3/serve/engine.py:") and f.endswith("(step)") for f in names)
    assert all(f.startswith("k3/") for f in names)
    ms = [m for _, _, m in got["top"]]
    assert ms == sorted(ms, reverse=True) and ms[0] > 0
    assert bench.run(eng, [list(range(3, 30))], 8)[0] == want  # the engine decodes as before
