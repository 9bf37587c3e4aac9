"""benchmarks/train_throughput.py's GPU-timeline summary: the busy time of overlapping kernels and kernel kinds."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_throughput", ROOT / "benchmarks" / "train_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_busy_time_is_the_union_of_intervals(bench):
    # two streams overlapping, one kernel inside another, a gap: busy = [0, 5) + [7, 9) = 7
    assert bench.busy_time([(0, 3), (2, 5), (3, 4), (7, 9)]) == 7
    assert bench.busy_time([]) == 0


@pytest.mark.parametrize("name,kind", [
    ("triton_tem_fused_flex_attention_backward_0", "attention (flex / flash)"),
    ("chunk_kda_bwd_kernel_intra", "fla (KDA, conv, AttnRes)"),
    ("_situ_glu_kernel", "k3 Triton (SiTU, combine, Muon)"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "GEMM"),
    ("triton_poi_fused_add_mul_0", "other Triton / inductor"),
    ("void at::native::reduce_kernel<512, 1>", "reduction"),
    ("void at::native::index_elementwise_kernel<128, 4>", "copy / cast / index"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor>", "elementwise"),
    ("mystery", "other"),
])
def test_kernel_kinds(bench, name, kind):
    assert bench.kernel_kind(name) == kind
