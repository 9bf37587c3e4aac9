"""CUDA graphs for the serving engine's decode steps.

A decode step of B requests (one new token each) is hundreds of small kernel launches from Python per step; at
small batch the GPU mostly waits for them. `DecodeGraphs` records the whole step once per batch bucket and
replays it. Per bucket of Bb rows it holds static device buffers

    ids [Bb, 1]                          the new tokens
    positions [Bb]                       each new token's position (the MLA lengths are positions + 1)
    kda_pages [Bb, n_kda]                each KDA layer's running-state page
    tables [Bb, n_mla, max_pages]        each MLA layer's block table (max_pages: pages of max_model_len)

and one captured step: zero the scratch page -> read the KDA states of `kda_pages` -> the model forward with
cache views over the buffers (k3.serve.pool_forward.run_on_pool, the same code the eager runner runs; MLA through the
paged decode kernel, k3.ops.mla_decode, with a split count fixed per bucket from max_model_len, so nothing is
read back from the device) -> write the new KDA states back -> logits [Bb, V] fp32.

A step copies its inputs into the buffers of the smallest bucket that holds it, replays, and returns the first
B rows of the logits (a copy: the next replay overwrites them). Buckets are 1, 2, 4, ... and max_batch. A
bucket is captured on its first use, after two warm-up runs on a side stream (which also compile and tune the
Triton kernels); all buckets share one graph memory pool (replays never overlap, and the outputs are copied out
right away).

Padding rows (a bucket larger than the batch) get token 0 at position 0 with every KDA page and block-table
entry pointing at one scratch page of the pool that no request ever gets (the engine keeps it out of the prefix
cache's allocator), so they read and write only that page. The step zeroes it first, so padding rows always
compute on a zero state (finite, and the same every step). Table entries past a request's own pages keep
whatever an earlier step left there: the kernel reads only entries below the request's length.

When: the model is on a CUDA device and, under the model's Backends, the MLA decode runs on the paged kernel (op
`mla_decode` on triton: the reference gathers each request's pages to its length, read back from the device) and
the MoE on the grouped GEMMs (op `moe` on grouped: the reference expert loop reads the expert counts back).
Otherwise the runner stays eager and a notice says why. Prefill chunks other than those below, packed forwards,
batches larger than max_batch and block tables longer than max_pages always run eagerly.

Prefill chunks of exactly one hash block (`prefill_lengths`; the uncached tail of a prompt whose prefix was a
hit) run the same way in buckets of their own, of at most MAX_PREFILL_GRAPH_TOKENS tokens a step and contexts of
at most MAX_PREFILL_GRAPH_CONTEXT tokens: ids [Bb, T], every new row written to the pages first, then each query
as its own row of the paged decode kernel with length position + 1 (causal). That makes a cached prompt's time to
first token one graph replay instead of an eager forward. KDA runs there on fla or on the reference, whose chunked
form reads nothing back for rows of one length; a capture that fails turns off prefill graphs only.

With a speculative draft (k3.serve.speculative), every step also outputs the hidden states the draft observes
(`keep_hidden`), and verifications of T = 2 .. K + 1 positions per request run the same way in buckets of their own
(`verify_lengths`, `run_verify`; k3.serve.pool_forward.verify_on_pool): the KDA layers keep their projected inputs
(the states in the pages are not advanced; k3.serve.runner.ModelRunner.replay commits the accepted prefix after),
the MLA rows of every position are written, and the logits of all T positions come out; the kept inputs of every KDA
layer come out side by side in one tensor (k3.serve.cache.views.flat_inputs: one copy per step, and one per request
where a fused verification reads them back as pending positions). A verification capture that fails turns off
verification graphs only.

With fused replay (k3.serve.runner, EngineConfig.fused_replay; `fused_replay`, the runner's by default) the
verification step runs k3.serve.pool_forward.verify_replay_on_pool instead: each request's pending accepted positions
(a previous verification's, not yet in its KDA states) are replayed in the same pass as its window. Its bucket also
holds, per KDA layer, the pending inputs [Bb, P, ...] (a KDAInputs; P the longest verification's positions, the most
one can leave pending, so a shorter window after a long acceptance, as near max_tokens, stays on the buffers) and one
count buffer pending_lengths [Bb] (0 for padding rows and rows with nothing pending), which the op reads on the
device; the runner's inputs are copied into them before each replay. Inside the step every row
writes its state after the pending positions back into its pages (a row with nothing pending its committed state,
unchanged; a padding row only the scratch page).

`EngineConfig.compile_decode` (default off): the decode step (T = 1) is compiled with torch.compile (static shapes,
one compile per bucket, done in the warm-up runs before capture) so that Inductor fuses its elementwise work (norms,
gates, casts, residual sums) into fewer kernels; the graph then captures the compiled step. Prefill and verification
steps stay uncompiled. A compile that fails turns it off with a notice, and the step runs uncompiled.

`EngineConfig.cuda_graphs` (the command line fills it from --no-cuda-graphs and K3_CUDA_GRAPHS): True (default:
capture when the conditions hold), False (off), or "eager" (the static-buffer step called directly, without
capture, on any device: the same buffers, padding and scratch page; for tests and debugging).
"""

from __future__ import annotations

import time

import torch

from k3.model.mx_experts import PackedMXExperts
from k3.ops.mla_decode import default_num_splits, paged_kernel_used
from k3.ops.moe import grouped_used
from k3.ops.registry import Target, notice, opaque_under_compile, runs_on
from k3.model.cache import KDAInputs
from k3.serve.cache.views import KeptInputsView, StaticMLAView, flat_inputs, inputs_of, kept_width
from k3.serve.pool_forward import run_on_pool, verify_on_pool, verify_replay_on_pool
from k3.tensors import to_device_async

MAX_PREFILL_GRAPH_TOKENS = 4096  # prefill steps on static buffers: at most this many tokens (bucket x length)
# ... and contexts up to this long: every query row of such a step reads its request's whole latent cache, which
# stays cheap while one layer's cache fits in the GPU's L2 (32K tokens of k3-mini: 21 MB); longer runs eagerly.
MAX_PREFILL_GRAPH_CONTEXT = 32768


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph: powers of two below max_batch, then max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def _expert_input_dtype(model, moe) -> torch.dtype:
    """The dtype the routed experts read: the latent's (W_down's output), or the hidden states' without the latent
    (the standard-MoE ablation)."""
    return (moe.routed_expert_down_proj if moe.latent else model.model.embed_tokens).weight.dtype


def decode_graphs_support(model, need_cuda: bool = True) -> tuple[bool, str]:
    """(True, "") when a decode step of `model` can be captured, else (False, why not). The model's Backends
    decide which implementations its ops run (the registry is asked; nothing runs)."""
    from k3.model.latent_moe import LatentMoE

    device = next(model.parameters()).device
    if need_cuda and device.type != "cuda":
        return False, f"the model is on {device}, not a CUDA device"
    layers = model.model.layers
    if any(not l.is_kda for l in layers) and not paged_kernel_used(device, model.backends):
        return False, ("the MLA decode runs on the PyTorch reference (op mla_decode on torch), which reads the "
                       "lengths back; the paged decode kernel can be captured (mla_decode=triton: "
                       "K3_MLA_DECODE_BACKEND=triton for `k3 serve`)")
    moe = [l.ffn for l in layers if isinstance(l.ffn, LatentMoE)]
    if moe and isinstance(moe[0].experts, PackedMXExperts):
        dtype = _expert_input_dtype(model, moe[0])
        if not any(runs_on("mx_moe", name, Target(device, dtype), model.backends)
                   for name in ("triton", "triton_grouped")):  # both size their grids without a read-back
            return False, ("the packed MXFP4 experts run on the PyTorch reference (op mx_moe on torch), which reads "
                           "the expert counts back; the Triton kernels can be captured (mx_moe=triton or "
                           "triton_grouped: K3_MX_MOE_BACKEND=triton_grouped for `k3 serve`)")
    elif moe:
        dtype = _expert_input_dtype(model, moe[0])
        if not grouped_used(device, dtype, model.backends):
            return False, ("the MoE runs on the reference expert loop (op moe on torch), which reads the expert "
                           "counts back; the grouped GEMMs can be captured (moe=grouped: K3_MOE_BACKEND=grouped "
                           "for `k3 serve`)")
    return True, ""


def decode_graphs_mode(model, mode: bool | str = True) -> str | None:
    """How the engine runs batched decode steps for `mode` (EngineConfig.cuda_graphs): "capture" (CUDA graphs),
    "eager" (the static-buffer step without capture) or None (the plain eager runner; when graphs were asked for
    but cannot be used, a one-time notice says why)."""
    if mode is False:
        return None
    ok, why = decode_graphs_support(model, need_cuda=mode is True)
    if not ok:
        notice(f"decode steps run without CUDA graphs: {why}")
        return None
    return "capture" if mode is True else "eager"


def prefill_graph_lengths(model, mode: str, hash_block_tokens: int) -> tuple[int, ...]:
    """Prefill chunk lengths that run on static buffers besides decode steps: the hash block (the uncached tail
    of a prompt whose prefix was a hit is one hash block or less, so its last chunk often is exactly one). Both
    KDA backends can be captured there: fla's chunk, and the reference chunk, which reads nothing back from the
    device for rows of one length (its chunk layout comes from host sizes, its tile choice from the gate's bound)."""
    return (hash_block_tokens,)


class _Bucket:
    """The static buffers (and, once captured, the graph and its output) of one batch size and step length."""

    def __init__(self, size: int, tokens: int, n_kda: int, n_mla: int, max_pages: int, scratch: int,
                 num_splits: int, device):
        self.size, self.tokens, self.num_splits = size, tokens, num_splits
        # the token ids, start positions and KDA pages are views of one buffer (`head`), so a step's inputs go to
        # the device in one transfer (DecodeGraphs._load)
        self.head = torch.full((size * (tokens + 1 + n_kda),), scratch, dtype=torch.long, device=device)
        ids, positions, pages = self.head.split([size * tokens, size, size * n_kda])
        self.ids, self.positions, self.kda_pages = ids.view(size, tokens), positions, pages.view(size, n_kda)
        self.ids.zero_()
        self.positions.zero_()
        self.tables = torch.full((size, n_mla, max_pages), scratch, dtype=torch.long, device=device)
        # a fused verification's (DecodeGraphs.fused_replay): per KDA layer the pending inputs [size, P, ...] (P:
        # DecodeGraphs.max_pending) and each row's count of them [size] (0: nothing pending, or a padding row); set by
        # DecodeGraphs._bucket
        self.pending: list[KDAInputs] | None = None  # views of pending_flat
        self.pending_flat: torch.Tensor | None = None  # [size, P, layers * width] (views.flat_inputs)
        self.pending_lengths: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        # the captured step's outputs: (logits [size, V], hidden or None) for a decode or prefill step (hidden, with
        # keep_hidden: what the draft reads [size, tokens, width]); (logits [size, T, V], hidden, every KDA layer's
        # kept inputs side by side [size, T, layers * width], k3.serve.cache.views.flat_inputs) for a verification
        self.out: tuple | None = None


class DecodeGraphs:
    """Batched single-token decode steps of a ModelRunner (which owns them: ModelRunner.use_graphs) over static
    buffers, replayed as CUDA graphs (`capture`) or run by calling the step directly (capture=False: any device; the
    same buffers, padding and scratch page).

    max_batch: the most requests of one step (the engine's max_num_seqs); max_model_len: the longest context
    (sets max_pages and the kernel's split count); scratch_page: a pool page no request ever gets. `keep_hidden`
    (an engine with a speculative draft): every step also outputs the forward's hidden states (with `features`,
    those AttnRes blocks' outputs beside them), what the draft observes, and `run` returns (logits, hidden).
    `fused_replay` (None: the runner's): verifications replay the requests' pending accepted positions in the same
    pass (`run_verify`'s `pending`; the module docstring)."""

    def __init__(self, runner, max_batch: int, max_model_len: int, scratch_page: int, capture: bool = True,
                 prefill_lengths: tuple[int, ...] = (), keep_hidden: bool = False, features: tuple[int, ...] = (),
                 verify_lengths: tuple[int, ...] = (), compile_step: bool = False, fused_replay: bool | None = None):
        pool = runner.pool
        if not 0 <= scratch_page < pool.pages.shape[0]:
            raise ValueError(f"scratch_page={scratch_page} is not a page of the pool ({pool.pages.shape[0]} pages)")
        if capture and runner.device.type != "cuda":
            raise ValueError(f"capturing CUDA graphs needs the model on a CUDA device, not {runner.device}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        # what the steps read of the runner that owns them; they run the model through k3.serve.pool_forward, never
        # through the runner
        self.model, self.layout, self.device = runner.model, runner.layout, runner.device
        self.pool, self.scratch, self.capture = pool, scratch_page, capture
        self.keep_hidden, self.features = keep_hidden, tuple(features)
        # speculative verifications of this many positions per request (last token + drafts) also run on static
        # buffers: `run_verify`
        self.verify_lengths = tuple(sorted(set(int(t) for t in verify_lengths if int(t) > 1)))
        # the most pending positions a fused verification's buffers hold: the longest verification's (all of whose
        # positions an acceptance can leave pending), whatever the length of the window that replays them
        self.max_pending = max(self.verify_lengths, default=0)
        self.verify_steps = 0
        self.fused_replay = bool(getattr(runner, "fused_replay", False) if fused_replay is None else fused_replay)
        self.fused_pending_steps = 0  # fused verification steps in which some request had pending positions
        self.max_model_len = max_model_len
        self.max_pages = -(-max_model_len // pool.page_tokens)
        self.buckets = decode_buckets(max_batch)
        self.num_heads = self.model.config.num_attention_heads
        # Steps of this many new tokens per request (besides 1) also run on static buffers: the prefix cache's
        # hash-block-sized prefill chunks, e.g. the uncached tail of a prompt whose prefix was a hit.
        self.prefill_lengths = tuple(sorted(set(int(t) for t in prefill_lengths if int(t) > 1)))
        self._static: dict[tuple[int, int], _Bucket] = {}
        self._mempool = None
        self.disabled: str | None = None  # why graphs stopped (a capture failed); steps then run eagerly
        self.steps = 0  # steps run on the static buffers
        self.replays = 0  # of those, graph replays
        self.padded_rows = 0
        # the decode step compiled (compile_decode), or None: uncompiled; `compile_failed` says why it was dropped
        self._compiled = None
        if compile_step:
            import torch._dynamo

            opaque_under_compile()  # the compiled step fuses the PyTorch code between the kernels, not the kernels

            # One compile per bucket of the step, and, because the graph breaks at each opaque kernel, of the code
            # that resumes after it: each layer's sites (their layer index and the AttnRes block count are static)
            # in each bucket. Past dynamo's limits (16 per function, 256 in all) the rest would run uncompiled.
            need = 2 * len(self.buckets) * (self.model.config.num_hidden_layers + 1)
            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, need)
            cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * need)
            self._compiled = torch.compile(self._step, dynamic=False)
        self.compile_failed: str | None = None

    def _plain_step(self, b: _Bucket):
        """`_step` of bucket b; for decode buckets (T = 1) compiled when asked (a compile that fails is dropped, once,
        with a notice; `_step` zeroes the scratch page first, so a failed call leaves nothing behind)."""
        if self._compiled is not None and b.tokens == 1:
            try:
                return self._compiled(b)
            except Exception as e:
                self._compiled = None
                lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                # the first line and, when there is more (a compile subprocess's traceback), the cause in the last
                why = lines[0] + (f" ... {lines[-1]}" if len(lines) > 1 else "") if lines else ""
                self.compile_failed = f"{type(e).__name__}: {why[:500]}"
                notice(f"the decode step runs uncompiled from now on: torch.compile failed ({self.compile_failed})")
        return self._step(b)

    def bucket_size(self, batch: int) -> int | None:
        """The smallest bucket holding `batch` requests (None: larger than every bucket)."""
        return next((s for s in self.buckets if s >= batch), None)

    def num_splits(self, size: int, tokens: int = 1) -> int:
        """The paged decode kernel's split count for a bucket (size x tokens query rows) at max_model_len."""
        return default_num_splits(size * tokens, self.num_heads, self.max_model_len, self.device)

    @property
    def made(self) -> int:
        """Static-buffer steps made so far (each a captured graph when capturing): decode buckets, prefill chunk
        lengths and verification lengths. A benchmark checks that none is made inside its timed window."""
        return len(self._static)

    @torch.no_grad()
    def run(self, tokens: list[list[int]], starts: list[int], slots):
        """One step in which every request adds the same number of tokens T (1, or one of prefill_lengths) ->
        the logits of each request's last token [B, V] fp32 (with keep_hidden: (logits, hidden [B, T, width])),
        or None when it cannot run here (another T, too many requests, a block table longer than max_pages,
        graphs disabled): run it eagerly."""
        got = self._run_static(tokens, starts, slots, verify=False)
        if got is None:
            return None
        B, (logits, hidden) = got
        if self.keep_hidden:
            return logits[:B].clone(), hidden[:B].clone()
        return logits[:B].clone()

    @torch.no_grad()
    def run_verify(self, tokens: list[list[int]], starts: list[int], slots, pending: list | None = None,
                   pending_lengths: list[int] | None = None, drafts: torch.Tensor | None = None):
        """A speculative verification (k3.serve.runner.ModelRunner.execute) over static buffers: every request runs
        its T positions (T in verify_lengths) without advancing its KDA states -> (logits [B, T, V] fp32, hidden
        [B, T, width], each KDA layer's view of its projected inputs [B, T, ...] (KeptInputsView: views of the next,
        made when read), all of them side by side [B, T, layers * width] (k3.serve.cache.views.flat_inputs)),
        copies; or None when it cannot run here (as `run`): verify eagerly.

        With fused_replay, `pending` (per request its pending positions' kept inputs side by side [n, layers * width],
        as this step outputs them, or None: one copy per request into the buffers) and `pending_lengths` (B counts,
        0 for none) are replayed in front of the windows, the states after them written into the requests' pages;
        None: nothing pending. Returns None (run eagerly) when a count exceeds the pending
        buffers' length (`max_pending`).
        `drafts`: the tokens after each request's first [B, T - 1] on the device (`tokens` holds placeholders there;
        [B, T]: all of them),
        copied into the buffers on the device."""
        if pending is not None and not self.fused_replay:
            raise ValueError("pending positions given to a verification step without fused replay "
                             "(DecodeGraphs.fused_replay is off)")
        if pending is not None:
            if pending_lengths is None or len(pending_lengths) != len(tokens) or len(pending) != len(tokens):
                raise ValueError(f"pending inputs of {len(pending)} requests and counts {pending_lengths}: need "
                                 f"{len(tokens)} of each")
            if tokens and max(pending_lengths) > self.max_pending:
                return None  # more pending positions than the buffers hold
        got = self._run_static(tokens, starts, slots, verify=True, pending=(pending, pending_lengths), drafts=drafts)
        if got is None:
            return None
        B, (logits, hidden, flat) = got
        self.verify_steps += 1
        self.fused_pending_steps += pending is not None and any(pending_lengths)
        cfg = self.model.config
        flat = flat[:B].clone()  # one copy for every layer's kept inputs
        views = [KeptInputsView(flat, g, cfg.kda_num_heads, cfg.kda_head_dim) for g in range(len(self.layout.kda))]
        return logits[:B].clone(), hidden[:B].clone(), views, flat

    @torch.no_grad()
    def warm_up(self) -> int:
        """Set up (capture) every bucket now instead of on first use, so no request waits for a capture; returns
        the number of buckets ready. A server calls this once at startup. Without gradients, as the steps run (a
        capture with them enabled fails at the first inference-only kernel, and the engine then runs eagerly)."""
        for size in self.buckets:
            if self.disabled is None:
                self._bucket(size, 1)
        for T in self.prefill_lengths:
            for size in self.buckets:
                if self.disabled is None and T in self.prefill_lengths and size * T <= MAX_PREFILL_GRAPH_TOKENS:
                    self._bucket(size, T)
        for T in self.verify_lengths:
            for size in self.buckets:
                if self.disabled is None and T in self.verify_lengths and size * T <= MAX_PREFILL_GRAPH_TOKENS:
                    self._bucket(size, T, verify=True)
        return len(self._static)

    # --- internals -----------------------------------------------------------------------------------------------
    def _run_static(self, tokens, starts, slots, verify: bool, pending=(None, None), drafts=None):
        """The step of `run` (verify=False) or `run_verify` over the buffers of its bucket, replayed when captured ->
        (B, the step's outputs over the whole bucket), or None when it cannot run here. `pending`: a fused
        verification's (inputs per request, counts), `drafts` its tokens on the device, as `run_verify`'s."""
        if self.disabled is not None:
            return None
        B = len(tokens)
        T = len(tokens[0]) if tokens else 0
        size = self.bucket_size(B)
        allowed = T in self.verify_lengths if verify else (T == 1 or T in self.prefill_lengths)
        if size is None or not allowed or any(len(t) != T for t in tokens):
            return None
        if T > 1 and (size * T > MAX_PREFILL_GRAPH_TOKENS  # each such bucket would hold a large graph's memory
                      or max(starts) + T > MAX_PREFILL_GRAPH_CONTEXT):  # each query row reads its whole context
            return None
        width = max((len(t) for s in slots for t in s.mla_tables), default=1)
        if width > self.max_pages:
            return None
        bucket = self._bucket(size, T, verify=verify)
        if bucket is None:
            return None
        self._load(bucket, tokens, starts, slots, width)
        if drafts is not None:
            bucket.ids[:B, T - drafts.shape[1]:].copy_(drafts)
        if bucket.pending is not None:
            self._load_pending(bucket, len(tokens), *pending)
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
            out = bucket.out
        else:
            out = (self._verify_step if verify else self._plain_step)(bucket)
        self.steps += 1
        self.padded_rows += size - B
        return B, out

    def _step(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step that is captured: device work only, every input from b's buffers -> (logits, hidden or None)."""
        self.pool.zero_page(self.scratch)
        if self.keep_hidden:
            logits, _, hidden = run_on_pool(self.model, self.layout, self.pool, b.ids, b.kda_pages.t(),
                                            self._mla_views(b), features=self.features)
            return logits, hidden
        return run_on_pool(self.model, self.layout, self.pool, b.ids, b.kda_pages.t(), self._mla_views(b))[0], None

    def _verify_step(self, b: _Bucket):
        """The verification step that is captured: the model over b's T positions per row with each KDA layer's
        view keeping its inputs (the states in the pages stay as they are) -> (logits [size, T, V] fp32, hidden,
        every KDA layer's kept inputs side by side [size, T, layers * width]). A fused bucket (b.pending) replays
        each row's first b.pending_lengths[row] pending positions in front of its window and writes every row's state
        after them back into its pages."""
        self.pool.zero_page(self.scratch)
        if b.pending is not None:
            logits, hidden, views = verify_replay_on_pool(self.model, self.layout, self.pool, b.ids, b.kda_pages.t(),
                                                          self._mla_views(b), b.pending, b.pending_lengths,
                                                          self.features)
        else:
            logits, hidden, views = verify_on_pool(self.model, self.layout, self.pool, b.ids, b.kda_pages.t(),
                                                   self._mla_views(b), self.features)
        # no KDA layer (the all-MLA ablation): nothing kept, an empty [size, T, 0]
        flat = flat_inputs([v.inputs for v in views]) if views else logits.new_zeros(*logits.shape[:2], 0)
        return logits, hidden, flat

    def _mla_views(self, b: _Bucket) -> list[StaticMLAView]:
        return [StaticMLAView(self.pool, b.tables[:, g], b.positions, b.num_splits)
                for g in range(len(self.layout.mla))]

    def _load(self, b: _Bucket, tokens, starts, slots, width: int) -> None:
        """Copy a step's inputs into b's buffers; rows past the batch become padding on the scratch page. One host
        tensor through pinned memory (no wait for the device), then two copies on the device: b.head (ids, start
        positions, KDA pages) and the first `width` pages of every block table."""
        pad, scr = b.size - len(tokens), self.scratch
        n_kda, n_mla = b.kda_pages.shape[1], b.tables.shape[1]
        host = [t for seq in tokens for t in seq] + [0] * (b.tokens * pad) + list(starts) + [0] * pad
        if n_kda:
            host += [p for s in slots for p in s.kda_pages] + [scr] * (n_kda * pad)
        if n_mla:
            host += [p for s in slots for t in s.mla_tables for p in (*t, *[scr] * (width - len(t)))]
            host += [scr] * (width * n_mla * pad)
        got = to_device_async(torch.tensor(host, dtype=torch.long), self.device)
        n = b.head.numel()
        b.head.copy_(got[:n])
        if n_mla:
            b.tables[:, :, :width].copy_(got[n:].view(b.size, n_mla, width))

    def _load_pending(self, b: _Bucket, B: int, pending: list | None, lengths: list[int] | None) -> None:
        """Copy a fused verification's pending inputs (per request, every layer's side by side; all requests' in one
        multi-tensor copy) and counts into b's buffers (no reallocation): rows past the batch, and every row when
        nothing is pending, get count 0, so whatever their inputs hold is never read."""
        counts = ([0] * B if pending is None else list(lengths)) + [0] * (b.size - B)
        b.pending_lengths.copy_(to_device_async(torch.tensor(counts, dtype=torch.int32), self.device))  # no wait
        held = [(i, r) for i, r in enumerate(pending or ()) if r is not None and r.shape[0]]
        if held:  # one multi-tensor copy (a launch or two on a GPU), not one per request
            torch._foreach_copy_([b.pending_flat[i, :r.shape[0]] for i, r in held], [r for _, r in held])

    def _pending_buffers(self, b: _Bucket) -> None:
        """b's fused-verification buffers: per KDA layer KDAInputs of [size, P, ...] (P: `max_pending`, at least the
        bucket's own length) in the model's dtype (the kept inputs' shapes; views of one buffer, `pending_flat`) and the
        counts [size] int32, all zero."""
        cfg, dev = self.model.config, self.device
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        dtype = next(self.model.parameters()).dtype
        n = len(self.layout.kda)
        b.pending_flat = torch.zeros(b.size, max(self.max_pending, b.tokens), n * kept_width(H, K), device=dev,
                                     dtype=dtype)
        b.pending = [inputs_of(b.pending_flat, g, H, K) for g in range(n)]  # views: one buffer for every layer
        b.pending_lengths = torch.zeros(b.size, dtype=torch.int32, device=dev)

    def _bucket(self, size: int, tokens: int = 1, verify: bool = False) -> _Bucket | None:
        key = (size, tokens, "verify") if verify else (size, tokens)
        b = self._static.get(key)
        if b is not None:
            return b
        b = _Bucket(size, tokens, len(self.layout.kda), len(self.layout.mla), self.max_pages, self.scratch,
                    self.num_splits(size, tokens), self.device)
        if verify and self.fused_replay:
            self._pending_buffers(b)
        what = f"{tokens}-position verification" if verify else "decode" if tokens == 1 else f"{tokens}-token prefill"
        if self.capture:
            t0 = time.perf_counter()
            try:
                self._capture(b, verify)
            except Exception as e:  # keep serving, eagerly
                why = f"capturing the {what} step of {size} requests failed ({type(e).__name__}: {e})"
                if verify:  # decode graphs stay; verifications run eagerly
                    self.verify_lengths = ()
                    notice(f"speculative verifications run without CUDA graphs from now on: {why}")
                elif tokens == 1:
                    self.disabled = why
                    notice(f"decode steps run without CUDA graphs from now on: {why}")
                else:  # decode graphs stay; prefill chunks run eagerly
                    self.prefill_lengths = tuple(t for t in self.prefill_lengths if t != tokens)
                    notice(f"{tokens}-token prefill chunks run without CUDA graphs from now on: {why}")
                return None
            notice(f"captured the {what} CUDA graph for batches of up to {size} requests "
                   f"(num_splits {b.num_splits}, {time.perf_counter() - t0:.1f} s)")
        self._static[key] = b
        return b

    def _capture(self, b: _Bucket, verify: bool = False) -> None:
        """Warm up on a side stream (the buffers hold padding only: just the scratch page is touched), then
        capture the step into b.graph with b.out as its outputs."""
        dev = self.device
        step = self._verify_step if verify else self._plain_step
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                step(b)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            b.out = step(b)
        b.graph = graph
