"""benchmarks/arch_study.py: each arm's config is the preset with exactly its ablation, and the summary of `k3 eval
--long`'s record reads what the evaluator writes."""

import importlib.util
import os

import numpy as np
import pytest

from k3.config import K3Config

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "arch_study.py")
_spec = importlib.util.spec_from_file_location("arch_study", _PATH)
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


class _Args:
    preset = "tiny"
    rope_theta = 5000.0


def test_layer_rules():
    assert study.pattern(None, 5) is None
    assert study.pattern("M", 5) == "MMMMM" and study.pattern("K", 3) == "KKK"
    assert study.pattern("1:1", 5) == "KMKMM" and study.pattern("1:1", 8) == "KMKMKMKM"
    with pytest.raises(ValueError, match="unknown layer rule"):
        study.pattern("2:1", 5)


@pytest.mark.parametrize("arm,expect", [
    ("k3", []), ("hybrid11", ["layers KMKMM"]), ("all_mla", ["layers MMMMM"]), ("all_kda", ["layers KKKKK"]),
    ("rope", ["mla_use_nope=false: RoPE (theta 5000)"]), ("ungated", ["mla_use_output_gate=false"]),
    ("plain_res", ["residual=plain"])])
def test_each_arm_is_the_preset_with_its_ablation_only(arm, expect):
    cfg = K3Config.from_dict(study.arm_config(_Args, arm))
    got = cfg.ablations()
    assert len(got) == len(expect) and all(g.startswith(e) for g, e in zip(got, expect)), got
    base = K3Config.from_preset("tiny")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (base.hidden_size, base.num_hidden_layers,
                                                                       base.vocab_size)


def test_long_summary_reads_the_evaluators_record():
    from k3.train.long_eval import bucket_curve

    per_position = np.linspace(6.0, 5.0, 511)
    curve = bucket_curve(per_position, windows=2, train_length=128)
    cells = [{"length": n, "depth": d, "accuracy": acc, "chance": 0.25}
             for n, accs in ((256, (0.5, 1.0)), (512, (0.0, 0.25))) for d, acc in zip((0.0, 1.0), accs)]
    s = study.long_summary({"passkey": {"cells": cells, "chance": 0.25}, "extrapolation": curve}, 128)
    assert s["passkey"] == {"256": 0.75, "512": 0.125} and s["chance"] == 0.25
    assert s["loss_inside"] == pytest.approx(per_position[:127].mean())
    assert s["loss_beyond"] == pytest.approx(per_position[127:].mean())
    assert s["curve"][0][:2] == [1, 2] and s["curve"][-1][1] == 512
