"""What the Triton kernels of k3.ops share (situ_triton, moe_combine, mla_decode, muon_update, linear_ce, rms_norm).

Triton is imported lazily: every kernel module imports on a CPU-only machine without Triton, and `available` /
`runnable` say whether the kernels can run. ``TRITON_INTERPRET=1`` runs them on CPU tensors in Triton's interpreter
(the tests); the flag is read at each call, and the jitted kernels are cached per interpreter setting, because
``triton.jit`` picks compiled or interpreted when it wraps the function.

A kernel is a module-level function that reads ``tl`` (triton.language) and the reduction combine functions
``_SUM`` / ``_MAX`` as globals of its own module: Triton's interpreter resolves names only in the kernel's module
globals (no closures). `bind` sets them there when the module first jits its kernels. The kernels call only Triton
builtins: Triton's own jitted helpers (tl.max, tl.sum, tl.zeros, tl.cdiv) cannot be called by the interpreter when
triton was imported before TRITON_INTERPRET was set (as in the tests), so reductions are ``tl.reduce`` with the
combine functions tl.max and tl.sum use (which the interpreter also recognizes and runs as numpy reductions).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from k3.ops.registry import Target


def interpret() -> bool:
    """Whether Triton's interpreter is on, read from the environment now."""
    import triton

    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older versions read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runnable() -> tuple[bool, str]:
    """(True, "") when Triton kernels can run in this process: Triton imports, and there is a CUDA device or
    ``TRITON_INTERPRET=1`` (CPU tensors); else (False, why not)."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install failing at import
        return False, f"triton is not importable ({type(e).__name__}: {e})"
    if interpret():
        return True, ""
    if not torch.cuda.is_available():
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter)"
    return True, ""


def available(target: Target) -> tuple[bool, str]:
    """The registry's availability check of a Triton kernel: `runnable`, and tensors on a CUDA device unless the
    interpreter is on."""
    ok, why = runnable()
    if ok and target.device.type != "cuda" and not interpret():
        return False, f"the kernels need CUDA tensors (or TRITON_INTERPRET=1), got device {target.device}"
    return ok, why


def bind(namespace: dict) -> None:
    """Put ``tl`` and the combine functions ``_SUM`` and ``_MAX`` into a kernel module's globals (`namespace`)."""
    import triton.language as tl

    namespace.update(tl=tl, _SUM=tl.standard._sum_combine, _MAX=tl.standard._elementwise_max)



def pow2(n: int) -> int:
    """The smallest power of two >= n, and at least 2 (a block size for a dimension of n)."""
    return 1 << max(n - 1, 1).bit_length()


def within(**blocks: str):
    """An `autotuned` prune keeping the configs whose every block (a meta-parameter name) is no wider than the
    power of two covering the dimension (an argument name) it runs along: wider ones only add masked lanes."""
    return lambda config, args: all(config[b] <= pow2(args[d]) for b, d in blocks.items())


def autotuned(kernel, table, names: tuple[str, ...], key: list[str], prune=None):
    """`kernel` (jitted) wrapped in ``triton.autotune`` over `table`: rows of the meta-parameters `names` followed by
    num_warps and, when present, num_stages. `key`: the arguments whose values pick a tuning (Triton adds the tensor
    arguments' dtypes); `prune(config_values, named_args) -> bool`: keeps a row for a call (None: every row; a call
    that would keep none keeps the first). Every config must write the same outputs from the same inputs and nothing
    else, since the timing runs launch each one: a kernel that accumulates into its output cannot be tuned so."""
    import triton

    def config(row):
        meta = dict(zip(names, row[:len(names)]))
        rest = row[len(names):]
        return triton.Config(meta, num_warps=rest[0], **({"num_stages": rest[1]} if len(rest) > 1 else {}))

    configs = [config(row) for row in table]
    if prune is None:
        return triton.autotune(configs, key=key, do_bench=bench)(kernel)

    def early(configs, named_args, **kwargs):
        kept = [c for c in configs if prune(c.kwargs, named_args)]
        return kept or configs[:1]

    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": early}, do_bench=bench)(kernel)


# How long each config of an autotuned kernel is timed (ms). Triton's defaults (25 of warm-up, 100 of timing) make a
# new key (a new log2 bucket of tokens: a serving step of a count not seen before) cost ~1 s per 8-config kernel
# while a request waits; these kernels run for microseconds, so 20 ms still takes hundreds of samples each.
BENCH_WARMUP_MS, BENCH_REP_MS = 5, 20


def bench(kernel_call, quantiles):
    """The timing of one autotuning config (``triton.autotune``'s `do_bench`), over BENCH_WARMUP_MS/BENCH_REP_MS."""
    import triton.testing

    return triton.testing.do_bench(kernel_call, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, quantiles=quantiles)
