"""The serving engine: request -> scheduler -> runner -> sampler -> request (report §5.4).

`LLMEngine.step()` runs one scheduling step, one stage per object: the scheduler plans it (`Scheduler.plan() ->
StepPlan`: decode tokens and prefill chunks under the token budget, prefix-cache hits restored, segments cut at
hash-block boundaries, the speculative decode steps), the runner runs each of its forwards against the paged pool
(`ModelRunner.execute(ForwardBatch) -> ForwardResult`; KDA checkpoints are persisted at hash-aligned positions as
the scheduler registers the computed tokens), the postprocess step samples and applies the stop rules
(k3.serve.postprocess), and the speculative decoder verifies, accepts and commits the drafts
(k3.serve.speculative.decoder). It is synchronous; the HTTP server drives it from a
background thread. A request with `SamplingParams.prompt_logprobs` has its prompt scored in the same forwards that
prefill it (the runner scores the chunk's positions, `PromptScore`), and so never takes a prefix-cache hit.

Speculative decoding (`EngineConfig.speculative`, k3.serve.speculative): a decoding request's step feeds its last token
and up to `num_draft_tokens` draft tokens. When the step also prefills chunks (and they run eagerly), the
verifications join the chunks' packed forward, so the step passes over the weights once for both; otherwise they
run as one batched forward of their own (plain decode steps run in the step's other forward). The verification
leaves the KDA states as they were; the accepted prefix is then replayed into them (KDA rollback by replay, report
§5.4.2), KDA checkpoints are taken only of those committed states, and the MLA block tables shrink to the accepted
length. With `EngineConfig.fused_replay` (on by default with speculation) the accepted positions past the last
hash-block boundary among them stay pending instead and are replayed in the same pass as the request's next
verification (op kda_verify_step), or before any other forward over the request (k3.serve.runner: fused replay).
Greedy output is token-identical to decoding without speculation and sampled output has the target's
distribution. With CUDA graphs, the verifications run as graph replays (one graph per batch bucket and number of
positions) and the plain decode steps on graphs that also output the hidden states the draft observes.

Images (report §2.4; k3.serve.images turns a chat request's image parts into them): a request may carry images
(`add_request(..., images=[PromptImage])`), each with its placeholder run in the prompt. At the first prefill chunk
that reaches an image, MoonViT-V2 encodes every image of the request not yet prefilled, in one packed call; each
chunk then takes the rows of its placeholder positions (an image may span chunks, and a prefix-cache hit may cover
part of one), which replace those positions' token embeddings, and an image's rows are dropped once prefilled
(a preempted request encodes again). The prefix cache salts the hash of every block holding an image's placeholders
with the image's content hash (k3.serve.cache.prefix.MediaSpan), so a repeated image and text hit, and different
images behind the same token ids never share a block. Decode steps carry no images, so CUDA-graph decode and
speculative verification are unchanged; a draft (MTP, EAGLE-3) reads the target's hidden states of the image
positions and, as in its training (K3ForCausalLM.mtp_loss), the placeholder token's embedding there.

Host write-back and prefetch (report §5.3.1, k3.serve.cache.host): `write_back(prefixes)` copies the cached
prefixes of token sequences (MLA rows and KDA checkpoints together) to host memory, `prefetch(store)` brings them
into another engine of the same model config and cache geometry, whose next requests starting with them hit them.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from k3.model.common import stack_projections
from k3.ops.registry import notice
from k3.serve.cache.host import HostPrefixStore, PrefetchReport
from k3.serve.cache.manager import CacheManager
from k3.serve.cuda_graphs import decode_graphs_mode, prefill_graph_lengths
from k3.serve.metrics import EngineMetrics
from k3.serve.postprocess import Postprocessor, RequestOutput
from k3.serve.runner import ForwardBatch, ModelRunner, PromptScore
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import Scheduler, SchedulerConfig, StepPlan
from k3.serve.sequence import PromptImage, Sequence, Status
from k3.serve.speculative.decoder import SpeculativeDecoder
from k3.serve.speculative.draft import Draft, Eagle3Draft, MTPDraft
from k3.serve.speculative.switch import SpecSwitch

SPECULATIVE = ("off", "mtp", "eagle3")
MAX_DRAFT_TOKENS = 16


@dataclass
class EngineConfig:
    cache_memory_mb: float = 512.0  # the page pool (MLA latent KV + KDA states + checkpoints)
    page_tokens: int = 2048  # physical page (allocation unit) in tokens
    hash_block_tokens: int = 512  # prefix-hash granularity; KDA checkpoints sit on these boundaries
    enable_prefix_cache: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    cuda_graphs: bool | str = True  # CUDA-graph decode steps where possible; False: off; "eager": no capture (tests)
    # torch.compile the static decode step before its capture (fewer, fused kernels; a compile per bucket at warm-up).
    # Needs the static-buffer steps (cuda_graphs True or "eager"); k3.serve.cuda_graphs
    compile_decode: bool = False
    # The projections a layer computes from one input (KDA's six, MLA's three, an MoE layer's latent down-projection
    # and shared gate and up, with the router on CUDA) as one GEMM per layer against their weights stacked in place
    # (k3.model.common.stack_projections: same bytes, fewer kernels); False undoes it on the model.
    stack_projections: bool = True
    # "mtp": draft with the model's MTP layer and verify (k3.serve.speculative); "eagle3": with the EAGLE-3 draft in
    # directory `draft` (k3 train-draft; k3.draft_checkpoint)
    speculative: str = "off"
    draft: str | None = None
    num_draft_tokens: int = 3  # drafts per speculative step (K: K + 1 positions verified)
    # With speculation: measure speculative against plain decode steps per decode batch size and keep to the faster
    # (k3.serve.speculative.switch). `k3 serve` and `k3 generate` turn it on (--no-speculative-auto: off); off here, so
    # that an engine built in code speculates on every step it can, as configured.
    speculative_auto: bool = False
    # With speculation: verifications join the step's prefill forward when it runs eagerly (one pass over the weights
    # for both, a mixed ForwardBatch); False: they always run as a forward of their own.
    mix_verify: bool = True
    # With speculation: the accepted positions' KDA replay runs in the same pass as the request's next verification
    # (op kda_verify_step, KimiDeltaAttention.verify_replay; k3.serve.runner: fused replay) instead of right after
    # acceptance. None (default): on with speculation (measured on an H100: a batch-1 cycle of 3.5 ms against 7.8 ms
    # with the replay after acceptance, BENCHMARKS.md), off without (and for a model without KDA layers: nothing to
    # replay); True needs speculation; False: the replay after.
    fused_replay: bool | None = None
    # With speculation on a draft's captured chains (MTP, EAGLE-3; greedy requests): after a verification at least
    # half of whose requests accepted every draft last time, their next proposal is drafted before the acceptance is
    # read back, as if every draft were accepted again, and taken for those where it was (the others drafted then;
    # k3.serve.speculative.decoder: on a GPU the drafting runs while the host accepts and commits); False: every
    # proposal after its acceptance.
    draft_ahead: bool = True
    # With drafting ahead and fused replay: the verification of a proposal drafted ahead is launched right after it
    # too, before the acceptance is read back, with the accepted positions it assumes pending in it (their KDA states
    # saved first); kept where every request accepted every draft and none finished, and its proposal is the next one;
    # else the states are restored and it is dropped (k3.serve.speculative.decoder: on a GPU the device verifies the
    # next window while the host accepts, emits, commits and plans). Off until measured on a GPU.
    verify_ahead: bool = False
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> None:
        if self.page_tokens < 1 or self.hash_block_tokens < 1 or self.page_tokens % self.hash_block_tokens:
            raise ValueError(f"page_tokens ({self.page_tokens}) must be a positive multiple of hash_block_tokens "
                             f"({self.hash_block_tokens})")
        if not self.cache_memory_mb > 0:
            raise ValueError(f"cache_memory_mb must be positive, got {self.cache_memory_mb}")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "eager"):
            raise ValueError(f"cuda_graphs={self.cuda_graphs!r} is invalid: use True, False or 'eager'")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative={self.speculative!r} is invalid: use {' or '.join(SPECULATIVE)}")
        for name in ("speculative_auto", "mix_verify", "compile_decode", "stack_projections", "draft_ahead",
                     "verify_ahead"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: use True or False")
        if self.fused_replay is not None and not isinstance(self.fused_replay, bool):
            raise ValueError(f"fused_replay={self.fused_replay!r} is invalid: use None (on with speculation), True or "
                             "False")
        if self.draft is not None and self.speculative != "eagle3":
            raise ValueError(f"a draft directory ({self.draft}) is for speculative='eagle3', not "
                             f"{self.speculative!r}")
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens={k!r} is invalid: use an integer in [1, {MAX_DRAFT_TOKENS}]")
        self.scheduler.validate()


def free_dropped_engines() -> None:
    """Free the memory of engines just dropped (every reference set to None), now. An engine's parts hold references
    back to one another (cycles), so a dropped engine is freed by Python's cycle collector, which a large cache pool
    does not prompt: until it runs, the pool stays allocated beside whatever comes next (a new engine, a training
    step). Callers that drop an engine to reuse its memory run this."""
    gc.collect()


class LLMEngine:
    """`draft`: a draft model for speculative decoding (k3.serve.speculative.draft.Draft) in place of the one
    `config.speculative` names (e.g. an EAGLE draft, or a test's); it turns speculation on."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, draft: Draft | None = None):
        self.cfg = cfg = config or EngineConfig()
        cfg.validate()
        self.model, self.tokenizer = model.eval(), tokenizer
        stack_projections(model, cfg.stack_projections)
        mcfg = model.config
        device = next(model.parameters()).device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        graphs = decode_graphs_mode(model, cfg.cuda_graphs)
        # the greedy drafting steps run as captured chains where the decode steps are captured (on the same
        # static-buffer code uncaptured with cuda_graphs "eager")
        chain_graphs = {"capture": True, "eager": "eager"}.get(graphs, False)
        if draft is None and cfg.speculative == "mtp":
            draft = MTPDraft(model, chain_graphs=chain_graphs)
        if draft is None and cfg.speculative == "eagle3":
            if cfg.draft is None:
                raise ValueError("speculative='eagle3' needs the draft's directory (EngineConfig.draft; --draft DIR)")
            from k3.draft_checkpoint import load_draft

            draft = Eagle3Draft(model, load_draft(cfg.draft, model), chain_graphs=chain_graphs)
        self.clock = time.perf_counter  # what the switch's step times are read from (a test's fake clock)
        n_kda = sum(1 for l in model.model.layers if l.is_kda)
        cache = CacheManager(mcfg, len(model.model.layers) - n_kda, n_kda, cfg.cache_memory_mb, cfg.page_tokens,
                             cfg.hash_block_tokens, cfg.enable_prefix_cache, dtype=dtype, device=device,
                             scratch_page=graphs is not None)
        self.metrics = EngineMetrics()
        self.post = Postprocessor(tokenizer, mcfg.eos_token_id, self.metrics)
        self.scheduler = Scheduler(cfg.scheduler, cache,  # owns the cache manager
                                   draft_tokens=cfg.num_draft_tokens if draft is not None else 0)
        self.scheduler.on_admit = self.post.admitted
        self.scheduler.on_preempt = self._on_preempt
        self.runner = ModelRunner(model, cache.pool)
        if cfg.fused_replay and draft is None:
            raise ValueError("fused_replay fuses the replay of accepted drafts into the next verification: it needs "
                             "speculative decoding (speculative='mtp' or 'eagle3', or a draft)")
        # resolved here, read by the runner and the speculative decoder alike; a model without KDA layers (the all-MLA
        # ablation) has no state to replay, so nothing to hold back
        self.runner.fused_replay = (draft is not None if cfg.fused_replay is None else cfg.fused_replay) and n_kda > 0
        self.speculative = None if draft is None else SpeculativeDecoder(
            draft, SpecSwitch() if cfg.speculative_auto else None, self.runner, self.scheduler, self.post, cfg,
            self._release)
        self.max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        if graphs is not None:
            # With a draft, the plain decode steps (and hash-block prefill chunks) run on graphs that also output the
            # hidden states the draft observes, and the verifications on graphs of their own.
            self.runner.use_graphs(max_batch=cfg.scheduler.max_num_seqs, max_model_len=self.max_model_len,
                                   scratch_page=cache.scratch_page, capture=graphs == "capture",
                                   prefill_lengths=prefill_graph_lengths(model, graphs, cfg.hash_block_tokens),
                                   keep_hidden=draft is not None, features=self._features,
                                   verify_lengths=tuple(range(2, cfg.num_draft_tokens + 2)) if draft else (),
                                   compile_step=cfg.compile_decode)
        elif cfg.compile_decode:
            notice("compile_decode has no effect: decode steps do not run on static buffers here (cuda_graphs is off, "
                   "or the conditions for them do not hold)")
        self.seqs: dict[str, Sequence] = {}
        self.lock = threading.RLock()
        self.last_prefetch: PrefetchReport | None = None  # what the latest `prefetch` fetched and skipped

    @property
    def cache(self) -> CacheManager:
        """The serving cache (page pool and prefix index), owned by the scheduler."""
        return self.scheduler.cache

    @property
    def draft(self) -> Draft | None:
        return self.speculative.draft if self.speculative is not None else None

    @property
    def spec_switch(self) -> SpecSwitch | None:
        """Speculation on or off per decode batch size (the speculative decoder's; None: always on, or no draft)."""
        return self.speculative.switch if self.speculative is not None else None

    @spec_switch.setter
    def spec_switch(self, switch: SpecSwitch | None) -> None:
        if self.speculative is None:
            raise ValueError("the engine has no draft: there is no speculation to switch")
        self.speculative.switch = switch

    @property
    def eos_id(self) -> int | None:
        """The token that ends a request (the postprocess step's; None: none does)."""
        return self.post.eos_id

    @eos_id.setter
    def eos_id(self, tok: int | None) -> None:
        self.post.eos_id = tok

    @torch.no_grad()
    def warm_up(self) -> dict:
        """Make now what the first requests would otherwise wait for: every CUDA graph bucket (captured, where the
        engine captures) and, on a GPU, the draft's first step at every power-of-two count of observed positions
        (kernels autotuned per count bucket: `MTPDraft.warm_up`). A server calls this once at startup. Returns
        {"graphs": buckets ready, "draft_counts": the counts run}."""
        graphs = self.runner.graphs
        n = graphs.warm_up() if graphs is not None and graphs.capture else 0
        draft = self.draft
        counts = []
        if draft is not None and hasattr(draft, "warm_up") and self.runner.device.type == "cuda":
            counts = draft.warm_up()
        return {"graphs": n, "draft_counts": counts}

    @property
    def _features(self) -> tuple[int, ...]:
        return self.speculative.features if self.speculative is not None else ()

    # --- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    images: list[PromptImage] | None = None) -> Sequence:
        """Queue a request. `images`: its images, in prompt order, each covering a run of the model's
        media_placeholder_token_id in the prompt as long as the encoder makes its tokens (ValueError otherwise)."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context length {self.max_model_len}")
        need = self.cache.pages_needed(len(prompt_ids) + params.max_tokens)
        if need > self.cache.num_pages:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) needs up to {need} "
                             f"cache pages but the pool has {self.cache.num_pages}; lower max_tokens or give the "
                             f"server more cache memory")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        images = list(images or ())
        if images:
            self.check_images(prompt_ids, images)
        seq = Sequence(list(prompt_ids), params, images=images,
                       **({"request_id": request_id} if request_id else {}))
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs.append(None)  # the first prompt token has no logprob: nothing predicts it
        seq.generator = torch.Generator(device=self.runner.device)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") % 2**63
        seq.generator.manual_seed(seed)
        with self.lock:
            if seq.request_id in self.seqs:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            self.seqs[seq.request_id] = seq
            self.scheduler.add(seq)
        return seq

    def check_images(self, prompt_ids: list[int], images: list[PromptImage]) -> None:
        """ValueError naming the image unless every image fits the model's encoder and covers placeholders of its
        own, in order: a [3, H, W] tensor with H, W multiples of the encoder's unit, `length` its token count, and
        prompt_ids[start:end] all media_placeholder_token_id."""
        vision = getattr(self.model, "vision", None)
        if vision is None:
            raise ValueError("this model has no vision encoder (no vision_config): it takes no images")
        pid = self.model.config.media_placeholder_token_id
        vcfg = vision.config
        mh, mw = vcfg.pixel_multiple
        prev = 0
        for k, im in enumerate(images):
            px = im.pixel_values
            if not (isinstance(px, torch.Tensor) and px.dim() == 3 and px.shape[0] == 3 and px.shape[1] > 0
                    and px.shape[2] > 0 and px.shape[1] % mh == 0 and px.shape[2] % mw == 0):
                raise ValueError(f"image {k}: pixel_values must be [3, H, W] with H, W multiples of {mh} x {mw}, "
                                 f"got {tuple(px.shape) if isinstance(px, torch.Tensor) else type(px).__name__}")
            n = vcfg.num_image_tokens(px.shape[1], px.shape[2])
            if im.length != n:
                raise ValueError(f"image {k}: a {px.shape[1]}x{px.shape[2]} image makes {n} tokens, not {im.length}")
            if im.start < prev or im.end > len(prompt_ids):
                raise ValueError(f"image {k}: its run [{im.start}, {im.end}) overlaps the previous image's or lies "
                                 f"outside the {len(prompt_ids)}-token prompt")
            if any(t != pid for t in prompt_ids[im.start:im.end]):
                raise ValueError(f"image {k}: prompt tokens [{im.start}, {im.end}) are not all the image "
                                 f"placeholder id {pid}")
            prev = im.end

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its cache (e.g. the client went away)."""
        with self.lock:
            seq = self.seqs.pop(request_id, None)
            if seq is None or seq.status == Status.FINISHED:
                return
            self.scheduler.abort(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
            seq.image_embeds = None
            if self.speculative is not None:
                self.speculative.forget(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plan -> forwards -> sample -> speculate: one step's outputs."""
        with self.lock:
            spec = self.speculative
            plan = self.scheduler.plan(spec.decide if spec is not None else None)
            if plan.refused is not None:
                self.seqs.pop(plan.refused.request_id, None)
                return [self.post.refused(plan.refused)]
            if plan.empty:
                return []
            t0 = self.clock()
            mixed = None  # the verifications run in the first prefill forward: (their proposals, their rows)
            if plan.verify and spec.mixes(plan.forwards[0] if plan.forwards else []):
                props = spec.propose(plan.verify)
                mixed = (props, spec.rows(plan.verify, props))
            logits, verified = self._forward(plan, mixed[1] if mixed else None)
            outputs = self.post.sample(plan.due, logits)
            due = {s.request_id: s for s in plan.due}
            for out in outputs:
                if out.finished:
                    self._release(due[out.request_id])
            if mixed is not None:
                outputs += spec.accept(plan.verify, mixed[0], verified)
            elif plan.verify:
                outputs += spec.verify(plan.verify)
            self.cache.mark_landed()
            if spec is not None and plan.decode_only and plan.decode:
                spec.record(plan.decode, bool(plan.verify), sum(len(o.new_token_ids) for o in outputs),
                            self.clock() - t0)
            return outputs

    def _forward(self, plan: StepPlan, verify: ForwardBatch | None):
        """Run the plan's forwards, round by round. Returns ({request id: (the forward's logits [B, V], the
        request's row)}, the verifications' Verified): `verify` (the speculating works' rows) joins the first
        round's prefill forward (`SpeculativeDecoder.mixes` says when there is one)."""
        spec = self.speculative
        logits: dict[str, tuple[torch.Tensor, int]] = {}
        verified = None
        for r, forwards in enumerate(plan.forwards):
            for segs in forwards:
                scores = [prompt_score(s.seq, s.start, s.end) for s in segs]
                images = [self._image_rows(s.seq, s.start, s.end) for s in segs]
                batch = ForwardBatch([s.seq.token_range(s.start, s.end) for s in segs], [s.start for s in segs],
                                     [self.scheduler.slots(s.seq) for s in segs], scores if any(scores) else None,
                                     keep_hidden=spec is not None, features=self._features,
                                     images=images if any(images) else None,
                                     ids=[s.seq.request_id for s in segs])
                if verify is not None and r == 0 and not segs[0].single:
                    batch = batch.joined(verify)
                res = self.runner.execute(batch)
                verified = res.verified if res.verified is not None else verified
                for s, sc, scored in zip(segs, scores, res.scored or [None] * len(segs)):
                    if sc is not None:
                        self.post.scored(s.seq, sc, scored)
                for i, s in enumerate(segs):
                    self.scheduler.computed(s.seq, s.end)
                    self.post.computed(s.seq, s.start, s.end)
                    logits[s.seq.request_id] = (res.logits, i)
                    if res.hidden is not None:
                        spec.observe(s.seq, s.start, res.hidden[i])
        if verify is not None and verified is None:
            raise RuntimeError("the verifications had no prefill forward to join (see SpeculativeDecoder.mixes)")
        return logits, verified

    def _image_rows(self, seq: Sequence, a: int, b: int) -> list[tuple[int, torch.Tensor]] | None:
        """The image rows of the forward over seq.tokens[a:b]: (offset in the chunk, the encoder's rows of those
        placeholder positions) for each image with placeholders there, or None. The first chunk that needs one
        encodes every image of the request not yet prefilled (one packed encoder call); an image's rows are
        dropped once the chunk reaches its end. (Called for every request of every forward: the common case, no
        image there, returns before entering no_grad.)"""
        if not seq.images or a >= seq.images[-1].end:
            return None
        hit = [k for k, im in enumerate(seq.images) if im.start < b and im.end > a]
        if not hit:
            return None
        with torch.no_grad():
            return self._encoded_rows(seq, a, b, hit)

    def _encoded_rows(self, seq: Sequence, a: int, b: int, hit: list[int]) -> list[tuple[int, torch.Tensor]]:
        """`_image_rows` for the images `hit` that have placeholders in seq.tokens[a:b]."""
        if seq.image_embeds is None:
            seq.image_embeds = [None] * len(seq.images)
        if any(seq.image_embeds[k] is None for k in hit):
            todo = [k for k, im in enumerate(seq.images) if im.end > a and seq.image_embeds[k] is None]
            vision = self.model.vision
            dtype = next(vision.parameters()).dtype
            dev = self.runner.device
            out = vision([seq.images[k].pixel_values.to(device=dev, dtype=dtype) for k in todo])
            for k, rows in zip(todo, out):
                seq.image_embeds[k] = rows
            self.metrics.images_encoded += len(todo)
        rows = []
        for k in hit:
            im = seq.images[k]
            lo, hi = max(a, im.start), min(b, im.end)
            rows.append((lo - a, seq.image_embeds[k][lo - im.start:hi - im.start]))
            if hi == im.end:
                seq.image_embeds[k] = None  # the chunk holds its last rows (a view keeps them until the forward)
        return rows

    # --- the scheduler's notices, and the end of a request -----------------------------------------------------
    def _on_preempt(self, seq: Sequence) -> None:
        self.metrics.preemptions += 1
        seq.image_embeds = None  # recomputed from its prefix hit: the images still to prefill are encoded again
        if self.speculative is not None:
            self.speculative.forget(seq)  # it is recomputed, and observed again, from its prefix hit

    def _release(self, seq: Sequence) -> None:
        """A finished request leaves: its pages go back to the cache, the draft forgets it."""
        self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)
        seq.image_embeds = None
        if self.speculative is not None:
            self.speculative.forget(seq)

    # --- offline use --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while any(s.status != Status.FINISHED for s in seqs):
            self.step()
        return seqs

    def cache_stats(self) -> dict:
        return self.cache.stats()

    # --- host write-back and prefetch (report §5.3.1; k3.serve.cache.host) ---------------------------------------
    def write_back(self, prefixes: list[list[int]]) -> HostPrefixStore:
        """Copy to host memory, for each token sequence, the longest prefix the cache can restore exactly as an
        admission looks it up (MLA blocks, then a KDA checkpoint at their end; a multiple of hash_block_tokens, up
        to every complete hash block of the sequence, 0 tokens when nothing is cached). The cache is only read.
        Runs between steps (it takes the engine's lock), so it never sees a step's unlanded entries; requests may
        be running or waiting (their indexed pages are never rewritten), but the usual caller has no work left
        (paused rollouts were aborted: their computed blocks and newest checkpoint stay in the index)."""
        with self.lock:
            store = self.cache.write_back(prefixes)
            self.metrics.written_back_tokens += store.tokens
            self.metrics.written_back_bytes += store.nbytes
        return store

    def prefetch(self, store: HostPrefixStore) -> int:
        """Copy a store written back by an engine of the same model config, page_tokens, hash_block_tokens and
        cache dtype (ValueError naming the difference otherwise; the weights may differ: the states are then the
        writer's) into this engine's pool, registered as evictable prefix-cache entries: the next request whose
        prompt starts with one of the prefixes (and is longer) hits all of it. Prefixes are taken in the store's
        order, each whole or not at all, while pages can be found (free, or by evicting idle cache entries, never
        a running request's); `last_prefetch` (a PrefetchReport) lists the fetched and skipped ones. Returns the
        tokens made available. Runs between steps (the engine's lock)."""
        with self.lock:
            report = self.cache.prefetch(store)
            self.last_prefetch = report
            self.metrics.prefetched_tokens += report.tokens
            self.metrics.prefetched_bytes += report.bytes
        return report.tokens


def prompt_score(seq: Sequence, a: int, b: int) -> PromptScore | None:
    """What to score of the forward over seq.tokens[a:b]: the logits at position j predict prompt token j + 1, so
    the positions from the first prompt token not yet scored, up to the prompt's second-to-last (after a
    preemption, positions already scored are not scored again)."""
    if not seq.scores_prompt:
        return None
    known = len(seq.prompt_logprobs)
    if a > known - 1:  # admission never gives such a request a hit, so no position can have been skipped
        raise RuntimeError(f"request {seq.request_id}: forward starts at {a} but only {known} prompt tokens "
                           f"are scored")
    lo, hi = max(a, known - 1), min(b, len(seq.prompt_ids) - 1)
    if lo >= hi:
        return None
    return PromptScore(lo - a, seq.prompt_ids[lo + 1:hi + 1], seq.params.prompt_logprobs)
