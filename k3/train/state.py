"""Trainer state on disk without pickle: nested dicts/lists of tensors and plain values are split into a
safetensors blob (the tensors) and a JSON document (everything else, with references to the tensors)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save as st_save

_REF = "__tensor__"


def flatten(obj: Any) -> tuple[dict[str, torch.Tensor], Any]:
    tensors: dict[str, torch.Tensor] = {}

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = o.detach()  # where it is: dumps copies to the host, write_safetensors one at a time
            return {_REF: key}
        if isinstance(o, dict):
            if any(not isinstance(k, (str, int)) for k in o):
                raise TypeError(f"state keys must be str or int, got {[type(k) for k in o]}")
            # JSON keys are strings; remember which were ints so they come back as ints.
            return {"__dict__": [[k, walk(v)] for k, v in o.items()]}
        if isinstance(o, (list, tuple)):
            return {"__list__": [walk(v) for v in o], "__tuple__": isinstance(o, tuple)}
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        raise TypeError(f"cannot store {type(o).__name__} in trainer state")

    return tensors, walk(obj)


def unflatten(tensors: dict[str, torch.Tensor] | None, doc: Any) -> Any:
    """Rebuild the object; with tensors=None, tensor entries come back as None (reading only the JSON part)."""
    def walk(o: Any) -> Any:
        if isinstance(o, dict):
            if _REF in o:
                return None if tensors is None else tensors[o[_REF]]
            if "__dict__" in o:
                return {k: walk(v) for k, v in o["__dict__"]}
            if "__list__" in o:
                items = [walk(v) for v in o["__list__"]]
                return tuple(items) if o.get("__tuple__") else items
        return o

    return walk(doc)


def dumps(obj: Any) -> tuple[bytes, bytes]:
    """(safetensors bytes, JSON bytes)."""
    tensors, doc = dump_parts(obj)
    return st_save({k: t.cpu().contiguous() for k, t in tensors.items()}), doc


def dump_parts(obj: Any) -> tuple[dict[str, torch.Tensor], bytes]:
    """(the tensors, where they live, and the JSON bytes): `dumps` before the tensors are serialized, for writing
    them straight to a file (k3.tensor_files.write_safetensors; `loads` reads that file by its path)."""
    tensors, doc = flatten(obj)
    return tensors, json.dumps(doc).encode("utf-8")


def loads(tensors: bytes | str | os.PathLike, json_bytes: bytes) -> Any:
    """The object `dumps` stored: `tensors` the safetensors bytes, or the path of that file (read through a memory
    map: no copy of the whole file in memory)."""
    if isinstance(tensors, (bytes, bytearray, memoryview)):
        loaded = st_load(bytes(tensors))
    else:
        loaded = st_load_file(os.fspath(tensors))
    return unflatten(loaded, json.loads(json_bytes.decode("utf-8")))
