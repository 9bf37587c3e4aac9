"""The candidate's outputs on their way to the harness: one safetensors file per phase, never a pickle.

The candidate's process writes them and the harness reads them, so the file is untrusted input: safetensors holds
nothing but tensors, and its header (which the reader checks against the layout recorded beside them) says where
each belongs. Per call a list of outputs, each a tensor or None (an output that is not a plain strided tensor, or of
a dtype safetensors cannot hold, such as complex: the check fails it either way).

    save_outputs(path, [[t0, None], [t1, t2]])
    load_outputs(path) -> [[t0, None], [t1, t2]]      # ValueError naming what is wrong with the file
"""

from __future__ import annotations

import json
import os

import torch

__all__ = ["load_outputs", "save_outputs", "storable"]

_LAYOUT = "k3_kernel_reward_layout"  # metadata key: per call, per output, present (1) or None (0)


def storable(t) -> bool:
    """Whether `t` is an output the file holds: a plain strided tensor of a dtype safetensors stores."""
    return type(t) is torch.Tensor and t.layout == torch.strided and not t.is_meta and not t.dtype.is_complex


def save_outputs(path: str, calls: list[list]) -> None:
    """Write `calls` (per call, a list of tensors or None) to `path` (safetensors, atomically)."""
    from safetensors.torch import save_file

    tensors, layout = {}, []
    for i, outs in enumerate(calls):
        row = []
        for j, t in enumerate(outs):
            if storable(t):
                tensors[f"{i}.{j}"] = t.detach().to("cpu").contiguous().clone()  # its own storage: none shared
                row.append(1)
            else:
                row.append(0)
        layout.append(row)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={_LAYOUT: json.dumps(layout)})
    os.replace(tmp, path)


def load_outputs(path: str) -> list[list]:
    """The lists `save_outputs` wrote to `path`; a ValueError saying what is wrong with a file that is not such."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if _LAYOUT not in meta:
                raise ValueError("its header records no output layout")
            layout = json.loads(meta[_LAYOUT])
            if not (isinstance(layout, list) and all(isinstance(r, list) and all(v in (0, 1) for v in r)
                                                      for r in layout)):
                raise ValueError("its layout is not a list of lists of 0 and 1")
            keys = set(f.keys())
            want = {f"{i}.{j}" for i, row in enumerate(layout) for j, v in enumerate(row) if v}
            if keys != want:
                raise ValueError(f"its tensors {sorted(keys)[:6]} are not the ones its layout names "
                                 f"{sorted(want)[:6]}")
            return [[f.get_tensor(f"{i}.{j}") if v else None for j, v in enumerate(row)]
                    for i, row in enumerate(layout)]
    except Exception as e:  # not a safetensors file, a broken header, a layout that does not match, ...
        raise ValueError(f"the outputs in {os.path.basename(path)} cannot be read back: {e}") from None
