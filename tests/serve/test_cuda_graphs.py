"""Decode steps over static buffers (k3.serve.cuda_graphs): the eager static-buffer mode on CPU (padding rows, the
scratch page, the fixed split count) against the cache-free reference and the eager runner; when graphs are used;
real capture on a GPU (marked `gpu`)."""

import copy
import functools

import pytest
import torch

from helpers import DECODE_KERNELS, randomize_, rel_err, serve_flag_reaches_the_engine
from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.ops import mla_decode, registry
from k3.ops.registry import Backends
from k3.serve.cuda_graphs import DecodeGraphs, decode_buckets
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.generate import generate_tokens
from k3.serve.runner import ForwardBatch
from k3.serve.cache.views import SeqSlots
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig

GREEDY = SamplingParams(max_tokens=5, temperature=0)
HB, PAGE = 16, 48
GRAPH_OPS = {"mla_decode": "triton", "moe": "grouped"}  # the implementations a captured step needs
ENGINE = {}  # EngineConfig fields a fixture sets for every engine of its test


@functools.lru_cache(maxsize=1)
def _model():
    # As in test_engine.py: the tiny model (3 KDA + 2 MLA layers, MoE), wide logit gaps for stable greedy choices.
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vocab_size=512, eos_token_id=0)
    m = randomize_(K3ForCausalLM(cfg), seed=3).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40)
    return m


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple) -> list[int]:
    return list(generate_tokens(_model(), list(prompt), GREEDY, eos_id=None))


def forward(eng, tokens, starts, slots):
    """The logits of one plain forward at the runner."""
    return eng.runner.execute(ForwardBatch(tokens, starts, slots)).logits


def _engine(model=None, max_num_seqs=4, max_model_len=2048, mb=8.0, **kw):
    kw = {**ENGINE, **kw}
    eng = LLMEngine(model or _model(), None, EngineConfig(
        cache_memory_mb=mb, page_tokens=PAGE, hash_block_tokens=HB, max_model_len=max_model_len,
        scheduler=SchedulerConfig(max_step_tokens=96, prefill_chunk=40, max_num_seqs=max_num_seqs,
                                  long_prompt_tokens=120), **kw))
    eng.eos_id = None
    return eng


def _serve_to_the_reference(eng, prompts):
    """Run `prompts` through `eng` to the end; each greedy output must be the cache-free reference's."""
    seqs = [eng.add_request(p, GREEDY) for p in prompts]
    while eng.has_work():
        eng.step()
    for s, p in zip(seqs, prompts):
        assert s.output_ids == reference(tuple(p))
    return seqs


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def use_backends():
    """Set the shared model's Backends for one test: `use_backends(b)` (restored to the default after)."""
    yield _model().set_backends
    _model().set_backends(None)


@pytest.fixture
def static_mode(monkeypatch, use_backends):
    """The static-buffer decode step without capture, on the backends a graph needs."""
    monkeypatch.setitem(ENGINE, "cuda_graphs", "eager")
    use_backends(Backends(per_op=GRAPH_OPS))  # mla_decode on CPU: the paged reference (or the interpreter)


@pytest.fixture(params=["reference", "triton-interpreter"])
def decode_kernel(request, monkeypatch):
    """The paged decode on CPU: its gather-based reference, or the Triton kernel in Triton's interpreter."""
    if request.param == "triton-interpreter":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


def test_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(4) == [1, 2, 4]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def test_static_decode_steps_with_padding_match_the_reference(static_mode, monkeypatch, decode_kernel):
    # Decode batches of 1, 3 (bucket 4: one padding row), 4, then 3 again (the padding row held a request the step
    # before) and 1; positions cross page boundaries (48, 96) while decoding. With the Triton kernel in the
    # interpreter the split count is fixed per bucket (from max_model_len), as in a captured step.
    eng = _engine()
    graphs = eng.runner.graphs
    assert isinstance(graphs, DecodeGraphs) and not graphs.capture
    scratch = graphs.scratch
    # The scratch page is the pool's last page, outside the prefix cache's (the allocator's) pages.
    assert scratch == eng.cache.pool.num_pages - 1 == eng.cache.prefix.num_pages
    seen = []
    orig = graphs.run

    prefill_rows = []  # (requests, tokens each) of the hash-block-sized prefill chunks run on the static buffers

    def spy(tokens, starts, slots):
        for s in slots:
            assert scratch not in s.kda_pages and all(scratch not in t for t in s.mla_tables)
        out = orig(tokens, starts, slots)
        if len(tokens[0]) == 1:
            seen.append((len(tokens), graphs.bucket_size(len(tokens))))
        elif out is not None:
            prefill_rows.append((len(tokens), len(tokens[0])))
        return out

    graphs.run = spy
    splits = []  # the paged decode's split count, as each MLA layer passes it on
    orig_paged = mla_decode.mla_decode_paged
    monkeypatch.setattr(mla_decode, "mla_decode_paged", lambda *a, **k: splits.append(a[7]) or orig_paged(*a, **k))
    prompts = _prompts((44, 46, 10, 94))
    seqs = [eng.add_request(p, GREEDY) for p in prompts]
    while eng.has_work():
        eng.step()
        eng.cache.prefix.check_invariants()
    for s, p in zip(seqs, prompts):
        assert s.output_ids == reference(tuple(p))
    assert seen == [(1, 1), (3, 4), (3, 4), (4, 4), (3, 4), (1, 1), (1, 1)], seen
    assert not prefill_rows  # no prefill chunk here is exactly one hash block (see the test below)
    assert graphs.steps == len(seen) and graphs.padded_rows == 3 and graphs.replays == 0
    assert sorted(graphs._static) == [(1, 1), (4, 1)]
    assert len(splits) == 2 * len(seen) and set(splits) == {b.num_splits for b in graphs._static.values()} == {8}


def test_hash_block_prefill_chunks_run_on_the_static_buffers(static_mode, decode_kernel):
    # A prompt whose prefix is cached up to a hash boundary leaves a tail of exactly one hash block: that chunk
    # runs on the static buffers (every query its own row of the paged decode kernel, causal by its position),
    # and the outputs stay those of the cache-free reference.
    eng = _engine()
    graphs = eng.runner.graphs
    assert graphs.prefill_lengths == (HB,)
    calls = []
    orig = graphs.run
    graphs.run = lambda tokens, starts, slots: calls.append((len(tokens), len(tokens[0]))) or orig(tokens, starts,
                                                                                               slots)
    base = _prompts((5 * HB,), seed=11)[0]
    eng.generate([base[: 4 * HB] + [7]], GREEDY)  # caches the first four hash blocks
    seqs = [eng.add_request(base, GREEDY)]
    while eng.has_work():
        eng.step()
        eng.cache.prefix.check_invariants()
    assert seqs[0].cached_tokens == 4 * HB
    assert seqs[0].output_ids == reference(tuple(base))
    assert (1, HB) in calls and (1, HB) in graphs._static


@pytest.mark.parametrize("T", [1, HB], ids=["decode", "hash-block-prefill"])
def test_static_step_equals_the_eager_step_and_writes_only_its_pages(static_mode, T):
    # At the runner: three requests (prefilled eagerly) take one step of T new tokens each (a decode step, or a
    # hash-block prefill chunk) on the static buffers (bucket 4) and on the eager runner. Same logits; the static
    # step changed the requests' own pages and the scratch page only.
    prompts = _prompts((30, 47, 95), seed=7)
    runs = []
    for static in (True, False):
        eng = _engine() if static else _engine(cuda_graphs=False)
        assert (eng.runner.graphs is not None) == static
        seqs = [eng.add_request(p, GREEDY) for p in prompts]
        for s in seqs:
            assert eng.cache.admit(s) is not None and eng.cache.grow(s, len(s.prompt_ids) + 1)
        slots = [eng.cache.slots(s) for s in seqs]
        for p, sl in zip(prompts, slots):
            forward(eng, [p[:-T]], [0], [sl])  # prefill of the rest (never HB tokens: eager)
        before = eng.cache.pool.pages.clone()
        out = forward(eng, [p[-T:] for p in prompts], [len(p) - T for p in prompts], slots)
        changed = set(torch.nonzero((eng.cache.pool.pages != before).any(1)).flatten().tolist())
        mine = {pg for sl in slots for pg in sl.kda_pages} | {pg for sl in slots for t in sl.mla_tables for pg in t}
        runs.append((out, changed, mine, eng))
    (out_s, changed_s, mine_s, eng_s), (out_e, changed_e, mine_e, _) = runs
    assert eng_s.runner.graphs.steps == 1 and eng_s.runner.graphs.padded_rows == 1
    assert rel_err(out_s, out_e) < 1e-5
    scratch = eng_s.runner.graphs.scratch
    assert scratch in changed_s and changed_s - {scratch} <= mine_s
    assert changed_e <= mine_e


def test_batches_beyond_the_largest_bucket_or_table_run_eagerly(static_mode):
    eng = _engine(max_num_seqs=2, max_model_len=96)  # buckets 1, 2; block tables of at most 2 pages
    graphs = eng.runner.graphs
    assert graphs.buckets == [1, 2] and graphs.max_pages == 2
    assert graphs.run([[1]] * 3, [0, 0, 0], [None] * 3) is None
    assert graphs.run([[1]], [0], [SeqSlots([[0, 1, 2]] * 2, [3, 4, 5])]) is None  # a table of 3 pages
    assert graphs.run([[1] * 5], [0], [None]) is None  # a 5-token chunk: not a hash block
    big = DecodeGraphs(eng.runner, 2, 96, graphs.scratch, capture=False, prefill_lengths=(4096,))
    assert big.run([[1] * 4096] * 2, [0, 0], [None] * 2) is None  # 2 x 4096 tokens: too large for a graph
    from k3.serve import cuda_graphs

    assert big.run([[1] * 4096], [cuda_graphs.MAX_PREFILL_GRAPH_CONTEXT], [None]) is None  # too long a context
    assert graphs.steps == 0
    prompts = _prompts((40, 44))
    _serve_to_the_reference(eng, prompts)
    assert graphs.steps > 0


def _notice_after(monkeypatch, capsys, **kw):
    monkeypatch.setattr(registry, "_notices", set())
    capsys.readouterr()
    eng = _engine(**kw)
    return eng, capsys.readouterr().err


def test_graphs_are_not_used_off_cuda_or_on_uncapturable_backends(monkeypatch, capsys, use_backends):
    use_backends(Backends(per_op=GRAPH_OPS))
    eng, err = _notice_after(monkeypatch, capsys, cuda_graphs=True)
    assert eng.runner.graphs is None and "without CUDA graphs" in err and "not a CUDA device" in err
    assert eng.cache.pool.num_pages == eng.cache.prefix.num_pages  # no scratch page

    # eager: past the device check, the backends decide
    use_backends(Backends(per_op={**GRAPH_OPS, "moe": "torch"}))
    eng, err = _notice_after(monkeypatch, capsys, cuda_graphs="eager")
    assert eng.runner.graphs is None and "MoE" in err and "K3_MOE_BACKEND=grouped" in err

    use_backends(Backends(per_op={**GRAPH_OPS, "mla_decode": "torch"}))
    eng, err = _notice_after(monkeypatch, capsys, cuda_graphs="eager")
    assert eng.runner.graphs is None and "MLA decode" in err and "K3_MLA_DECODE_BACKEND=triton" in err

    use_backends(Backends(per_op=GRAPH_OPS))
    eng, err = _notice_after(monkeypatch, capsys, cuda_graphs=False)  # off by configuration: nothing to explain
    assert eng.runner.graphs is None and err == ""
    with pytest.raises(ValueError, match="cuda_graphs='sometimes' is invalid"):
        _engine(cuda_graphs="sometimes")
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(eng.runner, 4, 512, scratch_page=0, capture=True)


def test_serve_flag_turns_graphs_off(monkeypatch):
    # The command line fills EngineConfig.cuda_graphs: --no-cuda-graphs, else K3_CUDA_GRAPHS (auto, off, eager),
    # on a CUDA device (pretended here: the choice is made before anything runs on it); a CPU asks for none.
    import k3.devices
    from k3 import cli
    from k3.serve import cli as serve_cli

    real_pick = k3.devices.pick_device
    monkeypatch.setattr(k3.devices, "pick_device", lambda d=None: torch.device("cuda"))
    monkeypatch.delenv("K3_CUDA_GRAPHS", raising=False)
    parse = cli.build_parser().parse_args
    args = parse(["serve", "--ckpt", "x"])
    assert args.cuda_graphs is True
    seen = []
    monkeypatch.setattr(serve_cli, "cmd_serve", lambda a: seen.append(a.cuda_graphs) or 0)
    assert args.fn(args) == 0 and seen == [True]
    args = parse(["serve", "--ckpt", "x", "--no-cuda-graphs"])
    assert args.fn(args) == 0 and seen[-1] is False
    for raw, want in (("off", False), ("eager", "eager"), ("auto", True)):
        monkeypatch.setenv("K3_CUDA_GRAPHS", raw)
        args = parse(["serve", "--ckpt", "x"])
        assert args.fn(args) == 0 and seen[-1] == want
    args = parse(["serve", "--ckpt", "x", "--no-cuda-graphs"])  # the flag wins
    assert args.fn(args) == 0 and seen[-1] is False
    monkeypatch.setenv("K3_CUDA_GRAPHS", "sometimes")
    args = parse(["serve", "--ckpt", "x"])
    with pytest.raises(ValueError, match="K3_CUDA_GRAPHS"):
        args.fn(args)
    monkeypatch.setattr(k3.devices, "pick_device", real_pick)
    monkeypatch.delenv("K3_CUDA_GRAPHS")
    args = parse(["serve", "--ckpt", "x", "--device", "cpu"])
    assert args.fn(args) == 0 and seen[-1] is False  # nothing to capture on a CPU


def test_serve_flag_compile_decode_reaches_the_engine(monkeypatch, tmp_path):
    serve_flag_reaches_the_engine(monkeypatch, tmp_path, "compile_decode", [([], False), (["--compile-decode"], True)])


def _fake_compile(monkeypatch, fail: bool = False):
    """torch.compile replaced by a wrapper that records each call's bucket (tokens per row) and calls the function
    uncompiled, or raises (fail) as a compile error would: the wiring of compile_decode without a compile's cost."""
    calls = []

    def fake(fn, **kw):
        assert kw.get("dynamic") is False  # one static-shape compile per bucket

        def compiled(b):
            calls.append(b.tokens)
            if fail:
                raise RuntimeError("backend compiler failed\nmore detail")
            return fn(b)
        return compiled

    monkeypatch.setattr(torch, "compile", fake)
    return calls


def test_compile_decode_compiles_the_decode_step_only(static_mode, monkeypatch, capsys):
    # Decode steps (T = 1) go through the compiled step; hash-block prefill chunks on the static buffers do not;
    # the outputs are the reference's.
    calls = _fake_compile(monkeypatch)
    monkeypatch.setattr(registry, "_notices", set())
    eng = _engine(compile_decode=True)
    graphs = eng.runner.graphs
    prompts = _prompts((44, 46, 10, 94))
    _serve_to_the_reference(eng, prompts)
    assert calls and set(calls) == {1} and len(calls) == graphs.steps
    # a prompt whose uncached tail is one hash block: that chunk runs on the static buffers, uncompiled
    base = _prompts((5 * HB,), seed=11)[0]
    eng.generate([base[: 4 * HB] + [7]], GREEDY)
    steps, n = graphs.steps, len(calls)
    out = eng.generate([base], GREEDY)
    assert out[0].output_ids == reference(tuple(base)) and (1, HB) in graphs._static
    assert graphs.steps - steps == len(calls) - n + 1  # every static step but the prefill chunk was compiled
    assert set(calls) == {1}
    assert graphs.compile_failed is None and "uncompiled" not in capsys.readouterr().err


def test_a_failed_decode_compile_runs_uncompiled_with_a_notice(static_mode, monkeypatch, capsys):
    calls = _fake_compile(monkeypatch, fail=True)
    monkeypatch.setattr(registry, "_notices", set())
    capsys.readouterr()
    eng = _engine(compile_decode=True)
    prompts = _prompts((44, 10))
    _serve_to_the_reference(eng, prompts)
    assert len(calls) == 1  # tried once, then dropped
    graphs = eng.runner.graphs
    # the first line and the last (a compile subprocess's cause) are kept
    assert graphs.compile_failed == "RuntimeError: backend compiler failed ... more detail" and graphs.steps > 1
    err = capsys.readouterr().err
    assert ("the decode step runs uncompiled from now on: torch.compile failed (RuntimeError: backend compiler "
            "failed ... more detail)") in err


def test_compile_decode_without_static_steps_says_it_has_no_effect(monkeypatch, capsys):
    eng, err = _notice_after(monkeypatch, capsys, cuda_graphs=False, compile_decode=True)
    assert eng.runner.graphs is None and "compile_decode has no effect" in err
    with pytest.raises(ValueError, match="compile_decode"):
        EngineConfig(compile_decode="yes").validate()



@pytest.mark.slow  # ~20 s on 2 cores (dynamo traces every layer of every bucket); the compiled step's other tests
# are slow too: `pytest -m slow tests/serve/test_cuda_graphs.py` runs the three
def test_compiled_decode_step_breaks_only_at_the_fast_implementations(static_mode, monkeypatch, capsys):
    # torch.compile traces the real decode step (Dynamo, with its eager backend: no code generation). The only graph
    # breaks are the calls of the fast implementations, which are opaque by design; no glue around them (the
    # stacked-projection check, the stacked experts' layout check, the registry's import check) breaks the graph.
    breaks, others = _compiled_graph_breaks(monkeypatch)
    assert breaks  # the opaque calls: the paged MLA decode, the grouped experts
    assert not others, others[:3]


def _compiled_graph_breaks(monkeypatch) -> tuple[list[str], list[str]]:
    """Serve two prompts to the reference with the decode step compiled (Dynamo with its eager backend: no code
    generation); (every graph break's reason, those not at an opaque call)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="eager", **kw))
    torch._dynamo.reset()
    counters.clear()
    try:
        eng = _engine(compile_decode=True)
        _serve_to_the_reference(eng, _prompts((44, 10)))
        assert eng.runner.graphs.compile_failed is None and eng.runner.graphs.steps > 1
        breaks = list(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    return breaks, [reason for reason in breaks if "torch.compiler.disable" not in reason]


def test_static_decode_steps_with_every_fused_decode_kernel_match_the_reference(static_mode, use_backends,
                                                                                interpreted_kernels):
    # The static-buffer step (as captured) with the fused decode kernels in Triton's interpreter, two requests in one
    # bucket: their page tables are columns of the bucket's buffers (strided views), which every kernel must read
    # through their strides (the fused KDA step once read them as contiguous: request 1 took another row's state)
    for per_op in ({"kda_decode": "triton"}, DECODE_KERNELS):
        use_backends(Backends(per_op={**GRAPH_OPS, **per_op}))
        _serve_to_the_reference(_engine(), _prompts((44, 10)))


@pytest.mark.slow  # about 22 s on 2 cores; its parts have faster tests: the compiled step's breaks (the test above
# with the fast implementations) and the fused kernels on the static step (test_static_decode_steps_with_every_...)
def test_compiled_decode_step_with_the_fused_decode_kernels(static_mode, use_backends, interpreted_kernels,
                                                            monkeypatch):
    # The decode step with every fused decode kernel (in Triton's interpreter) compiled: it still breaks only at the
    # fast implementations (the kernels' dispatch glue traces), and serves the reference's greedy tokens.
    use_backends(Backends(per_op={**GRAPH_OPS, **DECODE_KERNELS}))
    breaks, others = _compiled_graph_breaks(monkeypatch)
    assert breaks and not others, others[:3]


@pytest.mark.slow
def test_compiled_decode_step_compiles_every_layer_in_every_bucket(static_mode, monkeypatch):
    # The graph breaks at each opaque kernel, so the code after it is compiled once per layer (its layer index and
    # AttnRes block count are static) and per bucket: past dynamo's recompile limit the later layers of the larger
    # buckets ran uncompiled (k3-mini on an H200 at batch 16 and 64). The engine raises the limits to what its
    # buckets and layers need; here dynamo starts from a limit of 1 and fails hard if any limit is hit.
    import torch._dynamo

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend="eager", **kw))
    torch._dynamo.reset()
    # dynamo's own patch, which restores the settings afterwards (a monkeypatch of its config module is undone by
    # deleting the attribute on newer pytest, which hides the setting from every later reader)
    with torch._dynamo.config.patch(recompile_limit=1, accumulated_recompile_limit=1, fail_on_recompile_limit_hit=True):
        eng = _engine(compile_decode=True)
        graphs = eng.runner.graphs
        assert len(graphs.buckets) > 1
        _serve_to_the_reference(eng, _prompts((44, 46, 10, 94)))  # decode steps in several buckets
        assert graphs.compile_failed is None, graphs.compile_failed
        assert len({b.size for b in graphs._static.values() if b.tokens == 1}) > 1
    torch._dynamo.reset()


_VIEWS = {"getitem", "view", "reshape", "narrow", "select", "permute", "transpose", "t", "unsqueeze", "squeeze",
          "expand", "as_strided", "flatten", "unflatten"}


def _pool_mutations(pages: torch.Tensor, found: list):
    """A torch.compile backend (runs each graph eagerly) that appends to `found` every in-place operation a graph
    applies to the pool's tensor or to a view of it, and every reinterpretation of such a view as another dtype
    (Inductor materializes one of a strided view: a copy of the pool)."""
    import operator

    def backend(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        derived = {n for n, x in zip(placeholders, example_inputs)
                   if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == pages.untyped_storage().data_ptr()}
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method") or not node.args or node.args[0] not in derived:
                continue
            name = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
            if node.target is operator.setitem or (name.endswith("_") and not name.startswith("_")):
                found.append(name)
            elif name == "view" and any(isinstance(a, torch.dtype) for a in node.args[1:]):
                found.append("view as another dtype")
            elif name in _VIEWS:
                derived.add(node)  # a view of the pool (a read such as index_select makes a copy of its own)
        return gm.forward
    return backend


@pytest.mark.slow
def test_compiled_decode_step_leaves_the_pool_writes_outside(static_mode, monkeypatch):
    # Traced, an in-place write into a view of the pool's bytes is functionalized into a copy of the whole pool per
    # write (the compiled step ran 14x slower than the uncompiled one on an H200, 35x on this CPU), and a strided view
    # of them reinterpreted as another dtype is materialized: the pool's writes and its typed MLA view are made
    # outside the compiled region, and no compiled graph writes into the pool or reinterprets it.
    import torch._dynamo

    found: list = []
    eng = _engine(compile_decode=True)
    graphs = eng.runner.graphs
    torch._dynamo.reset()
    graphs._compiled = torch.compile(graphs._step, backend=_pool_mutations(eng.cache.pool.pages, found),
                                     dynamic=False)  # the step compiled as the engine does, graphs inspected
    _serve_to_the_reference(eng, _prompts((44, 10)))
    assert eng.runner.graphs.compile_failed is None and eng.runner.graphs.steps > 1
    assert not found, found
    torch._dynamo.reset()

def _one_decode_step(eng, prompts):
    """At the runner: every prompt but its last token prefilled, then one decode step of those last tokens (a
    batch of len(prompts)) -> its logits."""
    seqs = [eng.add_request(p, GREEDY) for p in prompts]
    for s in seqs:
        assert eng.cache.admit(s) is not None and eng.cache.grow(s, len(s.prompt_ids) + 1)
    slots = [eng.cache.slots(s) for s in seqs]
    for p, sl in zip(prompts, slots):
        forward(eng, [p[:-1]], [0], [sl])
    return forward(eng, [p[-1:] for p in prompts], [len(p) - 1 for p in prompts], slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_decode_equals_the_eager_engine():
    # The same requests on a bf16 model on the GPU through captured graphs and through the eager runner: the same
    # greedy outputs; the graphs were captured (buckets 1 and 4) and replayed. Then at the runner, one replay equals
    # the same static-buffer step called without capture.
    model = copy.deepcopy(_model()).cuda().set_dtype(torch.bfloat16).set_backends(Backends(per_op=GRAPH_OPS))
    prompts = _prompts((44, 46, 10, 94))
    outputs = []
    for graphs_on in (True, False):
        eng = _engine(model, cuda_graphs=graphs_on)
        assert (eng.runner.graphs is not None) == graphs_on
        seqs = [eng.add_request(p, GREEDY) for p in prompts]
        while eng.has_work():
            eng.step()
        outputs.append([s.output_ids for s in seqs])
        if graphs_on:
            graphs = eng.runner.graphs
            assert graphs.disabled is None, graphs.disabled
            assert graphs.replays == graphs.steps > 0 and sorted(graphs._static) == [(1, 1), (4, 1)]
            assert all(b.graph is not None for b in graphs._static.values())
    assert outputs[0] == outputs[1]

    # Replay vs the uncaptured step on identical inputs (three requests in bucket 4).
    results = []
    for capture in (True, False):
        eng = _engine(model)
        if not capture:
            eng.runner.graphs = DecodeGraphs(eng.runner, 4, eng.max_model_len, eng.runner.graphs.scratch, capture=False)
        out = _one_decode_step(eng, prompts[:3])
        assert eng.runner.graphs.replays == int(capture)
        results.append(out)
    assert rel_err(results[0], results[1]) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_decode_with_the_fused_decode_kernels_equals_the_composed_step():
    # Every fused decode-step kernel on (the fused AttnRes sites, the MLA append, absorption and gate, the MoE GEMV,
    # the fused KDA step and router) against the composed ops, one captured decode step of three requests on a bf16
    # model: both capture (nothing inside reads back), and the logits agree to bf16 noise (2e-2 of the largest, as
    # the compiled step's test: the kernels round where the composed ops round, summing in another order).
    model = copy.deepcopy(_model()).cuda().set_dtype(torch.bfloat16)
    prompts = _prompts((44, 46, 10))
    results = []
    for per_op in ({**GRAPH_OPS, **DECODE_KERNELS}, GRAPH_OPS):
        model.set_backends(Backends(per_op=per_op))
        eng = _engine(model)
        results.append(_one_decode_step(eng, prompts))
        graphs = eng.runner.graphs
        assert graphs.disabled is None and graphs.replays == 1, graphs.disabled
    assert rel_err(results[0], results[1]) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kda_backend", ["torch", "fla"])
def test_gpu_captured_hash_block_prefill_equals_the_eager_engine(kda_backend):
    # Hash-block prefill chunks are captured too (KDA on fla, or on the reference, whose chunk reads nothing back
    # for rows of one length): a prompt with a cached prefix and a one-hash-block tail gives the same greedy
    # output through the captured prefill graph as through the eager engine.
    if kda_backend == "fla" and not registry.importable("fla.ops.kda")[0]:
        pytest.skip("needs fla-core")
    model = copy.deepcopy(_model()).cuda().set_dtype(torch.bfloat16)
    model.set_backends(Backends(per_op={**GRAPH_OPS, "kda": kda_backend}))
    base = _prompts((5 * HB,), seed=11)[0]
    outputs = []
    for graphs_on in (True, False):
        eng = _engine(model, cuda_graphs=graphs_on)
        eng.generate([base[: 4 * HB] + [7]], GREEDY)
        seq = eng.generate([base], GREEDY)[0]
        assert seq.cached_tokens == 4 * HB
        outputs.append(seq.output_ids)
        if graphs_on:
            graphs = eng.runner.graphs
            assert graphs.prefill_lengths == (HB,) and graphs._static[(1, HB)].graph is not None
    assert outputs[0] == outputs[1]


def test_warm_up_sets_up_every_bucket_at_once(static_mode):
    eng = _engine(max_num_seqs=4)
    graphs = eng.runner.graphs
    assert graphs._static == {}
    n = graphs.warm_up()
    want = {(s, 1) for s in graphs.buckets} | {(s, HB) for s in graphs.buckets}
    assert set(graphs._static) == want and n == len(want)
    prompts = _prompts((44, 10))
    seqs = [eng.add_request(p, GREEDY) for p in prompts]
    while eng.has_work():
        eng.step()
    assert [s.output_ids for s in seqs] == [reference(tuple(p)) for p in prompts]
    assert set(graphs._static) == want  # nothing new was set up while serving


def test_warm_up_captures_without_gradients(static_mode, monkeypatch):
    # a capture runs the step; with gradients enabled (a caller outside no_grad: k3 serve's startup, a benchmark)
    # the first inference-only kernel refuses, and the engine then served every step eagerly on a GPU
    eng = _engine(max_num_seqs=2)
    graphs = eng.runner.graphs
    seen = []
    monkeypatch.setattr(graphs, "capture", True)
    monkeypatch.setattr(type(graphs), "_capture", lambda self, b, verify=False: seen.append(torch.is_grad_enabled()))
    assert torch.is_grad_enabled()
    assert graphs.warm_up() == len(seen) > 0 and not any(seen) and graphs.disabled is None
    graphs._static.clear()
    seen.clear()
    assert eng.warm_up()["graphs"] == len(seen) > 0 and not any(seen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_captured_decode_equals_the_uncompiled_one():
    # compile_decode on a bf16 model on the GPU: one step's logits agree with the uncompiled step's to bf16 noise
    # (Inductor fuses the elementwise work, so roundings between fused ops are skipped: 2e-2 relative to the largest
    # logit). The compiled step, captured and replayed, gives the uncompiled captured step's greedy outputs up to the
    # first position (if any) where the uncompiled run's best two tokens lie within that noise of each other: there
    # rounding may pick either, and after it the two runs continue from different tokens.
    model = copy.deepcopy(_model()).cuda().set_dtype(torch.bfloat16).set_backends(Backends(per_op=GRAPH_OPS))
    prompts = _prompts((44, 46, 10, 94))
    with_top2 = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0, logprobs=2)
    runs, logits = [], []
    for compiled in (True, False):
        eng = _engine(model, compile_decode=compiled)
        seqs = [eng.add_request(p, with_top2) for p in prompts]
        while eng.has_work():
            eng.step()
        runs.append([(s.output_ids, s.logprobs) for s in seqs])
        graphs = eng.runner.graphs
        assert graphs.disabled is None and graphs.compile_failed is None, (graphs.disabled, graphs.compile_failed)
        assert graphs.replays == graphs.steps > 0

        eng = _engine(model, compile_decode=compiled)
        logits.append(_one_decode_step(eng, prompts[:3]))
    tol = 2e-2
    assert rel_err(logits[0], logits[1]) < tol
    # two logits each moved by at most the bound can swap only if they were closer than twice the bound
    near_tie = 2 * tol * float(logits[1].float().abs().max())
    for (ids, _), (ref_ids, ref_lp) in zip(*runs):
        n = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), len(ref_ids))
        if n < len(ref_ids):
            (_, first), (_, second) = ref_lp[n]["top"]
            print(f"diverged at output {n}: best two {first - second:.4g} apart (near tie below {near_tie:.4g})")
            assert first - second < near_tie, (n, ids, ref_ids, first - second, near_tie)
