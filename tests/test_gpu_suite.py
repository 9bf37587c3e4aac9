"""benchmarks/gpu_suite.py's kernel-cache archive: what it packs and that it unpacks to the same files."""

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_cache(root: Path) -> Path:
    cache = root / "cache"
    (cache / "triton" / "ABC").mkdir(parents=True)
    (cache / "triton" / "ABC" / "kernel.cubin").write_bytes(os.urandom(4096))
    (cache / "triton" / "ABC" / "chunk_kda_fwd.autotune.json").write_text('{"key": [8], "configs_timings": []}')
    (cache / "inductor").mkdir()
    (cache / "inductor" / "graph.py").write_text("# compiled")
    return cache


@pytest.mark.parametrize("split_mb", [None, 0.0001])
def test_autotune_archive_holds_only_the_tuning_results_and_round_trips(suite, tmp_path, split_mb):
    cache = _fake_cache(tmp_path / "a")
    parts = suite.save_cache(str(cache), str(tmp_path / "k.tar.gz"), split_mb, "autotune")
    assert all(Path(p).exists() for p in parts) and (len(parts) > 1) == bool(split_mb)
    out = tmp_path / "b"
    suite.load_cache(str(tmp_path / "k.tar.gz"), str(out))
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["cache/triton/ABC/chunk_kda_fwd.autotune.json"]
    assert (out / files[0]).read_text() == '{"key": [8], "configs_timings": []}'


def test_full_archive_holds_every_file(suite, tmp_path):
    cache = _fake_cache(tmp_path / "a")
    suite.save_cache(str(cache), str(tmp_path / "k.tar.gz"), None, "all")
    suite.load_cache(str(tmp_path / "k.tar.gz"), str(tmp_path / "b"))
    assert (tmp_path / "b/cache/triton/ABC/kernel.cubin").read_bytes() == (cache / "triton/ABC/kernel.cubin").read_bytes()
    assert (tmp_path / "b/cache/inductor/graph.py").exists()


def test_missing_archive_is_named(suite, tmp_path):
    with pytest.raises(SystemExit, match="no such archive"):
        suite.load_cache(str(tmp_path / "nope.tar.gz"), str(tmp_path))


def test_shipped_h200_autotune_archive_unpacks_to_tuning_results(suite, tmp_path):
    archive = ROOT / "benchmarks" / "autotune" / "h200-fla0.6.0-triton3.6.tar.gz"
    suite.load_cache(str(archive), str(tmp_path))
    found = list(tmp_path.rglob("*.autotune.json"))
    assert len(found) > 20 and all(p.name.endswith(".autotune.json") for p in tmp_path.rglob("*") if p.is_file())


def test_run_step_substitutes_the_out_folder_and_logs(suite, tmp_path):
    import sys

    cmd = [sys.executable, "-c", "import sys; print('arg=' + sys.argv[1])", "{out}/trace.json.gz"]
    rc, _ = suite.run_step("probe", [cmd], 60, str(tmp_path), dict(os.environ))
    assert rc == 0
    assert f"arg={tmp_path}/trace.json.gz" in (tmp_path / "probe.log").read_text()


def test_every_test_file_with_gpu_tests_is_in_a_suite_step(suite):
    # a GPU test the suite does not run is a GPU test nobody runs: every file marking a test gpu is in a step
    mark = "pytest.mark." + "gpu"  # split, so that this file does not match itself
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if mark in p.read_text(encoding="utf-8")}
    listed = {a for cmds, _ in suite.STEPS.values() for cmd in cmds for a in cmd if a.startswith("tests/")}
    assert marked <= listed, sorted(marked - listed)
