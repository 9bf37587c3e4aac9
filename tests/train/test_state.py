import math

import torch

from k3.train.schedule import lr_multiplier
from k3.train.state import dumps, loads


def test_state_round_trip_without_pickle():
    obj = {"step": 3, "opt": {"state": {0: {"exp_avg": torch.randn(3, 2), "step": torch.tensor(4.0)}},
                              "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.95)}]},
           "rng": torch.get_rng_state(), "name": "x", "none": None}
    t, j = dumps(obj)
    back = loads(t, j)
    assert back["step"] == 3 and back["name"] == "x" and back["none"] is None
    assert torch.equal(back["opt"]["state"][0]["exp_avg"], obj["opt"]["state"][0]["exp_avg"])
    assert back["opt"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert 0 in back["opt"]["state"]  # int keys stay ints
    assert torch.equal(back["rng"], obj["rng"])


def test_warmup_then_cosine():
    assert lr_multiplier(0.0) > 0 and lr_multiplier(0.0) < 0.01
    assert math.isclose(lr_multiplier(0.005), 0.5)
    assert math.isclose(lr_multiplier(0.01), 1.0)
    assert math.isclose(lr_multiplier(1.0), 0.1)
    mid = lr_multiplier(0.505)
    assert math.isclose(mid, 0.1 + 0.9 * 0.5, rel_tol=1e-9)
    xs = [lr_multiplier(p / 100) for p in range(1, 101)]
    assert all(a >= b for a, b in zip(xs, xs[1:]))  # monotone after warmup
