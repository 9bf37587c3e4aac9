"""`k3 kernel-reward list` and `k3 kernel-reward score --json` (timed, each candidate and the expert in a fresh
interpreter)."""

import json

from k3.cli import main
from k3.kernel_reward.examples import path


def test_list_names_every_task(capsys):
    assert main(["kernel-reward", "list", "--json"]) == 0
    names = {t["name"] for t in json.loads(capsys.readouterr().out)}
    assert {"rms_norm", "softmax", "gemm_bf16", "moe_combine"} <= names


def test_score_json_reports_time_roofline_and_reward(capsys):
    code = main(["kernel-reward", "score", "softmax", path("softmax_torch"), "--device", "cpu", "--json",
                 "--time-limit", "120"])
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    assert r["passed"] and r["hacks"] == [] and r["reason"] == ""
    assert r["time_s"] > 0 and r["expert_time_s"] > 0 and r["roofline_time_s"] > 0
    assert 0 < r["roofline_fraction"] and 0 < r["reward"] <= 1
    assert "t_expert" in r["formula"] and len(r["times_s"]) >= 5
    assert all(c["passed"] for c in r["checks"]) and any(c["phase"] == "time" for c in r["checks"])


def test_score_rejects_an_unknown_task(capsys):
    assert main(["kernel-reward", "score", "no_such_task", path("softmax_torch"), "--device", "cpu"]) == 2
    assert "no kernel-reward task 'no_such_task'" in capsys.readouterr().err


def test_score_rejects_a_nonpositive_anchor_process_count(capsys):
    assert main(["kernel-reward", "score", "softmax", path("softmax_torch"), "--device", "cpu",
                 "--anchor-processes", "0"]) == 2
    assert "--anchor-processes must be >= 1, got 0" in capsys.readouterr().err
