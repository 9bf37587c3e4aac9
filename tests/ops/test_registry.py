"""The op registry and the Backends choice (pure logic: no kernel runs here, nothing is allocated on a GPU)."""

import dataclasses

import pytest
import torch

from k3.ops import registry
from k3.ops.registry import Backends, Fast, Op, Target, backends_from_env, dispatch, ops, register, runs_on

CUDA = Target(torch.device("cuda"), torch.bfloat16)  # dispatch() only reads the device type and dtype
CPU = Target(torch.device("cpu"), torch.float32)
YES = lambda target: (True, "")  # noqa: E731
NO = lambda target: (False, "the kernel library is missing")  # noqa: E731


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch):
    monkeypatch.setattr(registry, "_notices", set())


def _with(monkeypatch, available=YES, validated=None, **per_op):
    """Every registered op with its fast implementations' availability replaced by `available` (and their
    validation record by `validated`, where given); per_op: {op: available} for single ops."""
    for name, op in list(ops().items()):
        avail = per_op.get(name, available)
        fast = tuple(dataclasses.replace(f, available=avail, **({} if validated is None else {"validated": validated}))
                     for f in op.fast)
        monkeypatch.setitem(registry._ops, name, dataclasses.replace(op, fast=fast))


def _fast(op: str) -> str:
    """The name `fast` (and a validated `auto` on CUDA) picks: the first fast path, or the reference for an op
    that has none."""
    return ops()[op].fast[0].name if ops()[op].fast else "torch"


def test_every_op_registers_its_facts():
    # The fast implementations, which are validated on GPU (all but the Muon update kernels, which measured no faster
    # than the PyTorch passes, the packed MXFP4 expert kernels, slower than the dequantized experts' GEMMs, and KCP's
    # fla chunks, not yet run on a GPU) and which also run on CPU when asked for; a tolerance with its reason for each
    # op.
    assert {name: [f.name for f in op.fast] for name, op in ops().items()} == {
        "kda": ["fla"], "short_conv": ["fla"], "attn_res": ["fla"], "gate_norm": ["fla"], "mla": ["flex"],
        "moe": ["grouped"], "moe_combine": ["triton"], "situ": ["triton"], "mla_decode": ["triton"],
        "muon": ["triton"], "linear_ce": ["triton"], "rms_norm": ["triton"], "mxfp4_fake_quant": ["triton"],
        "mxfp8_fake_quant": ["triton"], "mx_moe": ["triton", "triton_grouped"], "kda_replay": ["triton"],
        "kda_verify_replay": ["triton"], "kda_verify_step": ["triton"], "kda_chunk": ["fla"],
        "kda_decode": ["triton"], "moe_route": ["triton"], "vision_attn": ["varlen", "flex"],
        "attn_res_norm": ["triton"], "mla_absorb_v": ["triton"], "mla_gate": ["triton"],
        "moe_gemv": ["triton"], "moe_combine_norm": ["triton"], "mla_append": ["triton"], "rms_norm_pair": ["triton"],
        "kda_decode_decay_proj": ["triton"], "moe_route_round": ["triton"], "moe_out": ["triton"],
        "mla_combine_absorb_v": ["triton"], "moe_combine_norm_out": ["triton"],
        "mla_combine_absorb_v_gate": ["triton"]}
    fast = {name: op for name, op in ops().items() if op.fast}
    # kda_chunk (KDA context parallelism's chunks on fla) has GPU tests not yet run on a GPU; mx_moe's first path (the
    # token-centric kernels) stays unvalidated, its second (grouped) is validated; vision_attn's two paths both are
    assert {name for name, op in fast.items() if not op.fast[0].validated} == {"muon", "mx_moe", "kda_chunk"}
    assert [(f.name, f.validated) for f in ops()["vision_attn"].fast] == [("varlen", True), ("flex", True)]
    assert {name for name, op in fast.items() if op.fast[0].cpu} == {"moe", "mla_decode", "muon", "linear_ce", "mx_moe",
                                                                    "mxfp4_fake_quant", "mxfp8_fake_quant",
                                                                    "kda_replay", "kda_verify_replay", "kda_decode",
                                                                    "kda_verify_step",
                                                                    "moe_route", "attn_res_norm", "mla_absorb_v",
                                                                    "mla_gate", "moe_gemv", "moe_combine_norm",
                                                                    "mla_append", "rms_norm_pair",
                                                                    "kda_decode_decay_proj", "moe_route_round",
                                                                    "moe_out", "mla_combine_absorb_v",
                                                                    "moe_combine_norm_out",
                                                                    "mla_combine_absorb_v_gate"}
    assert all(len(op.tolerance) > 20 and callable(op.reference) for op in ops().values())
    option_fields = {f.name for f in dataclasses.fields(Backends)} - {"default", "per_op"}
    assert {o for op in ops().values() for o in op.options} == option_fields  # every option belongs to an op


def test_mx_moe_auto_takes_the_grouped_kernels(monkeypatch):
    # the rule of k3.ops.mx_moe: auto takes the first available and validated implementation; the token-centric
    # kernels stay unvalidated, the grouped ones are validated, so auto (and the checkpoint loader's packed "auto")
    # use them on CUDA, while fast keeps naming the first; with the grouped ones unvalidated auto keeps the reference
    op = ops()["mx_moe"]
    assert [(f.name, f.validated, f.cpu) for f in op.fast] == [("triton", False, True), ("triton_grouped", True, True)]
    _with(monkeypatch)
    assert dispatch("mx_moe", CUDA).name == "triton_grouped" and dispatch("mx_moe", CPU).name == "torch"
    assert Backends(default="fast").requested("mx_moe") == "triton"
    from k3.checkpoint import _packed_choice

    assert _packed_choice("auto", torch.device("cuda"), None) and not _packed_choice("auto", torch.device("cpu"), None)
    _with(monkeypatch, validated=False)
    assert dispatch("mx_moe", CUDA).name == "torch" and not _packed_choice("auto", torch.device("cuda"), None)


def test_auto_uses_the_reference_on_cpu_and_validated_fast_paths_on_cuda(monkeypatch):
    _with(monkeypatch, validated=True)
    for op in ops():
        assert dispatch(op, CPU).name == "torch"
        assert dispatch(op, CUDA).name == _fast(op)
        assert dispatch(op, CUDA).fn is (ops()[op].fast[0].fn if ops()[op].fast else ops()[op].reference)
    assert dispatch("kda", CPU).fn is ops()["kda"].reference
    assert dispatch("kda", torch.zeros(2)).name == "torch"  # a tensor stands for its own device and dtype


def test_torch_is_the_reference_everywhere(monkeypatch):
    _with(monkeypatch, validated=True)
    for op in ops():
        assert dispatch(op, CUDA, Backends(default="torch")).name == "torch"
        assert dispatch(op, CPU, Backends(default="torch")).name == "torch"


def test_unvalidated_or_unavailable_fast_paths_fall_back_with_one_notice(monkeypatch, capsys):
    _with(monkeypatch, moe=NO)
    monkeypatch.setitem(registry._ops, "kda", dataclasses.replace(
        ops()["kda"], fast=(dataclasses.replace(ops()["kda"].fast[0], validated=False),)))
    assert dispatch("kda", CUDA).name == "torch"
    assert dispatch("kda", CUDA).name == "torch"
    assert dispatch("moe", CUDA).name == "torch"
    assert dispatch("muon", CUDA).name == "torch"  # not validated: `auto` keeps the PyTorch passes
    err = capsys.readouterr().err
    assert err.count("kda runs on its reference path") == 1 and err.count("not yet validated") == 2
    assert "K3_KDA_BACKEND=fla" in err and "per_op={'kda': 'fla'}" in err
    assert "moe runs on its reference path: the kernel library is missing" in err


def test_explicit_choices_are_obeyed_or_refused_by_name(monkeypatch):
    _with(monkeypatch, validated=False)
    assert dispatch("mla", CUDA, Backends(per_op={"mla": "torch"})).name == "torch"
    assert dispatch("kda", CUDA, Backends(per_op={"kda": "fla"})).name == "fla"  # forced: runs though not validated
    _with(monkeypatch, available=NO)
    with pytest.raises(ValueError, match="kda=fla: the kernel library is missing"):
        dispatch("kda", CUDA, Backends(per_op={"kda": "fla"}))
    with pytest.raises(ValueError, match="kda=fla needs CUDA tensors, got device cpu"):
        dispatch("kda", CPU, Backends(per_op={"kda": "fla"}))
    _with(monkeypatch, validated=True)
    assert dispatch("moe", CPU, Backends(per_op={"moe": "grouped"})).name == "grouped"  # the grouped GEMM runs on CPU
    assert dispatch("attn_res", CUDA, Backends(per_op={"attn_res": "torch"})).name == "torch"  # the pin wins
    assert dispatch("attn_res", CUDA, Backends(default="torch", per_op={"attn_res": "auto"})).name == "fla"


def test_fast_runs_every_fast_path_and_refuses_one_that_cannot_run(monkeypatch):
    _with(monkeypatch, validated=False)
    fast = Backends(default="fast")
    assert all(dispatch(op, CUDA, fast).name == _fast(op) for op in ops())
    assert dispatch("moe", CUDA, Backends(default="fast", per_op={"moe": "torch"})).name == "torch"  # pinned: kept
    with pytest.raises(ValueError, match="kda=fla needs CUDA tensors"):
        dispatch("kda", CPU, fast)
    _with(monkeypatch, gate_norm=NO)
    with pytest.raises(ValueError, match="gate_norm=fla: the kernel library is missing"):
        dispatch("gate_norm", CUDA, fast)


def test_names_are_checked_when_the_choice_is_built():
    with pytest.raises(ValueError, match="Backends.default='turbo' is invalid: use auto, torch, fast"):
        Backends(default="turbo")
    with pytest.raises(ValueError,
                       match="per_op names no op 'kda_host_offsets'; the ops are attn_res, attn_res_norm, gate_norm"):
        Backends(per_op={"kda_host_offsets": "fla"})
    with pytest.raises(ValueError, match=r"per_op\['attn_res'\]='turbo' is invalid: use auto, torch, fla"):
        Backends(per_op={"attn_res": "turbo"})
    with pytest.raises(ValueError, match=r"per_op\['moe'\]='fla' is invalid: use auto, torch, grouped"):
        Backends(per_op={"moe": "fla"})
    with pytest.raises(ValueError, match="per_op must map op names to backends"):
        Backends(per_op=["moe"])
    for field, bad in (("kda_host_offsets", 1), ("flex_autotune", "yes"), ("situ_autotune", None)):
        with pytest.raises(ValueError, match=f"Backends.{field}={bad!r} is invalid"):
            Backends(**{field: bad})
    with pytest.raises(ValueError, match="flex_kernel_options.*keys among"):
        Backends(flex_kernel_options={"fwd_num_warps": True})


def test_a_choice_is_a_value():
    pinned = {"moe": "grouped"}
    b = Backends(per_op=pinned, flex_kernel_options={"bwd_num_warps": 8})
    pinned["moe"] = "torch"  # the caller's dict is copied
    assert b.per_op == {"moe": "grouped"}
    assert b == Backends(per_op={"moe": "grouped"}, flex_kernel_options={"bwd_num_warps": 8})
    assert hash(b) == hash(Backends(per_op={"moe": "grouped"}, flex_kernel_options={"bwd_num_warps": 8}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.default = "torch"


def test_a_registered_op_dispatches_to_its_fast_implementation_or_falls_back(monkeypatch, capsys):
    # A new op registers in its own file and is chosen like the others.
    state = {"ok": True}
    reference = lambda x: x + 1  # noqa: E731
    doubled = lambda x: (2 * x + 2) // 2  # noqa: E731  (the same result another way: the "fast" one)
    op = Op("plus_one", reference=reference, tolerance="exact: integer arithmetic on both sides",
            fast=(Fast("doubled", doubled, lambda t: (state["ok"], "" if state["ok"] else "no doubling here"),
                       validated=True, cpu=True),))
    monkeypatch.setitem(registry._ops, "plus_one", op)

    def plus_one(x, backends=None):  # what the op's file exposes
        return dispatch("plus_one", x, backends).fn(x)

    x = torch.arange(3)
    assert dispatch("plus_one", CUDA).name == "doubled" and runs_on("plus_one", "doubled", CUDA)
    assert dispatch("plus_one", x).name == "torch"  # auto keeps the reference on CPU
    assert torch.equal(plus_one(x, Backends(per_op={"plus_one": "doubled"})), x + 1)  # asked for: runs on CPU too
    assert torch.equal(plus_one(x, Backends(default="fast")), x + 1)
    state["ok"] = False
    assert dispatch("plus_one", CUDA).name == "torch" and not runs_on("plus_one", "doubled", CUDA)
    assert "plus_one runs on its reference path: no doubling here" in capsys.readouterr().err
    with pytest.raises(ValueError, match="plus_one=doubled: no doubling here"):
        plus_one(x, Backends(default="fast"))
    assert backends_from_env({"K3_PLUS_ONE_BACKEND": "doubled"}).per_op == {"plus_one": "doubled"}
    with pytest.raises(ValueError, match="fast implementation names must be distinct"):
        register(dataclasses.replace(op, name="other", fast=(op.fast[0], op.fast[0])))
    with pytest.raises(KeyError, match="no op 'nothing' is registered"):
        dispatch("nothing", CPU)


def test_backends_from_env_fills_the_choice_from_the_variables():
    assert backends_from_env({}) == Backends()
    assert backends_from_env({}, default="torch") == Backends(default="torch")
    env = {"K3_MOE_BACKEND": "grouped", "K3_KDA_BACKEND": " Torch ", "K3_MLA_BACKEND": "auto",
           "K3_KDA_HOST_OFFSETS": "0", "K3_FLEX_AUTOTUNE": "1", "K3_SITU_AUTOTUNE": "off",
           "K3_FLEX_KERNEL_OPTIONS": '{"bwd_num_warps": 4}', "PATH": "/bin"}
    assert backends_from_env(env, default="fast") == Backends(
        default="fast", per_op={"moe": "grouped", "kda": "torch"}, kda_host_offsets=False, flex_autotune=True,
        situ_autotune=False, flex_kernel_options={"bwd_num_warps": 4})
    for env, match in [
            ({"K3_ATTN_RES_BACKEND": "turbo"}, "K3_ATTN_RES_BACKEND='turbo' is invalid: use auto, torch, fla"),
            ({"K3_KDA_HOST_OFFSETS_BACKEND": "fla"}, "K3_KDA_HOST_OFFSETS_BACKEND names no op"),
            ({"K3_FLEX_AUTOTUNE": "yes"}, "K3_FLEX_AUTOTUNE='yes' is invalid: use 0 or 1"),
            ({"K3_FLEX_KERNEL_OPTIONS": "{bwd"}, "K3_FLEX_KERNEL_OPTIONS is not valid JSON"),
            ({"K3_FLEX_KERNEL_OPTIONS": '{"BLOCK_M": 64}'}, "K3_FLEX_KERNEL_OPTIONS=.*keys among")]:
        with pytest.raises(ValueError, match=match):
            backends_from_env(env)
    with pytest.raises(ValueError, match="Backends.default='turbo'"):
        backends_from_env({}, default="turbo")


def test_importable_names_the_missing_module():
    assert registry.importable("json") == (True, "")
    ok, why = registry.importable("fla_missing_module_xyz")
    assert not ok and "fla_missing_module_xyz is not importable" in why and "pip install k3[gpu]" in why


def test_fast_implementations_are_opaque_to_torch_compile_once_asked(monkeypatch):
    # A compiled region (the serving engine's decode step) calls a fast implementation as it is, not traced: the
    # implementation runs outside the compiler (is_compiling() False inside it) and the result is the same.
    seen = []

    def fast(x):
        seen.append(torch.compiler.is_compiling())
        return x + 1

    op = Op("plus_one", reference=lambda x: x + 1, tolerance="exact: integer arithmetic",
            fast=(Fast("kernel", fast, YES, validated=True, cpu=True),))
    monkeypatch.setitem(registry._ops, "plus_one", op)
    monkeypatch.setattr(registry, "_opaque", {})
    b = Backends(per_op={"plus_one": "kernel"})

    def step(x):
        return dispatch("plus_one", x, b).fn(x * 2) - 1

    x = torch.arange(4.0)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend="eager")(x), x * 2)
    assert seen and seen[0] is True  # not asked: traced into
    seen.clear()
    registry.opaque_under_compile()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend="eager")(x), x * 2)
    assert seen == [False]  # called as it is, between compiled regions
    seen.clear()
    assert torch.equal(step(x), x * 2) and seen == [False]  # uncompiled calls are untouched
    assert dispatch("plus_one", x, b).fn is fast
    torch._dynamo.reset()


def test_the_paged_mla_decode_is_opaque_to_a_compiled_decode_step(monkeypatch):
    # The model calls the paged MLA decode (a Fast.fn) directly, not through dispatch: it must still run outside a
    # compiled decode step once asked, since Inductor cannot re-emit its Triton kernel (a NameError at compile time).
    import k3.ops.mla_decode as md
    from k3.config import K3Config
    from k3.model.gated_mla import GatedMLA

    seen = []
    real = md.mla_decode_paged

    def paged(*a, **k):
        seen.append(torch.compiler.is_compiling())
        return real(*a, **k)

    monkeypatch.setattr(md, "mla_decode_paged", paged)
    monkeypatch.setattr(registry, "_opaque", {})
    cfg = K3Config.from_preset("tiny")
    attn = GatedMLA(cfg, cfg.full_attn_layers[0]).eval()
    g = torch.Generator().manual_seed(0)
    for p in attn.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.05
    B, page_tokens, R = 2, 16, attn.kv_rank
    q = torch.randn(B, 1, attn.num_heads, attn.dn + attn.dr, generator=g)
    pages = torch.randn(4, page_tokens, R + attn.dr, generator=g)
    tables, lengths = torch.tensor([[0, 1], [2, 3]]), torch.tensor([20, 7])
    want = attn.paged(q, pages, tables, lengths, num_splits=2)
    registry.opaque_under_compile()
    seen.clear()
    torch._dynamo.reset()
    got = torch.compile(attn.paged, backend="eager")(q, pages, tables, lengths, num_splits=2)
    torch._dynamo.reset()
    assert seen == [False]  # called as it is, between compiled regions
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_importable_traces_without_a_graph_break_once_imported():
    # dispatch asks importable() inside a compiled decode step: once a module has imported, the answer is a lookup
    # that torch.compile traces (an import statement would break the graph)
    import torch._dynamo

    assert registry.importable("json") == (True, "")
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1 if registry.importable("json")[0] else x, backend="eager", fullgraph=True)
    assert torch.equal(f(torch.zeros(2)), torch.ones(2))
    torch._dynamo.reset()


def test_triton_availability_traces_without_a_graph_break(monkeypatch):
    # dispatch asks a Triton kernel's availability inside a compiled decode step; Triton reads its interpreter flag
    # through a C function that Dynamo cannot trace (a graph break at every dispatch), so while tracing dispatch
    # answers from the check's latest answer outside
    import torch._dynamo

    from k3.ops import _triton

    if not registry.importable("triton")[0]:
        pytest.skip("needs triton")
    fast = next(f for f in ops()["kda_replay"].fast if f.name == "triton")
    for flag in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", flag)
        ok = _triton.available(Target(torch.device("cpu")))[0]
        assert ok == (flag == "1")
        assert registry._available(fast, Target(torch.device("cpu"), torch.float32))[0] == ok  # read outside
        torch._dynamo.reset()
        f = torch.compile(lambda x: x + 1 if registry._available(fast, Target.of(x))[0] else x - 1,
                          backend="eager", fullgraph=True)
        assert torch.equal(f(torch.zeros(2)), torch.full((2,), 1.0 if ok else -1.0))
    # and through dispatch itself, as the compiled decode step asks
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    b = Backends(per_op={"kda_replay": "triton"})
    assert dispatch("kda_replay", torch.zeros(2), b).name == "triton"
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1 if dispatch("kda_replay", x, b).name == "triton" else x - 1,
                      backend="eager", fullgraph=True)
    assert torch.equal(f(torch.zeros(2)), torch.ones(2))
    torch._dynamo.reset()
