"""The profile summaries of the benchmarks: benchmarks/trace_report.py on a synthetic Chrome trace, and the
helpers train_throughput.py shares with it."""

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def report():
    return _load("trace_report")


def test_busy_time_is_the_union_of_intervals(report):
    # two streams overlapping, one kernel inside another, a gap: busy = [0, 5) + [7, 9) = 7
    assert report.busy_time([(0, 3), (2, 5), (3, 4), (7, 9)]) == 7
    assert report.busy_time([]) == 0


@pytest.mark.parametrize("name,kind", [
    ("triton_tem_fused_flex_attention_backward_0", "attention (flex / flash)"),
    ("chunk_kda_bwd_kernel_intra", "fla (KDA, conv, AttnRes, norm)"),
    ("_situ_glu_kernel", "k3 Triton (SiTU, combine, Muon)"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "GEMM"),
    ("triton_poi_fused_add_mul_0", "other Triton / inductor"),
    ("void at::native::reduce_kernel<512, 1>", "reduction"),
    ("void at::native::index_elementwise_kernel<128, 4>", "copy / cast / index"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor>", "elementwise"),
    ("mystery", "other"),
])
def test_kernel_kinds(report, name, kind):
    assert report.kernel_kind(name) == kind


def _x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "args": {}}
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


TRACE = [
    # host: k3.train.forward [0, 100) holding k3.fwd.moe [10, 50); launches at 12 (in moe), 60 (forward), 120 (none)
    _x("user_annotation", "k3.train.forward", 0, 100),
    _x("user_annotation", "k3.fwd.moe", 10, 40),
    _x("cuda_runtime", "cudaLaunchKernel", 12, 2, corr=1),
    _x("cuda_runtime", "cudaLaunchKernel", 60, 2, corr=2),
    _x("cuda_runtime", "cudaLaunchKernel", 120, 2, corr=3),
    # GPU: kernels [20, 30), [100, 140) after a 70 us gap, [141, 151)
    _x("kernel", "nvjet_sm90_gemm", 20, 10, tid=7, corr=1),
    _x("kernel", "_situ_glu_kernel", 100, 40, tid=7, corr=2),
    _x("kernel", "void at::native::vectorized_elementwise_kernel<4>", 141, 10, tid=7, corr=3),
    _x("user_annotation", "not.k3", 0, 1000),  # other annotations are ignored
]


def test_analyse_charges_kernels_and_gaps_to_the_launching_range(report):
    rep = report.analyse(TRACE, top=5, gap_us=20)
    assert rep["kernels"] == 3 and rep["span_ms"] == pytest.approx(0.131) and rep["busy_ms"] == pytest.approx(0.06)
    assert rep["ranges"]["k3.fwd.moe"]["ms"] == pytest.approx(0.01)
    assert rep["ranges"]["k3.train.forward"]["ms"] == pytest.approx(0.04)
    assert rep["ranges"]["(outside k3 ranges)"]["ms"] == pytest.approx(0.01)
    assert rep["kinds"]["GEMM"]["kernels"] == 1
    # the 70 us gap before the SiTU kernel (launched in k3.train.forward); the 1 us gap is below --gap-us
    assert rep["gaps_ms_by_range"] == {"k3.train.forward": pytest.approx(0.07)}
    assert rep["largest_gaps"][0]["next_kernel"] == "_situ_glu_kernel"


def test_command_line_reads_a_gzipped_trace_and_names_a_bad_file(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": TRACE}, f)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_report.py"), str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "idle" in out and "k3.fwd.moe" in out
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_report.py"), str(bad)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "cannot read" in r.stderr


def test_train_throughput_uses_the_shared_helpers(report):
    tt = _load("train_throughput")
    assert tt.kernel_kind("nvjet_x") == "GEMM" and tt.busy_time([(0, 2), (1, 3)]) == 3


def test_driver_launches_memcpys_phases_and_host_waits(report):
    # A Triton kernel launched through the driver (cuLaunchKernelEx) is charged to its range; a device memcpy is GPU
    # work, not idle time; per k3.train.* phase: kernel time, idle before its kernels, launch-to-start lag; the host's
    # cudaStreamSynchronize is listed with the operators around it.
    trace = [
        _x("user_annotation", "k3.train.forward", 0, 100),
        _x("user_annotation", "k3.train.optimizer", 200, 100),
        _x("cpu_op", "aten::item", 40, 20),
        _x("cuda_driver", "cuLaunchKernelEx", 10, 2, corr=1),
        _x("cuda_runtime", "cudaStreamSynchronize", 45, 10),
        _x("cuda_runtime", "cudaMemcpyAsync", 210, 2, corr=2),
        _x("cuda_runtime", "cudaLaunchKernel", 220, 2, corr=3),
        _x("kernel", "_situ_glu_kernel", 11, 30, tid=7, corr=1),       # lag 1 us after its launch
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 212, 50, tid=7, corr=2),
        _x("kernel", "nvjet_sm90_gemm", 262, 10, tid=7, corr=3),        # right after the memcpy: no gap
    ]
    rep = report.analyse(trace, top=5, gap_us=20)
    assert rep["ranges"]["k3.train.forward"]["ms"] == pytest.approx(0.03)
    assert rep["ranges"]["k3.train.optimizer"]["ms"] == pytest.approx(0.06)
    assert rep["busy_ms"] == pytest.approx(0.09)
    assert rep["kinds"]["copy / cast / index"]["kernels"] == 1
    opt = rep["phases"]["k3.train.optimizer"]
    assert opt["kernels"] == 2 and opt["idle_ms"] == pytest.approx(0.171) and opt["median_lag_ms"] == pytest.approx(0.042)
    assert rep["phases"]["k3.train.forward"]["median_lag_ms"] == pytest.approx(0.001)
    (wait,) = rep["syncs"]
    assert wait["call"] == "cudaStreamSynchronize" and wait["wait_ms"] == pytest.approx(0.01)
    assert wait["stack"] == ["k3.train.forward", "aten::item"]
