"""Which implementation runs each op that has a fast path: the op registry and the one function that picks.

Every op has a PyTorch reference (its definition; runs anywhere) and one or more fast implementations (fla-core
kernels, compiled flex_attention, grouped GEMMs, our Triton kernels). The op's own file registers them:

    register(Op("gate_norm", reference=gate_norm_torch, tolerance="bf16: one rounding of y ...",
                fast=(Fast("fla", gate_norm_fla, fla_available, validated=True),)))

and its public function calls ``dispatch("gate_norm", o, backends).fn(...)``. Callers never choose: they hold a
`Backends` value (the model gets one from ``K3ForCausalLM.set_backends``, the optimizer as an argument) and pass
it to the ops, None meaning ``Backends()``. The choice never changes the math, only where it runs:

* ``auto`` (the default): the fast implementation on CUDA when it is available there and validated (its GPU tests
  against the reference passed with this code; BENCHMARKS.md keeps the record), else the reference, with a
  one-time notice on stderr saying why;
* ``torch``: the reference everywhere;
* ``fast``: every fast implementation, validated or not; asking for one that cannot run is an error.

``Backends.per_op`` pins single ops (``{"moe": "grouped"}``, ``{"kda": "torch"}``); the other fields are options of
the ops that read them (fla's host-side chunk lists for KDA, the flex MLA kernels' compilation, the SiTU kernel's
autotuning). The command line fills a `Backends` from ``--backend`` and the environment with `backends_from_env`,
the only place k3 reads K3_* variables for this.

Under torch.compile a fast implementation is opaque: the compiled code calls it as it is (a graph break there)
and fuses only the PyTorch code around it; its kernels are its own, already tuned, and tracing their launchers
gains nothing. A CUDA graph captured afterwards replays the breaks at no cost.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import torch

__all__ = ["DEFAULT", "FLEX_OPTION_KEYS", "Backends", "Fast", "Impl", "Op", "Target", "backends_from_env", "dispatch",
           "importable", "keep_opaque", "notice", "opaque", "opaque_under_compile", "ops", "register", "runs_on"]

REFERENCE = "torch"  # how Backends names the reference of every op
MODES = ("auto", "torch", "fast")


@dataclass(frozen=True)
class Target:
    """What an availability check looks at: the inputs' device and, where it matters, their dtype."""

    device: torch.device
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, x: torch.Tensor) -> "Target":
        return cls(x.device, x.dtype)


@dataclass(frozen=True)
class Fast:
    """One fast implementation of an op.

    `available(target) -> (ok, why)` says whether it can run on inputs like `target` (why not, if not);
    `validated`: its GPU tests against the reference passed with this code, so `auto` takes it on CUDA;
    `cpu`: it also runs on CPU tensors when asked for by name (`auto` keeps the reference on CPU)."""

    name: str
    fn: Callable
    available: Callable[[Target], tuple[bool, str]]
    validated: bool
    cpu: bool = False


@dataclass(frozen=True)
class Op:
    """An op: its reference, its fast implementations (the first is what ``fast`` picks), the tolerance its tests
    hold a fast implementation to against the reference (with the reason), and the `Backends` fields it reads."""

    name: str
    reference: Callable
    fast: tuple[Fast, ...]
    tolerance: str
    options: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        """The values Backends.per_op takes for this op."""
        return ("auto", REFERENCE, *(f.name for f in self.fast))


@dataclass(frozen=True)
class Impl:
    """`dispatch`'s answer: the implementation's name ("torch" for the reference) and its function."""

    name: str
    fn: Callable


_ops: dict[str, Op] = {}
_loaded = False


def register(op: Op) -> Op:
    """Add `op` to the registry (again, replacing it, when its module is imported again)."""
    names = [f.name for f in op.fast]
    if REFERENCE in names or "auto" in names or "fast" in names or len(set(names)) != len(names):
        raise ValueError(f"op {op.name!r}: fast implementation names must be distinct and not auto, torch or fast, "
                         f"got {names}")
    _ops[op.name] = op
    if _opaque:
        _opaque.update({f.fn: torch.compiler.disable(f.fn) for f in op.fast})
    return op


# Each fast implementation as torch.compile sees it: opaque (run as it is, between compiled regions), so that a
# compiled region (the serving engine's decode step) fuses only the PyTorch glue around the kernels and never
# traces into fla's or our Triton launchers (their autotuners, caches and launch-time checks). Filled by
# `opaque_under_compile`, which every k3 caller of torch.compile calls first (building it imports torch's compiler,
# seconds that a process which never compiles should not pay).
_opaque: dict[Callable, Callable] = {}  # a fast implementation's function (or a keep_opaque one) -> opaque version
_kernel_entries: list[Callable] = []  # kernel entry points an op file calls besides its Fast.fn (keep_opaque)


def keep_opaque(fn: Callable) -> Callable:
    """Register `fn`, a kernel entry point that an op file calls directly (not as a Fast.fn), to be opaque to
    torch.compile like the fast implementations; call it through `opaque(fn)`. Returns fn."""
    _kernel_entries.append(fn)
    if _opaque:
        _opaque[fn] = torch.compiler.disable(fn)
    return fn


def opaque(fn: Callable) -> Callable:
    """`fn` (a fast implementation's, or registered with `keep_opaque`) as a compiled region should call it:
    opaque once `opaque_under_compile` has run, `fn` itself otherwise."""
    return _opaque[fn] if _opaque and torch.compiler.is_compiling() else fn


def opaque_under_compile() -> None:
    """Make every fast implementation opaque to torch.compile from now on (see `_opaque`)."""
    _load_all()
    fns = [f.fn for op in _ops.values() for f in op.fast] + _kernel_entries
    _opaque.update({fn: torch.compiler.disable(fn) for fn in fns})


def _fast_impl(f: Fast) -> Impl:
    return Impl(f.name, opaque(f.fn))


def ops() -> Mapping[str, Op]:
    """Every registered op, by name (all of k3.ops is imported first, so every op file has registered)."""
    _load_all()
    return MappingProxyType(_ops)


def _load_all() -> None:
    """Import every module of k3.ops: each op file registers its ops when imported."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import k3.ops

    for m in pkgutil.iter_modules(k3.ops.__path__):
        importlib.import_module(f"k3.ops.{m.name}")


def _op(name: str) -> Op:
    if name not in _ops:
        _load_all()
    if name not in _ops:
        raise KeyError(f"no op {name!r} is registered; the ops are {', '.join(sorted(_ops))}")
    return _ops[name]


# --- the choice --------------------------------------------------------------------------------------------------

_FLAGS = ("flex_autotune", "situ_autotune")
# The keys Backends.flex_kernel_options may set: flex_attention's block sizes, stages and warps for the forward and
# backward kernels (op mla, k3.ops.mla_flex). Plain data here, so that checking a Backends needs no op file.
FLEX_OPTION_KEYS = frozenset(f"{p}{k}" for p in ("fwd_", "bwd_")
                             for k in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2",
                                       "num_stages", "num_warps"))


@dataclass(frozen=True)
class Backends:
    """Which implementation runs each op, and the options of the ops that have some.

    default: ``auto``, ``torch`` or ``fast`` for every op not in `per_op` (see the module docstring).
    per_op: op name -> ``auto``, ``torch`` or the name of one of its fast implementations (e.g. ``{"moe": "grouped"}``).
    kda_host_offsets: fla's KDA and conv take their packed-document chunk lists from offsets the caller computed on
        the host (the trainer), so a training forward never waits for the device; None: on (validated on GPU),
        False: fla builds the lists on the device. Read only where fla runs (ops kda and short_conv).
    flex_autotune: compile the flex MLA kernels with inductor's max-autotune (minutes more on first use of a
        shape) instead of fixed block sizes (op mla).
    flex_kernel_options: the flex MLA kernels' block sizes, stages and warps (keys among `FLEX_OPTION_KEYS`,
        positive ints; ``{}`` for torch's defaults); None: k3.ops.mla_flex's table for this GPU (op mla).
    situ_autotune: the SiTU-GLU kernel picks its tile and warp count by measurement per shape class on GPU; False
        keeps a fixed tile (op situ).

    Names and values are checked when it is built; a wrong one is a ValueError naming the field, the value and
    what is allowed."""

    default: str = "auto"
    per_op: Mapping[str, str] = field(default_factory=dict)
    kda_host_offsets: bool | None = None
    flex_autotune: bool = False
    flex_kernel_options: Mapping[str, int] | None = None
    situ_autotune: bool = True

    def __post_init__(self) -> None:
        if self.default not in MODES:
            raise ValueError(f"Backends.default={self.default!r} is invalid: use {', '.join(MODES)}")
        if not isinstance(self.per_op, Mapping):
            raise ValueError(f"Backends.per_op must map op names to backends, got {type(self.per_op).__name__}")
        object.__setattr__(self, "per_op", dict(self.per_op))
        if self.per_op:
            known = ops()
            for name, value in self.per_op.items():
                if name not in known:
                    raise ValueError(f"Backends.per_op names no op {name!r}; the ops are {', '.join(sorted(known))}")
                allowed = known[name].names()
                if value not in allowed:
                    raise ValueError(f"Backends.per_op[{name!r}]={value!r} is invalid: use {', '.join(allowed)}")
        if self.kda_host_offsets is not None and not isinstance(self.kda_host_offsets, bool):
            raise ValueError(f"Backends.kda_host_offsets={self.kda_host_offsets!r} is invalid: use None, True or False")
        for flag in _FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"Backends.{flag}={getattr(self, flag)!r} is invalid: use True or False")
        opts = self.flex_kernel_options
        if opts is not None:
            if not isinstance(opts, Mapping) or any(
                    k not in FLEX_OPTION_KEYS or isinstance(v, bool) or not isinstance(v, int) or v <= 0
                    for k, v in opts.items()):
                raise ValueError(f"Backends.flex_kernel_options={opts!r} is invalid: use None or a mapping of positive "
                                 f"integers with keys among {sorted(FLEX_OPTION_KEYS)}")
            object.__setattr__(self, "flex_kernel_options", dict(opts))

    def __hash__(self) -> int:
        opts = self.flex_kernel_options
        return hash((self.default, tuple(sorted(self.per_op.items())), self.kda_host_offsets, self.flex_autotune,
                     None if opts is None else tuple(sorted(opts.items())), self.situ_autotune))

    def requested(self, op: str) -> str:
        """What was asked for `op`: ``auto``, ``torch`` or a fast implementation's name."""
        req = self.per_op.get(op, self.default)
        return _op(op).fast[0].name if req == "fast" and _op(op).fast else req


DEFAULT = Backends()  # what None means wherever a function takes `backends`


_answers: dict[tuple, tuple[bool, str]] = {}  # availability checks' latest answers outside a compiled region


def _available(f: Fast, target: Target) -> tuple[bool, str]:
    """`f.available(target)`; while torch.compile traces (the compiled decode step dispatches every op), the latest
    answer given outside a compiled region: the checks read the environment (Triton's interpreter flag, through a C
    function) and import modules, which would break the graph at every dispatch."""
    key = (f.available, target)
    if torch.compiler.is_compiling() and key in _answers:
        return _answers[key]
    got = f.available(target)
    if not torch.compiler.is_compiling():
        _answers[key] = got
    return got


def dispatch(op: str, where: torch.Tensor | Target, backends: Backends | None = None) -> Impl:
    """The implementation of `op` for inputs like `where` (a tensor, or a Target) under `backends` (None: the
    default Backends()): the reference or one of the fast implementations, as the module docstring describes.
    Asking by name (per_op or ``fast``) for one that cannot run here is a ValueError saying why; ``auto`` falling
    back on a GPU prints a one-time notice saying why."""
    entry = _op(op)
    b = DEFAULT if backends is None else backends
    target = where if isinstance(where, Target) else Target.of(where)
    req = b.requested(op)
    reference = Impl(REFERENCE, entry.reference)
    if req == REFERENCE or not entry.fast:
        return reference
    if req != "auto":
        f = next(f for f in entry.fast if f.name == req)
        if target.device.type != "cuda" and not f.cpu:
            raise ValueError(f"{op}={f.name} needs CUDA tensors, got device {target.device}")
        ok, why = _available(f, target)
        if not ok:
            raise ValueError(f"{op}={f.name}: {why}")
        return _fast_impl(f)
    if target.device.type != "cuda":
        return reference
    reasons = []
    for f in entry.fast:
        ok, why = _available(f, target)
        if ok and not f.validated:
            ok, why = False, (f"the {f.name} backend is not yet validated against the reference on GPU "
                              f"(per_op={{{op!r}: {f.name!r}}}, K3_{op.upper()}_BACKEND={f.name} or --backend fast "
                              "forces it)")
        if ok:
            return _fast_impl(f)
        reasons.append(why)
    notice(f"{op} runs on its reference path: {reasons[0]}")
    return reference


def runs_on(op: str, name: str, where: torch.Tensor | Target, backends: Backends | None = None) -> bool:
    """Whether `op` would run on the implementation called `name` for inputs like `where` (nothing runs): for
    callers that must know ahead, such as the serving engine deciding whether a decode step can be captured."""
    return dispatch(op, where, backends).name == name


# --- helpers of the op files -------------------------------------------------------------------------------------

_notices: set[str] = set()


def notice(message: str) -> None:
    """Print `message` to stderr once per process."""
    if message not in _notices:
        _notices.add(message)
        print(f"k3: {message}", file=sys.stderr)


_imported: set[str] = set()  # modules `importable` found importable (an import, once done, stays done)


def importable(module: str) -> tuple[bool, str]:
    """(True, "") when `module` imports, else (False, why): the availability check of a kernel library.

    Before fla is first imported, Triton is asked to keep autotuning results on disk (TRITON_CACHE_AUTOTUNING=1,
    unless the variable is already set): fla's KDA kernels otherwise re-autotune in every new process, minutes
    per shape. The setting is read when fla's kernels are defined, so it has to precede the import."""
    if module in _imported:  # a dict lookup: dispatch, which asks this, runs inside compiled code too
        return True, ""
    if module.startswith("fla") and "fla" not in sys.modules:
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    try:
        __import__(module)
    except Exception as e:  # ImportError, or a Triton/driver problem at import
        hint = "; install it with `pip install k3[gpu]`" if module.startswith("fla") else ""
        return False, f"{module} is not importable ({type(e).__name__}: {e}){hint}"
    _imported.add(module)
    return True, ""


# --- the command line's way in -------------------------------------------------------------------------------------

_ON, _OFF = ("1", "on", "true"), ("0", "off", "false")


def _switch(environ: Mapping[str, str], var: str) -> bool | None:
    """A 0/1 (off/on) variable: None when unset."""
    raw = environ.get(var)
    if raw is None or not raw.strip():
        return None
    v = raw.strip().lower()
    if v not in _ON + _OFF:
        raise ValueError(f"{var}={raw!r} is invalid: use 0 or 1 (off or on)")
    return v in _ON


def backends_from_env(environ: Mapping[str, str], default: str = "auto") -> Backends:
    """A Backends from `default` (the command line's --backend) and the environment `environ`:

        K3_<OP>_BACKEND=auto|torch|<fast name>   pins one op (auto or unset: `default` decides), e.g. K3_MOE_BACKEND
        K3_KDA_HOST_OFFSETS=0|1                  kda_host_offsets (unset: on)
        K3_FLEX_AUTOTUNE=0|1                     flex_autotune (unset: off)
        K3_FLEX_KERNEL_OPTIONS='{"bwd_num_warps": 8, ...}'   flex_kernel_options (JSON; unset: the table for this GPU)
        K3_SITU_AUTOTUNE=0|1                     situ_autotune (unset: on)

    A bad value, or a K3_*_BACKEND variable that names no op, is a ValueError naming the variable."""
    known = ops()
    per_op = {}
    for var in sorted(environ):
        if var.startswith("K3_") and var.endswith("_BACKEND") and var[3:-8].lower() not in known:
            raise ValueError(f"{var} names no op; the ops are {', '.join(sorted(known))} (K3_<OP>_BACKEND)")
    for name, op in known.items():
        var = f"K3_{name.upper()}_BACKEND"
        value = environ.get(var, "").strip().lower()
        if value in ("", "auto"):
            continue
        if value not in op.names():
            raise ValueError(f"{var}={value!r} is invalid: use {', '.join(op.names())}")
        per_op[name] = value
    fields = {}
    for var, name in (("K3_KDA_HOST_OFFSETS", "kda_host_offsets"), ("K3_FLEX_AUTOTUNE", "flex_autotune"),
                      ("K3_SITU_AUTOTUNE", "situ_autotune")):
        value = _switch(environ, var)
        if value is not None:
            fields[name] = value
    raw = environ.get("K3_FLEX_KERNEL_OPTIONS")
    if raw is not None:
        try:
            opts = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"K3_FLEX_KERNEL_OPTIONS is not valid JSON ({e}): {raw!r}") from None
        if not isinstance(opts, dict):
            raise ValueError(f"K3_FLEX_KERNEL_OPTIONS must be a JSON object of positive integers, got {raw!r}")
        try:
            Backends(flex_kernel_options=opts)
        except ValueError as e:
            raise ValueError(f"K3_FLEX_KERNEL_OPTIONS={raw!r}: {e}") from None
        fields["flex_kernel_options"] = opts
    return Backends(default=default, per_op=per_op, **fields)
