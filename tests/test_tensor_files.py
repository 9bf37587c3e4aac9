"""k3.tensor_files.write_safetensors: a plain safetensors file (read back by the safetensors library) of every dtype
and shape the checkpoints hold, with the file's own SHA-256."""

import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from k3 import tensor_files
from k3.tensor_files import write_safetensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.f32": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(7, 2, generator=g).bfloat16(),
        "c.f16": torch.randn(4, generator=g).half(),
        "d.f64": torch.randn(2, 2, generator=g).double(),
        "e.i64": torch.arange(-5, 6),
        "f.i32": torch.arange(9, dtype=torch.int32).reshape(3, 3),
        "g.u8": torch.randint(0, 256, (17,), generator=g, dtype=torch.uint8),  # an odd length: the next is unaligned
        "h.i8": torch.randint(-128, 128, (3,), generator=g, dtype=torch.int8),
        "i.bool": torch.tensor([True, False, True]),
        "j.scalar": torch.tensor(2.5),
        "k.empty": torch.zeros(0, 4),
        "l.fp8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "m.strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }


def test_round_trip_through_the_safetensors_library_with_the_files_sha256(tmp_path, monkeypatch):
    monkeypatch.setattr(tensor_files, "CHUNK_BYTES", 16)  # many pieces per tensor: the hashing order is exercised
    ts = _tensors()
    path = tmp_path / "x.safetensors"
    digest = write_safetensors(path, ts, metadata={"format": "pt"})
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    back = load_file(str(path))
    assert sorted(back) == sorted(ts)
    for name, t in ts.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name].view(torch.uint8) if t.dtype == torch.float8_e4m3fn else back[name],
                           t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), name
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_bad_metadata_and_dtypes_are_named(tmp_path):
    with pytest.raises(ValueError, match="metadata"):
        write_safetensors(tmp_path / "x", {"a": torch.zeros(1)}, metadata={"n": 1})
    with pytest.raises(ValueError, match="'z'"):
        write_safetensors(tmp_path / "y", {"z": torch.zeros(2, dtype=torch.complex64)})
