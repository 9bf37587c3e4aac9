"""Operations of one serving decode step, per kind of layer part: what fusing the step has left to fuse.

    python benchmarks/decode_ops.py --preset k3-mini --stack-projections both        # CPU or GPU, random weights

    python benchmarks/decode_ops.py --preset k3-mini --kernels --backend fast           # GPU: kernels per layer

Runs the serving engine (greedy, one request of a few tokens) and counts, in one eager decode step, every PyTorch
operation that computes (views, reshapes and the like are left out) outside k3's registered ops, plus one per call of
a registered op (k3.ops.registry: KDA, the short conv, AttnRes, gate norm, ...; on a GPU a registered op may launch a
few kernels, on a CPU its reference runs many operations, and both count as one). On a GPU each counted operation is
at least one kernel launch, so the count is a floor of the kernels in a captured decode graph. Prints one JSON
object per setting: the total, the GEMMs among them, and the count per layer part.

With --kernels (CUDA), the same decode step runs eagerly under torch.profiler instead, and every GPU kernel is
attributed to the layer part whose range (a `record_function` per part, opened by module hooks) launched it: the
kernels a captured decode graph replays, per layer, per kind of layer and per step, with the kernel names of each kind
(the budget of the fused decode step is about 12 per layer). It also counts every GPU activity of the trace
(`gpu_activities_in_trace`) and names those no launch was linked to (`not_attributed`), which the per-part counts miss.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

NO_KERNEL = {"view", "select", "slice", "permute", "t", "transpose", "unsqueeze", "squeeze", "expand", "_unsafe_view",
             "split", "split_with_sizes", "alias", "as_strided", "unbind", "detach", "reshape", "view_as_real",
             "chunk", "narrow", "unflatten", "flatten", "lift_fresh", "_reshape_alias", "diagonal", "movedim",
             "expand_as", "promote_types", "result_type", "is_same_size"}
GEMMS = {"mm", "addmm", "bmm", "linear", "matmul", "_grouped_mm", "baddbmm"}


class _Counter(TorchDispatchMode):
    def __init__(self, where: list[str], depth: dict):
        super().__init__()
        self.where, self.depth = where, depth
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.depth["n"] == 0 and name not in NO_KERNEL:
            self.ops[(self.where[-1], name)] += 1
        return func(*args, **(kwargs or {}))


def _wrap_registered_ops(where: list[str], depth: dict, calls: collections.Counter) -> None:
    """Every registered op's implementations count as one operation per call, what runs inside them not at all."""
    from k3.ops import registry

    def counted(fn, op):
        def call(*a, **k):
            if depth["n"] == 0:
                calls[(where[-1], f"op {op}")] += 1
            depth["n"] += 1
            try:
                return fn(*a, **k)
            finally:
                depth["n"] -= 1
        return call

    for name, op in list(registry.ops().items()):
        fast = tuple(dataclasses.replace(f, fn=counted(f.fn, name)) for f in op.fast)
        registry._ops[name] = dataclasses.replace(op, reference=counted(op.reference, name), fast=fast)


def count(model, stack: bool, device) -> dict:
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    where, depth, calls = ["model"], {"n": 0}, collections.Counter()
    _wrap_registered_ops(where, depth, calls)
    hooks = []
    for layer in model.model.layers:
        for cname, child in layer.named_children():
            label = f"{cname} ({type(child).__name__})"
            hooks.append(child.register_forward_pre_hook(lambda m, a, _l=label: where.append(_l)))
            hooks.append(child.register_forward_hook(lambda m, a, o: where.pop() and None))  # keeps the output
    seen = []
    forward = model.forward

    def counted_forward(ids, *a, **k):
        if ids.shape[-1] == 1 and not seen:  # the first decode step
            calls.clear()
            with _Counter(where, depth) as c:
                out = forward(ids, *a, **k)
            c.ops.update(calls)
            seen.append(c.ops)
            return out
        return forward(ids, *a, **k)

    model.forward = counted_forward
    try:
        eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=64, cuda_graphs=False, stack_projections=stack))
        eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0))
    finally:
        del model.forward
        for h in hooks:
            h.remove()
    ops = seen[0]
    parts = collections.Counter()
    for (part, _), n in ops.items():
        parts[part] += n
    return {"stack_projections": stack, "device": str(device), "operations": sum(ops.values()),
            "gemms": sum(n for (_, name), n in ops.items() if name in GEMMS),
            "per_part": dict(parts.most_common())}


def _part_ranges(model, label_of):
    """Module hooks that open a profiler range per layer part ("k3|L<i>|<part> (<Class>)") and close it after."""
    from torch.autograd.profiler import record_function

    hooks, open_ = [], []
    for i, layer in enumerate(model.model.layers):
        for cname, child in layer.named_children():
            label = f"k3|L{i}|{label_of(cname, child)}"

            def pre(m, a, _l=label):
                rf = record_function(_l)
                rf.__enter__()
                open_.append(rf)

            def post(m, a, o):
                open_.pop().__exit__(None, None, None)

            hooks.append(child.register_forward_pre_hook(pre))
            hooks.append(child.register_forward_hook(post))
    return hooks


def _owner(ev) -> str:
    """The innermost k3 part range above a profiler event, "model" outside every layer."""
    while ev is not None:
        if ev.name.startswith("k3|"):
            return ev.name
        ev = ev.cpu_parent
    return "k3|-|model"


def count_kernels(model, stack: bool, device) -> dict:
    """GPU kernels of one eager decode step per layer part (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    hooks = _part_ranges(model, lambda cname, child: f"{cname} ({type(child).__name__})")
    seen, forward = [], model.forward

    def profiled_forward(ids, *a, **k):
        if ids.shape[-1] == 1 and len(seen) == 1:  # the second decode step: the first one's lazy set-up is done
            torch.cuda.synchronize(device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                out = forward(ids, *a, **k)
                torch.cuda.synchronize(device)
            seen.append(prof)
            return out
        if ids.shape[-1] == 1:
            seen.append(None)
        return forward(ids, *a, **k)

    model.forward = profiled_forward
    try:
        eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=256, cuda_graphs=False, stack_projections=stack))
        eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0))
    finally:
        del model.forward
        for h in hooks:
            h.remove()
    if len(seen) < 2 or seen[1] is None:
        raise SystemExit("the engine ran fewer than two decode steps")
    per_layer, per_kind, names = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    total = 0
    for ev in seen[1].events():
        for kern in getattr(ev, "kernels", []):
            _, layer, part = _owner(ev).split("|", 2)
            total += 1
            per_layer[layer] += 1
            per_kind[part] += 1
            names[part][kern.name[:60]] += 1
    # every GPU activity of the trace, linked to a launch or not: a kernel whose launch the profiler did not correlate
    # (a driver-API launch, say) is missing from the attributed count; these name what the attribution missed
    from torch.autograd import DeviceType

    in_trace = collections.Counter(ev.name[:60] for ev in seen[1].events() if ev.device_type == DeviceType.CUDA)
    attributed = collections.Counter()
    for c in names.values():
        attributed.update(c)
    layer_kinds = collections.Counter()
    for i, layer in enumerate(model.model.layers):
        kinds = "+".join(type(c).__name__ for n, c in layer.named_children() if n in ("self_attn", "mlp", "block_sparse_moe"))
        layer_kinds[kinds] += 1
    return {"stack_projections": stack, "device": str(device), "kernels": total,
            "per_layer": dict(per_layer), "per_part": dict(per_kind.most_common()),
            "layers_by_kind": dict(layer_kinds),
            "kernel_names": {p: dict(c.most_common(12)) for p, c in names.items()},
            "gpu_activities_in_trace": sum(in_trace.values()),
            "not_attributed": dict((in_trace - attributed).most_common(12))}


def main(argv=None) -> int:
    from k3.cli_args import DefaultsHelpFormatter
    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM
    from k3.ops.registry import backends_from_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--stack-projections", choices=["off", "on", "both"], default="both")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", choices=["auto", "fast", "torch"], default="auto")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="the weights' dtype (auto: bf16 on a GPU, as served; fp32 on a CPU)")
    ap.add_argument("--kernels", action="store_true",
                    help="CUDA: count the GPU kernels of one eager decode step per layer part with torch.profiler "
                         "instead of the PyTorch operations")
    args = ap.parse_args(argv)
    if args.kernels and not args.device.startswith("cuda"):
        ap.error("--kernels counts GPU kernels: it needs --device cuda")
    dev = torch.device(args.device)
    cfg = K3Config.from_preset(args.preset).replace(num_nextn_predict_layers=0)
    model = K3ForCausalLM(cfg, backends=backends_from_env(os.environ, default=args.backend)).init_weights(seed=0)
    if args.dtype == "bf16" or (args.dtype == "auto" and dev.type == "cuda"):
        model = model.set_dtype(torch.bfloat16)
    model = model.to(dev).eval()
    for stack in {"off": [False], "on": [True], "both": [False, True]}[args.stack_projections]:
        print(json.dumps({"preset": args.preset, "dtype": str(next(model.parameters()).dtype).split(".")[-1],
                          **(count_kernels if args.kernels else count)(model, stack, dev)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
