"""What the candidate's process watches: installed before the candidate is imported, read after each phase.

The facts collected here are plain data; k3.kernel_reward.hacks judges them in the harness's process. Nothing
here compares against a reference: references run only in the harness's process, so a candidate cannot read
the expected results through the interpreter (gc, frames) because they do not exist where it runs.

* the network: ``socket.socket`` and its relatives raise (a candidate must not fetch results or code);
* the harness's functions: the callable attributes of torch, torch.Tensor, torch.nn.functional, torch.cuda, time and of
  k3.kernel_reward's own modules are recorded by identity, so replacing one (a timer, a sync, a comparison) shows;
* global precision settings (TF32, reduced-precision reductions, float32 matmul precision), likewise;
* CUDA graphs: replays are counted (CUDAGraph.replay patched on the Python and the C class);
* forbidden calls: the task's expert and reference functions are wrapped to count calls;
* each call: the inputs before and after (written into?), the outputs' exact types, storage shared with an
  input, and whether an output still changes after the call returned (a side stream not joined to the caller's
  stream, a background thread, a lazy write): a copy is taken on the caller's stream the moment the kernel
  returns and compared with the output once the device is synchronized and new threads have finished.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import threading
import time

import torch

__all__ = ["Watch", "block_network", "call", "overwrite"]


def block_network() -> None:
    """Make every socket creation and name lookup in this process raise."""

    def refuse(*args, **kwargs):
        raise OSError("the network is not available to candidates")

    import _socket

    for mod in (socket, _socket):
        for name in ("socket", "create_connection", "getaddrinfo", "socketpair", "fromfd", "create_server"):
            if hasattr(mod, name):
                setattr(mod, name, refuse)


def _namespaces() -> dict[str, dict]:
    import torch.nn.functional as F

    mods = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.functional": F, "torch.cuda": torch.cuda,
            "time": time, "torch.testing": torch.testing}
    for name, m in list(sys.modules.items()):
        if name.startswith("k3.kernel_reward") and m is not None:
            mods[name] = m
    # Functions and classes only: plain values (torch.cuda's lazily set device count, its init flag) change as
    # torch runs, while a timer, a sync or a comparison that was swapped is always a callable.
    return {name: {k: v for k, v in vars(m).items() if callable(v)} for name, m in mods.items()}


def precision_settings() -> dict[str, str]:
    """The global switches that trade fp32 accuracy for speed, as strings."""
    out = {"float32_matmul_precision": torch.get_float32_matmul_precision()}
    for name, get in (("cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                      ("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
                      ("cuda.matmul.allow_fp16_reduced_precision_reduction",
                       lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
                      ("cuda.matmul.allow_bf16_reduced_precision_reduction",
                       lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)):
        try:
            out[name] = str(get())
        except Exception as e:  # a build without the switch
            out[name] = f"unavailable ({type(e).__name__})"
    return out


def _torch_own_wrapper(new, old) -> bool:
    """Whether `new` is torch's own wrapper of `old`: torch's compiler, when a library (fla) first imports it, wraps
    functions of torch's namespace (torch.manual_seed, ...) in place, with functools.wraps, by code in torch's own
    package. That is not a candidate's tampering."""
    code = getattr(new, "__code__", None)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    return ("torch._dynamo" in sys.modules and getattr(new, "__wrapped__", None) is old and code is not None
            and os.path.abspath(code.co_filename).startswith(torch_dir))


class Watch:
    """The process-wide watches of the module docstring; `facts()` reads them."""

    def __init__(self, forbidden: tuple[str, ...] = ()):
        self.graph_replays = 0
        self.forbidden_calls: dict[str, int] = {}
        self._watch_graphs()
        for path in forbidden:
            self._forbid(path)
        self.precision = precision_settings()
        self.threads = set(threading.enumerate())
        self.namespaces = _namespaces()

    def _watch_graphs(self) -> None:
        watch = self

        for cls in (getattr(torch.cuda, "CUDAGraph", None), getattr(torch._C, "_CUDAGraph", None)):
            replay = getattr(cls, "replay", None) if cls is not None else None
            if replay is None:
                continue

            def counted(self, *a, _replay=replay, **k):
                watch.graph_replays += 1
                return _replay(self, *a, **k)

            try:
                cls.replay = counted
            except (TypeError, AttributeError):  # a C type that refuses new attributes
                pass

    def _forbid(self, path: str) -> None:
        mod_name, fn_name = path.split(":")
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, fn_name)
        calls = self.forbidden_calls
        calls[path] = 0

        def flagged(*args, **kwargs):
            calls[path] += 1
            return fn(*args, **kwargs)

        setattr(mod, fn_name, flagged)

    def new_threads(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in self.threads and t.is_alive()]

    def facts(self) -> dict:
        """What changed since the watch was installed: replaced attributes, precision switches, graph replays,
        forbidden calls, threads still running."""
        now = _namespaces()
        replaced = sorted(f"{ns}.{k}" for ns, before in self.namespaces.items() for k, v in before.items()
                          if ns in now and k in now[ns] and now[ns][k] is not v
                          and not _torch_own_wrapper(now[ns][k], v))
        precision = precision_settings()
        return {"replaced": replaced,
                "precision_changed": {k: [self.precision[k], v] for k, v in precision.items() if self.precision[k] != v},
                "graph_replays": self.graph_replays,
                "forbidden_calls": {k: v for k, v in self.forbidden_calls.items() if v},
                "threads": [t.name for t in self.new_threads()]}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _storages(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # a tensor without storage (a subclass, a meta tensor)
        return -1


def call(kernel, args: tuple, device: str, watch: Watch, join_s: float = 2.0):
    """Run `kernel(*args)` once and return (outputs as a tuple, facts). Facts: the outputs' type names,
    "inputs_written" (argument positions whose values changed), "aliases" (outputs sharing an input's storage),
    "deferred" (outputs that changed after the call returned), "not_dense" (outputs that are not plain strided
    tensors on `device`)."""
    before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
    out = kernel(*args)
    outs = out if isinstance(out, tuple) else (out,)
    snap = [o.clone() if type(o) is torch.Tensor else None for o in outs]  # on the caller's stream, no sync
    if device == "cuda":
        torch.cuda.synchronize()
    for t in watch.new_threads():
        t.join(timeout=join_s)
    facts = {"types": [f"{type(o).__module__}.{type(o).__qualname__}" for o in outs],
             "inputs_written": [i for i, (a, b) in enumerate(zip(args, before)) if b is not None and not _same(a, b)],
             "aliases": [], "deferred": [], "not_dense": []}
    inputs = {_storages(a) for a in args if isinstance(a, torch.Tensor)} - {-1, 0}
    for j, (o, s) in enumerate(zip(outs, snap)):
        if s is None:
            continue
        if _storages(o) in inputs:
            facts["aliases"].append(j)
        if o.layout != torch.strided or o.device.type != device:
            facts["not_dense"].append(j)
        if not _same(o, s):
            facts["deferred"].append(j)
    return outs, facts


def overwrite(args: tuple, new: tuple) -> None:
    """Write `new`'s tensor values into `args`'s tensors in place (the detectors' mutated-input call)."""
    for a, b in zip(args, new):
        if isinstance(a, torch.Tensor):
            a.copy_(b)
