"""benchmarks/sft_qat.py end to end on a tiny model: every stage runs once, a finished stage keeps only its result
(not its run's checkpoints with their optimizer state), a second invocation reuses them all, and a disk too small
for the remaining stages is refused before any of them runs."""

import json
import os
import shutil

import pytest
from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("sft_qat")


ARGS = ["--pretrain-steps", "2", "--sft-steps", "2", "--records", "60", "--heldout", "8", "--generate", "1",
        "--max-new-tokens", "4", "--corpus-mb", "0.5", "--seq-len", "256", "--batch-tokens", "512",
        "--vocab-size", "512", "--device", "cpu"]


@pytest.mark.slow
def test_stages_keep_their_results_only_and_a_rerun_reuses_them(bench, tmp_path, capsys):
    work = str(tmp_path / "w")
    out1, out2 = str(tmp_path / "r1.json"), str(tmp_path / "r2.json")
    assert bench.main(["--work", work, "--out", out1] + ARGS) == 0
    first = json.load(open(out1))
    assert set(first["heldout_reply_loss"]) == {"base", "sft", "sft_ptq_mxfp4", "sft_qat_mxfp4"}
    for name, result in (("sft", "model"), ("sft_qat", "mxfp4")):
        assert not os.path.exists(os.path.join(work, name, "checkpoints"))  # weights + optimizer state, gone
        kept = sorted(os.listdir(os.path.join(work, name, result)))
        assert "config.json" in kept and "tokenizer.json" in kept and "chat_template.json" in kept
        assert not any(f.startswith("trainer_state") for f in kept)
    capsys.readouterr()
    assert bench.main(["--work", work, "--out", out2] + ARGS) == 0
    err = capsys.readouterr().err
    assert "finished at step" not in err  # nothing trained again
    second = json.load(open(out2))
    assert second["heldout_reply_loss"] == first["heldout_reply_loss"]

    # --noise-seeds 1: one more unquantized SFT run (seed 1), beside the first one, and nothing else retrained
    out3 = str(tmp_path / "r3.json")
    assert bench.main(["--work", work, "--out", out3, "--noise-seeds", "1"] + ARGS) == 0
    err = capsys.readouterr().err
    assert err.count("finished at step") == 1
    third = json.load(open(out3))
    assert third["heldout_reply_loss"] == first["heldout_reply_loss"]
    runs = third["sft_seed_losses"]
    assert len(runs) == 2 and runs[0] == first["heldout_reply_loss"]["sft"]
    assert third["sft_seed_std"] == round(abs(runs[1] - runs[0]) / 2 ** 0.5, 6)
    assert os.path.isfile(os.path.join(work, "sft_seed1", "model", "config.json"))

    # --qat-phase 1: the paired runs from the SFT model (unquantized, QAT) and the first's PTQ, and with --noise-seeds 1
    # the same pair for seed 1; nothing before them retrained
    out4 = str(tmp_path / "r4.json")
    assert bench.main(["--work", work, "--out", out4, "--noise-seeds", "1", "--qat-phase", "1"] + ARGS) == 0
    err = capsys.readouterr().err
    assert err.count("finished at step") == 4
    fourth = json.load(open(out4))
    loss = fourth["heldout_reply_loss"]
    assert {k: loss[k] for k in first["heldout_reply_loss"]} == first["heldout_reply_loss"]
    for x in ("", "_seed1"):
        assert {f"phase{x}", f"phase_ptq_mxfp4{x}", f"phase_qat_mxfp4{x}"} <= set(loss)
    assert fourth["qat_phase_steps"] == 1
    assert fourth["qat_phase_recoveries"] == [
        bench.recovery(loss[f"phase{x}"], loss[f"phase_ptq_mxfp4{x}"], loss[f"phase_qat_mxfp4{x}"]) for x in ("", "_seed1")]
    assert fourth["qat_phase_recovery"] == fourth["qat_phase_recoveries"][0]
    assert fourth["phase_ptq_loss_increase"] == round(loss["phase_ptq_mxfp4"] - loss["phase"], 6)
    for name, result in (("phase", "model"), ("phase_qat", "mxfp4"), ("phase_seed1", "model"),
                         ("phase_qat_seed1", "mxfp4")):
        assert os.path.isfile(os.path.join(work, name, result, "config.json"))
        assert not os.path.exists(os.path.join(work, name, "checkpoints"))
    assert os.path.isdir(os.path.join(work, "phase_ptq")) and os.path.isdir(os.path.join(work, "phase_ptq_seed1"))

    # --base takes the run directory: its newest complete checkpoint, never the folder of a save cut short
    base_run = os.path.join(work, "base")
    ck = bench.resolve_base(base_run)
    assert os.path.basename(ck) == "step-0000002"
    shutil.copytree(ck, os.path.join(base_run, "checkpoints", "step-0000009.partial"))
    assert bench.resolve_base(base_run) == ck
    assert bench.resolve_base(ck) == ck
    with pytest.raises(SystemExit, match="neither a checkpoint"):
        bench.resolve_base(str(tmp_path / "missing"))


def test_recovery_is_the_share_of_the_ptq_loss_that_qat_wins_back(bench):
    assert bench.recovery(1.0, 1.3, 1.1) == pytest.approx(2 / 3, abs=1e-3)
    assert bench.recovery(1.0, 1.3, 1.4) == pytest.approx(-1 / 3, abs=1e-3)  # QAT worse than PTQ
    assert bench.recovery(1.0, 1.0, 1.2) is None and bench.recovery(1.0, 0.9, 1.0) is None  # PTQ lost nothing


def test_a_disk_too_small_is_refused_before_any_stage(bench, tmp_path, monkeypatch):
    from k3.model.model import K3ForCausalLM
    from k3.config import K3Config
    from k3.checkpoint import save_pretrained

    base = str(tmp_path / "base")
    save_pretrained(K3ForCausalLM(K3Config.from_preset("tiny")), base)
    work = str(tmp_path / "w")
    os.makedirs(work)
    need = bench.disk_needed(work, base)
    assert need > 0
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 * need, 10 * need - 1, 1))
    with pytest.raises(SystemExit) as e:
        bench.check_disk(work, base)
    assert "GiB free" in str(e.value) and "--keep-checkpoints" in str(e.value)
    assert bench.disk_needed(work, base, ("sft_seed1",)) > need  # a seed run writes one more checkpoint
    with_phase = bench.disk_needed(work, base, ("phase",), ("phase_qat",), ("phase_ptq",))
    assert with_phase > bench.disk_needed(work, base, ("phase",)) > need  # and the phase's QAT run and PTQ more
    # what a finished stage already wrote no longer counts
    os.makedirs(os.path.join(work, "sft_ptq"))
    assert bench.disk_needed(work, base) < need
