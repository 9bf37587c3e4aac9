"""The outputs file between the candidate's process and the harness (k3.kernel_reward.outputs): safetensors, not a
pickle; what comes back is what went in; a file that is not such (written by a candidate, say) is refused with a
message, never unpickled."""

import pickle

import pytest
import torch
from safetensors.torch import save_file

from k3.kernel_reward.outputs import load_outputs, save_outputs


def test_round_trip(tmp_path):
    base = torch.randn(4, 6, dtype=torch.float64)
    calls = [[base, base[:, 1:3], None],  # shared storage and a strided view
             [torch.randn(3, dtype=torch.bfloat16), torch.arange(5), torch.ones(2, dtype=torch.bool)],
             [torch.zeros(0, 3), torch.randn(2, dtype=torch.complex64)],  # empty; complex: not storable
             []]
    path = str(tmp_path / "check.safetensors")
    save_outputs(path, calls)
    back = load_outputs(path)
    assert [len(r) for r in back] == [3, 3, 2, 0]
    for got, want in zip([t for r in back for t in r], [t for r in calls for t in r]):
        if want is None or want.dtype.is_complex:
            assert got is None
        else:
            assert got.dtype == want.dtype and torch.equal(got, want)
    with open(path, "rb") as f:
        assert f.read(8) != pickle.dumps(None)[:8]


def test_a_file_that_is_not_outputs_is_refused(tmp_path):
    path = str(tmp_path / "check.safetensors")
    with open(path, "wb") as f:  # a pickle under the expected name: refused, never unpickled
        pickle.dump([[torch.ones(2)]], f)
    with pytest.raises(ValueError, match="cannot be read back"):
        load_outputs(path)
    save_file({"0.0": torch.ones(2)}, path)  # no layout
    with pytest.raises(ValueError, match="no output layout"):
        load_outputs(path)
    save_file({"0.0": torch.ones(2)}, path, metadata={"k3_kernel_reward_layout": "[[1, 1]]"})
    with pytest.raises(ValueError, match="not the ones its layout names"):
        load_outputs(path)
    save_file({"0.0": torch.ones(2)}, path, metadata={"k3_kernel_reward_layout": '{"a": 1}'})
    with pytest.raises(ValueError, match="not a list of lists"):
        load_outputs(path)
