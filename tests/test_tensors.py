"""k3.tensors.constant: read-only constants made once per device, grown by doubling, old buffers kept alive."""

import pytest
import torch

from k3 import tensors
from k3.tensors import constant


def test_constants_are_right_shared_and_never_freed(monkeypatch):
    monkeypatch.setattr(tensors, "_CONSTANTS", {})
    a = constant("arange", 5, "cpu", torch.int64)
    assert a.tolist() == [0, 1, 2, 3, 4]
    assert constant("arange", 3, "cpu", torch.int64).data_ptr() == a.data_ptr()  # a view of the same buffer
    grown = constant("arange", 200, "cpu", torch.int64)  # past the first buffer (64): a new one, the old kept
    assert torch.equal(grown, torch.arange(200)) and grown.data_ptr() != a.data_ptr()
    assert len(tensors._CONSTANTS[("arange", torch.device("cpu"), torch.int64)]) == 2
    assert a.tolist() == [0, 1, 2, 3, 4]  # what a captured graph would still read
    ones = constant("ones", 7, torch.device("cpu"), torch.float32)
    assert ones.dtype == torch.float32 and torch.equal(ones, torch.ones(7))
    assert constant("arange", 4, "cpu", torch.int32).dtype == torch.int32  # one buffer per dtype
    with pytest.raises(ValueError, match="'ones' or 'arange'"):
        constant("zeros", 3, "cpu", torch.float32)
