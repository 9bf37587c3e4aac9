"""Shared test helpers."""

import contextlib

import torch


def randomize_(model, seed: int = 0, scale: float = 1.0):
    """Random init plus non-zero AttnRes pseudo-queries and router biases, so every mechanism is exercised."""
    from k3.model.model import K3ForCausalLM

    model.init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            elif name.endswith("A_log"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    assert isinstance(model, K3ForCausalLM)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def bf16_loss_and_grads(model, ids, segment_ids=None, mtp_weight: float = 0.3, cu_seqlens_cpu=None):
    """One training forward + backward under bf16 autocast on the model's device: (loss, {name: fp64 flat grad}).
    `cu_seqlens_cpu`: the documents' offsets from the host, as the trainer puts them in the batch record."""
    from k3.model.batch import BatchInfo

    batch = None if segment_ids is None else BatchInfo.from_segment_ids(segment_ids, cu_seqlens_cpu=cu_seqlens_cpu)
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        out = model(ids, labels=ids, batch=batch)
    (out.loss + (mtp_weight * out.mtp_loss if out.mtp_loss is not None else 0)).backward()
    grads = {n: p.grad.detach().double().flatten() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def grad_disagreement(g: dict, g_ref: dict, min_numel: int = 64):
    """How far two gradient sets are apart: (L2 error of all of them together relative to the reference,
    [(cosine, name)] of each tensor of >= min_numel entries, worst first). Few-entry tensors (A_log, ...) are
    left to the global bound: their cosine is fragile."""
    assert g.keys() == g_ref.keys()
    flat = torch.cat([g[n].double().flatten() for n in g_ref])
    flat_ref = torch.cat([t.double().flatten() for t in g_ref.values()])
    cosine = torch.nn.functional.cosine_similarity
    cos = sorted((float(cosine(g[n].double().flatten(), g_ref[n].double().flatten(), dim=0)), n)
                 for n in g_ref if g_ref[n].numel() >= min_numel)
    return float((flat - flat_ref).norm() / flat_ref.norm()), cos


_UNSET = object()


class InSituComparison:
    """Compare fast backends with the reference *inside* a model, at every call of the patched methods.

    A whole-model comparison of gradients is dominated by how much the model amplifies rounding: k3-mini with
    randomized AttnRes pseudo-queries turns a 0.4% (L2) perturbation of the first KDA layer's output into ~2% at the
    next KDA layer's input and ~80% eight KDA layers later (bf16 autocast, routing pinned or not), so no tolerance
    separates a correct kernel from a wrong one there. Instead, each call of a patched method (a layer or site that
    contains a backend choice) is run twice more on detached copies of its inputs: once with the reference ops
    (`ref`, a k3.ops.registry.Backends: every op on its reference by default), once with `fast` (a Backends); their
    outputs, and the gradients for a fixed random output gradient with respect
    to every floating input and the module's parameters, are compared. The call itself then runs on the reference
    ops, so every site sees exactly the inputs of the reference model (teacher forcing) and the comparison tests
    the backend with the shapes, dtypes, layouts, packing and autocast state the model really gives it.

    `records`: one (site, {quantity: relative error}) per call; relative error = max |fast - ref| / max |ref|.
    """

    def __init__(self, fast, ref=None, seed: int = 0):
        from k3.ops.registry import Backends

        self.ref = Backends(default="torch") if ref is None else ref
        self.fast = fast
        self.seed, self.records = seed, []

    @staticmethod
    def _using(obj, backends):
        """A context in which `obj` (a module: and all its submodules; or a plain object such as the AttnRes stream)
        holds `backends` (the previous values restored after)."""
        import contextlib

        @contextlib.contextmanager
        def cm():
            holders = list(obj.modules()) if isinstance(obj, torch.nn.Module) else [obj]
            before = [h.__dict__.get("backends", _UNSET) for h in holders]
            for h in holders:
                h.backends = backends
            try:
                yield
            finally:
                for h, b in zip(holders, before):
                    if b is _UNSET:
                        del h.backends
                    else:
                        h.backends = b

        return cm()

    @staticmethod
    def _leafify(x, leaves: list):
        """x with every floating tensor replaced by a detached leaf that requires grad (appended to `leaves`)."""
        if torch.is_tensor(x):
            if not x.is_floating_point():
                return x
            t = x.detach().clone().requires_grad_()
            leaves.append(t)
            return t
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # NamedTuple (e.g. Routing)
            return type(x)(*(InSituComparison._leafify(v, leaves) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(InSituComparison._leafify(v, leaves) for v in x)
        if isinstance(x, dict):
            return {k: InSituComparison._leafify(v, leaves) for k, v in x.items()}
        return x

    @staticmethod
    def _tensors(x) -> list:
        if torch.is_tensor(x):
            return [x] if x.is_floating_point() else []
        if isinstance(x, (list, tuple)):
            return [t for v in x for t in InSituComparison._tensors(v)]
        return []

    def _run(self, fn, obj, args, kwargs, backends):
        import copy

        leaves: list = []
        if isinstance(obj, torch.nn.Module):
            named = [(n, p) for n, p in obj.named_parameters() if p.requires_grad]
            this, params = obj, [p for _, p in named]
        else:  # a plain object whose tensor attributes are inputs (e.g. the AttnRes stream's blocks)
            this, params = copy.copy(obj), []
            for k, v in vars(obj).items():
                setattr(this, k, self._leafify(v, leaves))
        a, kw = self._leafify(args, leaves), self._leafify(kwargs, leaves)
        with self._using(this, backends):
            out = self._tensors(fn(this, *a, **kw))
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        cot = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in out]
        targets = leaves + params
        grads = torch.autograd.grad(out, targets, cot, allow_unused=True)
        grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(targets, grads)]
        names = [f"d_input{i}" for i in range(len(leaves))]
        names += [f"d_{n}" for n, _ in named] if isinstance(obj, torch.nn.Module) else []
        return [o.detach() for o in out], dict(zip(names, (gr.detach() for gr in grads)))

    def _wrap(self, cls, name: str):
        fn = getattr(cls, name)
        site = f"{cls.__name__}.{name}"

        def wrapper(obj, *args, **kwargs):
            if torch.is_grad_enabled():
                out_r, g_r = self._run(fn, obj, args, kwargs, self.ref)
                out_f, g_f = self._run(fn, obj, args, kwargs, self.fast)
                errs = {f"output{i}": rel_err(f, r) for i, (f, r) in enumerate(zip(out_f, out_r))}
                errs.update({n: rel_err(g_f[n], g_r[n]) for n in g_r})
                self.records.append((site, errs))
            with self._using(obj, self.ref):
                return fn(obj, *args, **kwargs)

        return wrapper

    def patch(self, monkeypatch, sites) -> "InSituComparison":
        """Wrap each (class, method name) of `sites`."""
        for cls, name in sites:
            monkeypatch.setattr(cls, name, self._wrap(cls, name))
        return self

    def worst(self, n: int = 5) -> list:
        """The n largest errors as (error, site, quantity, call index)."""
        rows = [(e, site, q, i) for i, (site, errs) in enumerate(self.records) for q, e in errs.items()]
        return sorted(rows, key=lambda r: -r[0])[:n]


def uvicorn_in_thread(app, host: str = "127.0.0.1"):
    """Serve `app` on a free port of `host` in a daemon thread (k3.serve.local.serve_in_thread); yields the port."""
    from k3.serve.local import serve_in_thread

    return serve_in_thread(app, host)


def stop_after(trainer, step: int):
    """Make `trainer` stop after `step` as a Ctrl-C there would (finish the step, save, return); returns it."""
    orig = trainer.train_step

    def step_then_stop():
        m = orig()
        trainer._stop_requested = trainer.step == step
        return m

    trainer.train_step = step_then_stop
    return trainer


def load_benchmark(name: str):
    """The module benchmarks/<name>.py (the benchmarks are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def strong_kda_layer():
    """(a KDA layer of the tiny config, the config) with random weights whose decays and writes are strong enough
    that a wrong replay length or a lost position shows in the state (the replay tests')."""
    from k3.config import K3Config
    from k3.model.kda import KimiDeltaAttention

    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0)
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg, layer_idx=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() < 2 else p.shape[-1] ** -0.5))
    return layer.eval(), cfg


def tiny_chat_checkpoint(ckpt):
    """`k3 init` a random tiny checkpoint with the byte tokenizer at `ckpt`, save the default chat template beside
    it, and load it; returns (model, tokenizer). The servers of the serving and environment tests start from it."""
    from k3.checkpoint import from_pretrained
    from k3.cli import main
    from k3.data.tokenizer import load_any_tokenizer
    from k3.serve.chat import save_chat_template

    assert main(["init", "--preset", "tiny", "--tokenizer", "bytes", "--out", str(ckpt)]) == 0
    save_chat_template(ckpt)
    return from_pretrained(ckpt), load_any_tokenizer(ckpt)


@contextlib.contextmanager
def one_torch_thread():
    """Torch on one intra-op thread inside the block (tiny matrices gain nothing from a thread pool, and on a busy
    2-core machine one stalls them), the previous count restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# every fused decode-step kernel, on: the per_op entries of a Backends (tests of the static and captured steps)
DECODE_KERNELS = {"attn_res_norm": "triton", "mla_append": "triton", "mla_absorb_v": "triton", "mla_gate": "triton",
                  "moe_gemv": "triton", "moe_combine_norm": "triton", "rms_norm_pair": "triton", "kda_decode": "triton",
                  "kda_decode_decay_proj": "triton", "moe_route": "triton", "moe_route_round": "triton",
                  "moe_out": "triton", "mla_combine_absorb_v": "triton", "moe_combine_norm_out": "triton"}


def count_fast_calls(monkeypatch, *ops: str) -> list[str]:
    """The registered fast implementation of each op in `ops` wrapped (for the test, by `monkeypatch`) to record the
    op's name at every call: returns the list the calls append to."""
    import dataclasses

    from k3.ops import registry

    calls: list[str] = []
    for name in ops:
        op = registry.ops()[name]

        def counted(*a, _fn=op.fast[0].fn, _name=name, **k):
            calls.append(_name)
            return _fn(*a, **k)

        monkeypatch.setitem(registry._ops, name,
                            dataclasses.replace(op, fast=(dataclasses.replace(op.fast[0], fn=counted),)))
    return calls


def tiny_engine_runs(backends_list, max_tokens: int, after=None) -> list[list[tuple[list[int], list[float]]]]:
    """Greedy generations with log-probs of a tiny model (seed 3, a 256-token vocabulary, no MTP layer) in the serving
    engine, two prompts of 9 and 20 tokens, once per Backends in `backends_list`: per run, (output ids, log-probs) per
    request. `after(backends)`, when given, is called after each run (to check what ran)."""
    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vocab_size=256)
    model = K3ForCausalLM(cfg).init_weights(seed=3).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (9, 20)]
    runs = []
    for backends in backends_list:
        model.set_backends(backends)
        eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=4.0, page_tokens=32, hash_block_tokens=16))
        eng.eos_id = None
        seqs = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0)) for p in prompts]
        while eng.has_work():
            eng.step()
        runs.append([(s.output_ids, [e["logprob"] for e in s.logprobs]) for s in seqs])
        if after is not None:
            after(backends)
    return runs


def assert_same_greedy(runs, logprob_tol: float) -> None:
    """Two runs of `tiny_engine_runs`: the same tokens, log-probs within `logprob_tol`."""
    for (ids_a, lp_a), (ids_b, lp_b) in zip(*runs):
        assert ids_a == ids_b
        assert max(abs(a - b) for a, b in zip(lp_a, lp_b)) <= logprob_tol


def serve_flag_reaches_the_engine(monkeypatch, tmp_path, key: str, cases) -> None:
    """`k3 serve` hands a flag to the engine's builder: for each (extra argv, value) of `cases`, `cmd_serve` on a
    checkpoint directory in tmp_path passes build_engine `key`=value (a fake builder that stops before loading)."""
    from k3 import cli
    from k3.serve import cli as serve_cli

    (tmp_path / "config.json").write_text("{}")  # a checkpoint directory, as --ckpt's resolver wants one
    seen = []

    def fake_build(*a, **kw):
        seen.append(kw[key])
        raise ValueError("stop before loading")

    monkeypatch.setattr(serve_cli, "build_engine", fake_build)
    parse = cli.build_parser().parse_args
    for extra, want in cases:
        assert serve_cli.cmd_serve(parse(["serve", "--ckpt", str(tmp_path), *extra])) == 2
        assert seen[-1] is want, (key, extra, seen[-1], want)
