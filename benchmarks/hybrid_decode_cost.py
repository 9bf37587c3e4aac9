"""Decode cost of the KDA:MLA hybrid against full attention: cache bytes per sequence and decode ms/step by context.

    python benchmarks/hybrid_decode_cost.py                                   # computed; measured: tiny on a CPU
    python benchmarks/hybrid_decode_cost.py --backend fast --json hybrid.json --plot hybrid.png      # on one GPU
    python benchmarks/hybrid_decode_cost.py --no-measure --contexts 8192 --speculation 1 2 3 4 7   # speculation's cap

The report and the seeds credit the 3:1 KDA:MLA hybrid with making 1M-token context affordable (a fixed KDA state
against a growing MLA cache) and quote decoding 6.3x faster than full attention at 1M. This benchmark puts a number
beside that claim for each arm of a preset: its own layer pattern ("hybrid"), every layer Gated MLA ("all-MLA", full
attention; k3.config.layer_lists) and every layer KDA ("all-KDA", for reference).

Computed (no GPU, every preset in --presets, every context): from the model's shapes through k3.info
(`model_info` on the meta device, `sequence_cache_bytes`), the cache one sequence holds and a bandwidth floor of
one decode step of --batch sequences, the bytes the step must move over the HBM bandwidth (--bw-tbs, 4.0 TB/s: the
H200's device-to-device copy in GPU.md). The floor model assumes:

* weights: every active weight is read once per step: the per-token active parameters of `model_info` (every
  non-expert weight, the output head, no input embedding, no MTP layer), bf16 (2 bytes) except routed experts,
  which are MXFP4 (4-bit codes plus one E8M0 scale per 32: 17/32 byte) where the config's quantization_config says
  so (the release) and bf16 otherwise; the routed experts a batch touches are the expected distinct experts of
  B tokens routed uniformly (n (1 - (1 - k/n)^B); k/n of them at batch 1);
* cache: each sequence's MLA latent rows are read once (bf16, plus its new row written) and its KDA states and
  conv tails (fp32) read and written once;
* nothing else costs time: no launch overhead, activations and logits negligible, the attention and recurrence
  arithmetic hidden under the memory traffic (decode at small batch is far below the H200's compute ridge).
  A model larger than one GPU (the release) is taken as if its bytes streamed at one GPU's bandwidth; spread over
  N GPUs both arms divide by about N, so the ratio stands.

"ratio" is the full-attention arm's floor over the hybrid's at the same context and batch; "cache ratio" the same for
the cache traffic alone, the limit of "ratio" as the batch grows and the weights are shared by more sequences.

With --speculation K..., the same weight model for MTP speculation (report §5.4.2): the speed-up over plain decoding
when both run at the floor, with K drafts all accepted, at batch 1, 16 and 64 (`speculation_floor_speedup`). A
cycle reads the verification's weights (K + 1 positions per sequence: the experts of B(K + 1) tokens), the first
drafting step's (the MTP layer and the output head, the experts of the positions committed since the last proposal)
and K - 1 more drafting steps' (one position per sequence), and emits K + 1 tokens per sequence; a plain step reads
one token's weights per sequence and emits one. At batch 1 the verification touches about K + 1 times the routed
experts a plain step does, which caps what speculation can gain once decoding is bound by weight traffic; at larger
batches the experts are shared anyway and the cap rises.

Measured (--measure-preset on --device): decode ms/step of --batch sequences at each --measure-contexts length that
fits in the device's free memory, through the serving engine's own step: an `LLMEngine` (its page pool, block
tables, CUDA-graph decode steps and fast backends, as `k3 serve` builds them; prefix cache off) whose runner's
`execute` runs single-token steps (`ModelRunner.execute(ForwardBatch)`, what `LLMEngine.step` calls for decoding
requests; sampling is not timed). The context is not prefilled: each sequence gets the pages of `context` tokens
from the engine's cache manager and they are filled directly with random values (N(0, 1) latent rows, small random
KDA states), since how long a step takes does not depend on the values in the cache: the paged MLA kernel reads
every row up to the sequence's length whatever it holds, the KDA step reads and writes the whole state, and at a
fixed batch the router picks the same number of experts. The steps then run from position `context` on (each
writes its row and advances the KDA states in place); after --warmup steps (which capture the CUDA graph) --steps
are timed one by one (CUDA events on a GPU, perf_counter on a CPU) and the median is reported, with the 10th and
90th percentiles; the arms take turns at each length. Weights are random (bf16 on a GPU, the preset's dtype on a CPU), MTP off. The measured path is
checked against the model's plain cached decode (tests/test_hybrid_decode_cost.py): a pool filled from a real
prefill and stepped through it gives the plain path's logits.

On a CPU the measured part runs the tiny preset at 256..4096 tokens (the CPU-tiny version of the comparison); its
floor column is left out (the bandwidth model is the GPU's).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from functools import lru_cache
from typing import NamedTuple

import torch

from k3.config import K3Config, layer_lists
from k3.info import ModelInfo, build_meta_model, model_info, sequence_cache_bytes

CONTEXTS = [8192, 32768, 131072, 524288, 1048576]
CPU_CONTEXTS = [256, 512, 1024, 2048, 4096]
ARMS = ("hybrid", "all-MLA", "all-KDA")
FULL, HYBRID = "all-MLA", "hybrid"
COPY_BW_TBS = 4.0  # GPU.md: the H200's device-to-device copy, read + write
MXFP4_BYTES = 17 / 32  # 4-bit codes plus one 8-bit scale per 32 values


# --- the arms ---------------------------------------------------------------------------------------------------------
def arm_config(cfg: K3Config, arm: str) -> K3Config:
    """`cfg` as arm `arm`: its own layer pattern (hybrid), every layer Gated MLA (all-MLA) or every layer KDA
    (all-KDA); nothing else changes."""
    if arm == "hybrid":
        return cfg
    letter = {"all-MLA": "M", "all-KDA": "K"}.get(arm)
    if letter is None:
        raise ValueError(f"arm {arm!r} is unknown: use {', '.join(ARMS)}")
    kda, full = layer_lists(letter * cfg.num_hidden_layers)
    return cfg.replace(kda_layers=kda, full_attn_layers=full)


@lru_cache(maxsize=None)
def _preset_info(preset: str, arm: str, cache_dtype_bytes: int) -> tuple[K3Config, ModelInfo]:
    cfg = arm_config(K3Config.from_preset(preset), arm)
    return cfg, model_info(cfg, cache_dtype_bytes=cache_dtype_bytes)


# --- computed: cache bytes and the bandwidth floor --------------------------------------------------------------------
def routed_bytes_per_param(cfg: K3Config) -> float:
    """Bytes per routed-expert weight as served: MXFP4 where the config is an MXFP4 checkpoint's, else bf16."""
    q = cfg.quantization_config or {}
    return MXFP4_BYTES if q.get("format") == "mxfp4-pack-quantized" else 2.0


def touched_expert_fraction(cfg: K3Config, batch: float) -> float:
    """Expected share of the routed experts that `batch` tokens routed uniformly at random (top-k of n) touch."""
    n, k = cfg.num_experts, cfg.num_experts_per_token
    if not n:
        return 0.0
    return 1.0 - (1.0 - k / n) ** batch


def weight_bytes_per_step(cfg: K3Config, info: ModelInfo, batch: int = 1) -> float:
    """Weight bytes one decode step of `batch` sequences reads: `info`'s active parameters in bf16, the routed
    experts the batch touches at `routed_bytes_per_param`."""
    routed_total = info.breakdown.get("routed experts", (0, 0))[0]
    routed_active = info.breakdown.get("routed experts", (0, 0))[1]
    other = info.active - routed_active
    return 2.0 * other + routed_total * touched_expert_fraction(cfg, batch) * routed_bytes_per_param(cfg)


def _mtp_split(cfg: K3Config) -> tuple[int, int]:
    """(routed-expert parameters, other parameters and the output head) of the first MTP layer: what one MTP
    drafting step reads."""
    return _mtp_split_of(json.dumps(cfg.to_dict(), sort_keys=True))


@lru_cache(maxsize=None)
def _mtp_split_of(cfg_json: str) -> tuple[int, int]:
    model = build_meta_model(K3Config.from_dict(json.loads(cfg_json)))
    if not len(model.mtp):
        raise ValueError("the config has no MTP layer (num_nextn_predict_layers 0): nothing drafts")
    routed = other = 0
    for name, p in model.mtp[0].named_parameters():
        if ".block_sparse_moe.experts." in name:
            routed += p.numel()
        else:
            other += p.numel()
    return routed, other + model.lm_head.weight.numel()


def draft_bytes_per_step(cfg: K3Config, rows: float = 1) -> float:
    """Weight bytes one MTP drafting step over `rows` positions reads: the MTP layer's weights and the output head in
    bf16, the routed experts the rows touch (as `weight_bytes_per_step`)."""
    routed, other = _mtp_split(cfg)
    return 2.0 * other + routed * touched_expert_fraction(cfg, rows) * routed_bytes_per_param(cfg)


def speculation_floor_speedup(cfg: K3Config, info: ModelInfo, batch: int, drafts: int, accepted: float) -> float:
    """The speed-up of MTP speculation over plain decoding at `batch` sequences when both run at the weight-bandwidth
    floor: each cycle reads the drafting steps' weights (the first over the `accepted` positions committed since the
    last proposal, the other `drafts` - 1 over one position per sequence) and the verification's (drafts + 1 positions
    per sequence) and emits `accepted` tokens per sequence, where a plain step reads its weights for one. The routed
    experts of each step are those its positions touch routed uniformly at random (`touched_expert_fraction`); a
    trained router that sends neighbouring tokens to the same experts reads fewer."""
    if drafts < 1 or not 1 <= accepted <= drafts + 1:
        raise ValueError(f"drafts {drafts}, accepted {accepted}: need drafts >= 1 and 1 <= accepted <= drafts + 1")
    cycle = weight_bytes_per_step(cfg, info, batch * (drafts + 1)) + draft_bytes_per_step(cfg, batch * accepted) \
        + (drafts - 1) * draft_bytes_per_step(cfg, batch)
    return accepted * weight_bytes_per_step(cfg, info, batch) / cycle


def cache_traffic_per_step(info: ModelInfo, context: int) -> int:
    """Cache bytes one sequence's decode step moves at `context` tokens: its MLA rows read and the new one written,
    its KDA states and conv tails read and written."""
    return info.mla_cache_bytes_per_token * (context + 1) + 2 * (info.kda_state_bytes + info.kda_conv_bytes)


def computed_rows(presets: list[str], contexts: list[int], arms: list[str], batch: int, bw_tbs: float) -> list[dict]:
    rows = []
    for preset in presets:
        for arm in arms:
            cfg, info = _preset_info(preset, arm, 2)
            w = weight_bytes_per_step(cfg, info, batch)
            for L in contexts:
                cache = sequence_cache_bytes(info, L)
                traffic = batch * cache_traffic_per_step(info, L)
                rows.append({"preset": preset, "arm": arm, "kda_layers": len(cfg.kda_layers),
                             "mla_layers": len(cfg.full_attn_layers), "context": L, "batch": batch,
                             "cache_dtype": "bf16", "cache_bytes": cache, "weight_bytes": round(w),
                             "cache_traffic_bytes": traffic, "bw_tbs": bw_tbs,
                             "floor_ms": (w + traffic) / (bw_tbs * 1e12) * 1e3})
    _ratios(rows, "floor_ms", "ratio")
    _ratios(rows, "cache_traffic_bytes", "cache_ratio")
    return rows


def speculation_rows(presets: list[str], batches: list[int], drafts: list[int]) -> list[dict]:
    """`speculation_floor_speedup` of each preset with an MTP layer (its own layer pattern) at each batch and number of
    drafts, every draft accepted (the most a cycle emits)."""
    rows = []
    for preset in presets:
        cfg, info = _preset_info(preset, HYBRID, 2)
        if not cfg.num_nextn_predict_layers:
            continue
        for batch in batches:
            rows.append({"preset": preset, "batch": batch,
                         "floor_speedup": {k: round(speculation_floor_speedup(cfg, info, batch, k, k + 1), 3)
                                           for k in drafts}})
    return rows


def _ratios(rows: list[dict], key: str, out: str) -> None:
    """rows[out] of each all-MLA row = its `key` over the hybrid's at the same preset and context (absent when the
    hybrid's is missing)."""
    by = {(r["preset"], r["arm"], r["context"]): r for r in rows if r.get(key) is not None}
    for r in rows:
        if r["arm"] != FULL:
            continue
        full, hyb = by.get((r["preset"], FULL, r["context"])), by.get((r["preset"], HYBRID, r["context"]))
        if full is not None and hyb is not None:
            r[out] = full[key] / hyb[key]


# --- measured: the engine's decode step over a cache set directly -----------------------------------------------------
class Timing(NamedTuple):
    median_ms: float
    p10_ms: float
    p90_ms: float
    steps: int


class DecodeBench:
    """`batch` sequences of `context` tokens each in a serving engine built over `model` (the one `k3 serve` builds:
    CUDA-graph decode steps where the model's backends allow them, stacked projections; prefix cache off), whose
    cache pages are set directly instead of by a prefill (`fill_random`, or `fill_from` a model cache), and whose
    single-token steps run through the engine's runner (`step`). `room`: tokens each sequence may still add (the
    steps to run); the engine's pool holds exactly the pages `context + room` tokens need. `cuda_graphs`: the
    engine's (EngineConfig.cuda_graphs; True, as `k3 serve`; "eager" runs the static-buffer step uncaptured, which
    the tests use on a CPU)."""

    def __init__(self, model, context: int, batch: int = 1, room: int = 64, page_tokens: int = 2048,
                 compile_decode: bool = False, cuda_graphs: bool | str = True):
        from k3.serve.cache.pool import CachePool
        from k3.serve.cuda_graphs import decode_graphs_mode
        from k3.serve.engine import EngineConfig, LLMEngine
        from k3.serve.sampling import SamplingParams
        from k3.serve.scheduler import SchedulerConfig
        from k3.serve.sequence import Sequence

        if context < 1 or batch < 1 or room < 1:
            raise ValueError(f"context ({context}), batch ({batch}) and room ({room}) must be positive")
        self.model, self.context, self.batch, self.room = model, context, batch, room
        self.device = next(model.parameters()).device
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32  # the engine's pool dtype
        n_kda = sum(1 for layer in model.model.layers if layer.is_kda)
        n_mla = len(model.model.layers) - n_kda
        cap = context + room
        page_bytes = CachePool(model.config, 1, page_tokens, dtype=dtype, device="meta").page_bytes
        self.pages_per_seq = n_mla * -(-cap // page_tokens) + n_kda
        extra = 1 if decode_graphs_mode(model, cuda_graphs) is not None else 0  # the graphs' scratch page
        # half a page over, so that the manager's floor division of the megabytes gives exactly these pages
        mb = ((batch * self.pages_per_seq + extra) * page_bytes + page_bytes // 2) / 2**20
        sched = SchedulerConfig(max_num_seqs=batch)
        self.engine = LLMEngine(model, None, EngineConfig(
            cache_memory_mb=mb, page_tokens=page_tokens, hash_block_tokens=page_tokens, enable_prefix_cache=False,
            max_model_len=cap, cuda_graphs=cuda_graphs, compile_decode=compile_decode, scheduler=sched))
        cache = self.engine.cache
        self.pool = cache.pool
        self.seqs = [Sequence([1] * context, SamplingParams(max_tokens=room, temperature=0)) for _ in range(batch)]
        for s in self.seqs:
            if cache.admit(s) is None or not cache.grow(s, cap):
                raise RuntimeError(f"the engine's pool ({self.pool.num_pages} pages) cannot hold {batch} sequences of "
                                   f"{cap} tokens")
        self.slots = [cache.slots(s) for s in self.seqs]
        self.positions = [context] * batch
        self.cache_bytes = self.pages_per_seq * page_bytes  # per sequence, as allocated (whole pages)

    @property
    def uses_graphs(self) -> bool:
        return self.engine.runner.graphs is not None

    def fill_random(self, seed: int = 0) -> None:
        """Every sequence's MLA pages with N(0, 1) rows (what the normalized latent and the key dims look like) and
        its KDA states and conv tails with small random values; nothing of the pool is left unwritten that a step
        reads."""
        pool, dev = self.pool, self.device
        g = torch.Generator(device=dev).manual_seed(seed)
        mla = pool.mla_view() if pool.cfg.full_attn_layers else None
        chunk = 32  # pages per write: bounds the temporary
        for s in self.slots:
            for table in s.mla_tables:
                ids = torch.tensor(table, device=dev)
                for a in range(0, len(ids), chunk):
                    part = ids[a:a + chunk]
                    mla[part] = torch.randn(len(part), pool.page_tokens, pool.mla_width, generator=g, device=dev,
                                            dtype=pool.dtype)
            if s.kda_pages:
                n = len(s.kda_pages)
                state = 0.05 * torch.randn(n, *pool.kda_state_shape, generator=g, device=dev)
                conv = torch.randn(n, *pool.kda_conv_shape, generator=g, device=dev)
                pool.write_kda(torch.tensor(s.kda_pages, device=dev), state, conv)

    def fill_from(self, cache) -> None:
        """Copy a contiguous model cache (`model.new_cache()` after a forward of `batch` rows of `context` tokens)
        into the sequences' pages: MLA rows at their positions, KDA states and conv tails into the state pages."""
        from k3.serve.cache.views import LayerLayout

        layout, pool, dev, pt = LayerLayout.of(self.model), self.pool, self.device, self.pool.page_tokens
        for g, li in enumerate(layout.mla):
            lc = cache[li]
            if lc.length != self.context or lc.c.shape[0] != self.batch:
                raise ValueError(f"layer {li}'s cache holds {tuple(lc.c.shape[:2])} (rows, tokens); the bench holds "
                                 f"{self.batch} sequences of {self.context} tokens")
            pos = torch.arange(self.context, device=dev)
            for b, s in enumerate(self.slots):
                table = torch.tensor(s.mla_tables[g], device=dev)
                pool.write_mla(table[pos // pt], pos % pt, torch.cat([lc.c[b], lc.k_rope[b]], -1))
        for g, li in enumerate(layout.kda):
            state, conv = cache[li].read()
            pages = torch.tensor([s.kda_pages[g] for s in self.slots], device=dev)
            pool.write_kda(pages, state, torch.stack(conv, 1))

    def step(self, tokens: list[int]) -> torch.Tensor:
        """One decode step: token tokens[b] for sequence b at its position; the logits [batch, vocab] fp32."""
        from k3.serve.runner import ForwardBatch

        if len(tokens) != self.batch:
            raise ValueError(f"{len(tokens)} tokens for {self.batch} sequences")
        if self.positions[0] >= self.context + self.room:
            raise RuntimeError("the sequences have used the room they were given (DecodeBench room=)")
        out = self.engine.runner.execute(ForwardBatch([[t] for t in tokens], list(self.positions), self.slots))
        self.positions = [p + 1 for p in self.positions]
        return out.logits

    def time_steps(self, steps: int, warmup: int, seed: int = 0) -> Timing:
        """`warmup` untimed steps (the first captures the CUDA graph), then `steps` timed one by one."""
        g = torch.Generator().manual_seed(seed)
        V = self.model.config.vocab_size
        toks = torch.randint(1, V, (warmup + steps, self.batch), generator=g).tolist()
        cuda = self.device.type == "cuda"
        for t in toks[:warmup]:
            self.step(t)
        times = []
        if cuda:
            torch.cuda.synchronize(self.device)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
            for (a, b), t in zip(ev, toks[warmup:]):
                a.record()
                self.step(t)
                b.record()
            torch.cuda.synchronize(self.device)
            times = [a.elapsed_time(b) for a, b in ev]
        else:
            for t in toks[warmup:]:
                t0 = time.perf_counter()
                self.step(t)
                times.append((time.perf_counter() - t0) * 1e3)
        q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
        return Timing(statistics.median(times), q[0], q[-1], len(times))


def build_model(preset: str, arm: str, device: torch.device, backend: str, max_context: int):
    """A random model of `preset` as `arm` on `device` (bf16 on CUDA), MTP off, positions up to `max_context`."""
    from k3.model.model import K3ForCausalLM
    from k3.ops.registry import backends_from_env

    cfg = arm_config(K3Config.from_preset(preset), arm)
    cfg = cfg.replace(num_nextn_predict_layers=0, max_position_embeddings=max(cfg.max_position_embeddings, max_context))
    model = K3ForCausalLM(cfg, backends=backends_from_env(os.environ, default=backend)).init_weights(seed=0)
    if device.type == "cuda":
        model = model.set_dtype(torch.bfloat16)
    return model.to(device).eval()


def fits(model, context: int, batch: int, room: int, page_tokens: int) -> tuple[bool, int]:
    """(whether `batch` sequences of `context` + `room` tokens fit in the device's free memory with a margin, the
    pool bytes they need)."""
    from k3.serve.cache.pool import CachePool

    dev = next(model.parameters()).device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n_kda = sum(1 for layer in model.model.layers if layer.is_kda)
    n_mla = len(model.model.layers) - n_kda
    pb = CachePool(model.config, 1, page_tokens, dtype=dtype, device="meta").page_bytes
    need = (batch * (n_mla * -(-(context + room) // page_tokens) + n_kda) + 1) * pb
    if dev.type != "cuda":
        return True, need
    free, _ = torch.cuda.mem_get_info(dev)
    return need + 4 * 2**30 < free, need  # 4 GiB for the step's activations, the graph pool and the allocator


def measured_rows(preset: str, contexts: list[int], arms: list[str], batch: int, device: torch.device, backend: str,
                  steps: int, warmup: int, bw_tbs: float, page_tokens: int, compile_decode: bool) -> list[dict]:
    """Every arm at every context, the arms taking turns at each context (so a slow spell of a shared machine does
    not fall on one arm alone); every arm's model stays built throughout."""
    rows = []
    room = warmup + steps + 1
    esize = 2 if device.type == "cuda" else 4  # the engine's pool: bf16 on CUDA, fp32 elsewhere
    models = {arm: build_model(preset, arm, device, backend, max(contexts) + room) for arm in arms}
    infos = {arm: model_info(m.config, cache_dtype_bytes=esize) for arm, m in models.items()}
    for L in contexts:
        for arm in arms:
            model, info = models[arm], infos[arm]
            ok, need = fits(model, L, batch, room, page_tokens)
            row = {"preset": preset, "arm": arm, "context": L, "batch": batch, "device": _device_name(device),
                   "cache_dtype": "bf16" if esize == 2 else "fp32", "cache_bytes": sequence_cache_bytes(info, L)}
            if not ok:
                print(f"  {preset} {arm} at {L:,}: does not fit ({need / 2**30:.1f} GiB of pool)", flush=True)
                rows.append({**row, "median_ms": None, "note": "does not fit"})
                continue
            print(f"  {preset} {arm} at {L:,} tokens: filling {need / 2**30:.2f} GiB, then {warmup} + {steps} steps",
                  flush=True)
            bench = DecodeBench(model, L, batch, room, page_tokens, compile_decode)
            bench.fill_random(seed=L)
            t = bench.time_steps(steps, warmup, seed=L)
            row.update(allocated_bytes=bench.cache_bytes, graphs=bench.uses_graphs, median_ms=t.median_ms,
                       p10_ms=t.p10_ms, p90_ms=t.p90_ms, steps=t.steps)
            if device.type == "cuda":
                floor = (weight_bytes_per_step(model.config, info, batch)
                         + batch * cache_traffic_per_step(info, L)) / (bw_tbs * 1e12) * 1e3
                row.update(floor_ms=floor, of_floor=floor / t.median_ms)
            rows.append(row)
            del bench
            gc.collect()  # the engine's graphs and pool go now, before the next one allocates its own
            if device.type == "cuda":
                torch.cuda.empty_cache()
    rows.sort(key=lambda r: (arms.index(r["arm"]), r["context"]))
    _ratios(rows, "median_ms", "ratio")
    return rows


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


# --- output -----------------------------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}" if n >= 2**20 else f"{n / 2**30:.2e}"


def _ctx(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _r(x) -> str:
    return "" if x is None else f"{x:.2f}x"


def format_computed(rows: list[dict], bw_tbs: float) -> str:
    out = [f"computed (bandwidth floor at {bw_tbs} TB/s, batch {rows[0]['batch'] if rows else 1})", "",
           "| model | arm (KDA/MLA layers) | context | cache GiB/seq | weights GiB/step | floor ms/step | ratio | "
           "cache ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['preset']} | {r['arm']} ({r['kda_layers']}/{r['mla_layers']}) | {_ctx(r['context'])} | "
                   f"{_gib(r['cache_bytes'])} | {r['weight_bytes'] / 2**30:.3f} | {r['floor_ms']:.4f} | "
                   f"{_r(r.get('ratio'))} | {_r(r.get('cache_ratio'))} |")
    return "\n".join(out)


def format_speculation(rows: list[dict]) -> str:
    if not rows:
        return "speculation: no preset of --presets has an MTP layer"
    ks = list(rows[0]["floor_speedup"])
    out = ["speculation at the weight-bandwidth floor (MTP drafts, every draft accepted): speed-up over plain decoding",
           "", "| model | batch | " + " | ".join(f"{k} drafts" for k in ks) + " |", "|---|---|" + "---|" * len(ks)]
    for r in rows:
        out.append(f"| {r['preset']} | {r['batch']} | " + " | ".join(f"{v:.2f}x" for v in r["floor_speedup"].values())
                   + " |")
    return "\n".join(out)


def format_measured(rows: list[dict]) -> str:
    if not rows:
        return "measured: nothing"
    gpu = any("floor_ms" in r for r in rows)
    head = "| model | arm | context | cache GiB/seq | ms/step median (p10-p90) | " + \
        ("floor ms | of floor | " if gpu else "") + "ratio |"
    out = [f"measured on {rows[0]['device']}, batch {rows[0]['batch']}", "", head,
           "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r.get("note") or f"{r['median_ms']:.3f} ({r['p10_ms']:.3f}-{r['p90_ms']:.3f})"
        extra = (f"{r['floor_ms']:.4f} | {r['of_floor']:.1%} | " if "floor_ms" in r else " | | ") if gpu else ""
        out.append(f"| {r['preset']} | {r['arm']} | {_ctx(r['context'])} | {_gib(r['cache_bytes'])} | {t} | {extra}"
                   f"{_r(r.get('ratio'))} |")
    return "\n".join(out)


def plot(computed: list[dict], measured: list[dict], path: str) -> None:
    """Left: decode ms/step against context, the computed floor (dashed) and the measured steps (solid), per preset
    and arm; right: cache bytes per sequence (at the cache dtype each row was counted in). Log axes; written
    atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from k3.files import atomic_write

    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(13, 5))
    times: dict = {}
    caches: dict = {}
    for r in computed:
        times.setdefault((r["preset"], r["arm"], f"floor at {r['bw_tbs']:g} TB/s", "--"), {})[r["context"]] = \
            r["floor_ms"]
    for r in measured:
        if r.get("median_ms") is not None:
            times.setdefault((r["preset"], r["arm"], f"measured, {r['device']}", "-"), {})[r["context"]] = \
                r["median_ms"]
    for r in computed + measured:
        caches.setdefault((r["preset"], r["arm"], r["cache_dtype"]), {})[r["context"]] = r["cache_bytes"] / 2**30
    for (preset, arm, what, style), pts in times.items():
        x = sorted(pts)
        ax_t.plot(x, [pts[c] for c in x], style, marker="o", label=f"{preset} {arm} ({what})")
    for (preset, arm, dtype), pts in caches.items():
        x = sorted(pts)
        ax_c.plot(x, [pts[c] for c in x], "-", marker="o", label=f"{preset} {arm} ({dtype} cache)")
    for ax, title, ylabel in ((ax_t, "decode ms/step", "ms"), (ax_c, "cache per sequence", "GiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


# --- command line -----------------------------------------------------------------------------------------------------
def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s!r} must be positive")
    return v


def main(argv: list[str] | None = None) -> int:
    from k3.cli_args import RawDefaultsHelpFormatter
    from k3.config import PRESETS
    from k3.files import atomic_write_text

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["k3-mini", "k3"], choices=list(PRESETS),
                    help="presets of the computed part")
    ap.add_argument("--contexts", nargs="+", type=_positive, default=CONTEXTS, help="context lengths (computed)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--batch", type=_positive, default=1, help="sequences per decode step")
    ap.add_argument("--bw-tbs", type=float, default=COPY_BW_TBS, help="HBM bandwidth of the floor, TB/s")
    ap.add_argument("--speculation", nargs="+", type=_positive, default=None, metavar="DRAFTS",
                    help="also the computed speed-up of MTP speculation at the floor with these numbers of drafts, at "
                         "batch 1, 16 and 64 and --batch (`speculation_floor_speedup`)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-measure", action="store_true", help="the computed part only")
    ap.add_argument("--measure-preset", default=None, choices=list(PRESETS),
                    help="preset of the measured part (default: k3-mini on CUDA, tiny elsewhere)")
    ap.add_argument("--measure-contexts", nargs="+", type=_positive, default=None,
                    help=f"context lengths measured (default: --contexts on CUDA, {CPU_CONTEXTS} elsewhere)")
    ap.add_argument("--backend", choices=["auto", "fast", "torch"], default=None,
                    help="the ops' implementations (k3.ops.registry; K3_<OP>_BACKEND pins one); default: fast on "
                         "CUDA, auto elsewhere")
    ap.add_argument("--steps", type=_positive, default=50, help="timed decode steps per measurement")
    ap.add_argument("--warmup", type=_positive, default=5, help="untimed steps first (graph capture)")
    ap.add_argument("--page-tokens", type=_positive, default=2048, help="the engine's page size in tokens")
    ap.add_argument("--compile-decode", action="store_true", help="torch.compile the static decode step (CUDA)")
    ap.add_argument("--threads", type=_positive, default=1,
                    help="torch threads on a CPU (the tiny model's small matrices gain nothing from more, and on a "
                         "busy machine a thread pool stalls them)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write every row as JSON to OUT")
    ap.add_argument("--plot", default=None, metavar="PNG", help="plot ms/step and cache bytes against context")
    args = ap.parse_args(argv)
    if not args.bw_tbs > 0:
        ap.error(f"--bw-tbs must be positive, got {args.bw_tbs}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    backend = args.backend or ("fast" if device.type == "cuda" else "auto")
    if backend == "fast" and device.type != "cuda":
        ap.error(f"--backend fast needs a CUDA device (this run is on {device.type}); use auto or torch")

    computed = computed_rows(args.presets, args.contexts, args.arms, args.batch, args.bw_tbs)
    print(format_computed(computed, args.bw_tbs), flush=True)
    speculation = []
    if args.speculation:
        speculation = speculation_rows(args.presets, sorted({1, 16, 64, args.batch}), args.speculation)
        print("\n" + format_speculation(speculation), flush=True)
    measured = []
    if not args.no_measure:
        preset = args.measure_preset or ("k3-mini" if device.type == "cuda" else "tiny")
        contexts = args.measure_contexts or (args.contexts if device.type == "cuda" else CPU_CONTEXTS)
        print(f"\nmeasuring {preset} on {_device_name(device)} ({backend} backends)", flush=True)
        measured = measured_rows(preset, contexts, args.arms, args.batch, device, backend, args.steps, args.warmup,
                                 args.bw_tbs, args.page_tokens, args.compile_decode)
        print("\n" + format_measured(measured), flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps({"argv": sys.argv[1:], "bw_tbs": args.bw_tbs, "computed": computed,
                                                 "speculation": speculation, "measured": measured}, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(computed, measured, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
