"""CUDA graphs for the serving engine's decode steps.

A decode step of B requests (one new token each) is hundreds of small kernel launches from Python per step; at
small batch the GPU mostly waits for them. `DecodeGraphs` records the whole step once per batch bucket and
replays it. Per bucket of Bb rows it holds static device buffers

    ids [Bb, 1]                          the new tokens
    positions [Bb]                       each new token's position (the MLA lengths are positions + 1)
    kda_pages [Bb, n_kda]                each KDA layer's running-state page
    tables [Bb, n_mla, max_pages]        each MLA layer's block table (max_pages: pages of max_model_len)

and one captured step: zero the scratch page -> read the KDA states of `kda_pages` -> the model forward with
cache views over the buffers (`ModelRunner.run_cached`, the same code the eager runner runs; MLA through the
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

When: the model is on a CUDA device, the MLA decode runs on the paged kernel (the `mla_decode` backend resolves
to triton: the reference gathers each request's pages to its length, read back from the device) and the MoE
on the grouped backend (the reference expert loop reads the expert counts back). Otherwise the runner stays
eager and a notice says why. Prefill and packed forwards, batches larger than max_batch and block tables
longer than max_pages always run eagerly.

K3_CUDA_GRAPHS: auto (default: capture when the conditions hold), off, or eager (the static-buffer step called
directly, without capture, on any device: the same buffers, padding and scratch page; for tests and debugging).
"""

from __future__ import annotations

import os
import time

import torch

from k3.ops.backend import notice, resolve
from k3.ops.mla_decode import default_num_splits

ENV = "K3_CUDA_GRAPHS"
_MODES = {"auto": "auto", "on": "auto", "1": "auto", "off": "off", "0": "off", "eager": "eager"}


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph: powers of two below max_batch, then max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def decode_graphs_support(model, need_cuda: bool = True) -> tuple[bool, str]:
    """(True, "") when a decode step of `model` can be captured, else (False, why not)."""
    from k3.model.latent_moe import LatentMoE
    from k3.model.mla import paged_decode_available
    from k3.ops.moe import grouped_available

    device = next(model.parameters()).device
    if need_cuda and device.type != "cuda":
        return False, f"the model is on {device}, not a CUDA device"
    layers = model.model.layers
    if any(not l.is_kda for l in layers) and \
            resolve("mla_decode", device, lambda: paged_decode_available(device)) != "triton":
        return False, ("the MLA decode runs on the PyTorch reference (mla_decode backend torch), which reads the "
                       "lengths back; the paged decode kernel can be captured (K3_MLA_DECODE_BACKEND=triton)")
    moe = [l.ffn for l in layers if isinstance(l.ffn, LatentMoE)]
    if moe:
        dtype = moe[0].routed_expert_down_proj.weight.dtype
        if resolve("moe", device, lambda: grouped_available(device, dtype)) != "grouped":
            return False, ("the MoE runs on the reference expert loop (moe backend torch), which reads the expert "
                           "counts back; the grouped backend can be captured (K3_MOE_BACKEND=grouped)")
    return True, ""


def decode_graphs_mode(model) -> str | None:
    """How the engine runs batched decode steps: "capture" (CUDA graphs), "eager" (the static-buffer step without
    capture, K3_CUDA_GRAPHS=eager) or None (the plain eager runner; a one-time notice says why)."""
    raw = os.environ.get(ENV, "auto").strip().lower()
    if raw not in _MODES:
        raise ValueError(f"{ENV}={raw!r} is invalid: use auto, off or eager")
    mode = _MODES[raw]
    if mode == "off":
        return None
    ok, why = decode_graphs_support(model, need_cuda=mode == "auto")
    if not ok:
        notice(f"decode steps run without CUDA graphs: {why}")
        return None
    return "capture" if mode == "auto" else "eager"


class _Bucket:
    """The static buffers (and, once captured, the graph and its output) of one batch size."""

    def __init__(self, size: int, n_kda: int, n_mla: int, max_pages: int, scratch: int, num_splits: int, device):
        self.size, self.num_splits = size, num_splits
        self.ids = torch.zeros(size, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.kda_pages = torch.full((size, n_kda), scratch, dtype=torch.long, device=device)
        self.tables = torch.full((size, n_mla, max_pages), scratch, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the captured step's output [size, V]


class DecodeGraphs:
    """Batched single-token decode steps of a ModelRunner over static buffers, replayed as CUDA graphs
    (`capture`) or run by calling the step directly (capture=False: any device; the same buffers, padding and
    scratch page).

    max_batch: the most requests of one step (the engine's max_num_seqs); max_model_len: the longest context
    (sets max_pages and the kernel's split count); scratch_page: a pool page no request ever gets."""

    def __init__(self, runner, max_batch: int, max_model_len: int, scratch_page: int, capture: bool = True):
        pool = runner.pool
        if not 0 <= scratch_page < pool.pages.shape[0]:
            raise ValueError(f"scratch_page={scratch_page} is not a page of the pool ({pool.pages.shape[0]} pages)")
        if capture and runner.device.type != "cuda":
            raise ValueError(f"capturing CUDA graphs needs the model on a CUDA device, not {runner.device}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.runner, self.pool, self.scratch, self.capture = runner, pool, scratch_page, capture
        self.max_model_len = max_model_len
        self.max_pages = -(-max_model_len // pool.page_tokens)
        self.buckets = decode_buckets(max_batch)
        self.num_heads = runner.model.config.num_attention_heads
        self._static: dict[int, _Bucket] = {}
        self._mempool = None
        self.disabled: str | None = None  # why graphs stopped (a capture failed); steps then run eagerly
        self.steps = 0  # steps run on the static buffers
        self.replays = 0  # of those, graph replays
        self.padded_rows = 0

    def bucket_size(self, batch: int) -> int | None:
        """The smallest bucket holding `batch` requests (None: larger than every bucket)."""
        return next((s for s in self.buckets if s >= batch), None)

    def num_splits(self, size: int) -> int:
        """The paged decode kernel's split count for a bucket: the default for its size at max_model_len."""
        return default_num_splits(size, self.num_heads, self.max_model_len, self.runner.device)

    @torch.no_grad()
    def run(self, tokens: list[list[int]], starts: list[int], slots) -> torch.Tensor | None:
        """One decode step (every request adds one token) -> logits [B, V] fp32, or None when it cannot run
        here (too many requests, a block table longer than max_pages, graphs disabled): run it eagerly."""
        if self.disabled is not None:
            return None
        B = len(tokens)
        size = self.bucket_size(B)
        if size is None or any(len(t) != 1 for t in tokens):
            return None
        width = max((len(t) for s in slots for t in s.mla_tables), default=1)
        if width > self.max_pages:
            return None
        bucket = self._bucket(size)
        if bucket is None:
            return None
        self._load(bucket, tokens, starts, slots, width)
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
            logits = bucket.logits
        else:
            logits = self._step(bucket)
        self.steps += 1
        self.padded_rows += size - B
        return logits[:B].clone()

    # --- internals -----------------------------------------------------------------------------------------------
    def _step(self, b: _Bucket) -> torch.Tensor:
        """The step that is captured: device work only, every input from b's buffers."""
        from k3.serve.runner import StaticMLAView

        self.pool.pages[self.scratch].zero_()
        views = [StaticMLAView(self.pool, b.tables[:, g], b.positions, b.num_splits)
                 for g in range(len(self.runner.mla_layers))]
        return self.runner.run_cached(b.ids, b.kda_pages.t(), views)

    def _load(self, b: _Bucket, tokens, starts, slots, width: int) -> None:
        """Copy a step's inputs into b's buffers; rows past the batch become padding on the scratch page."""
        pad, scr = b.size - len(tokens), self.scratch
        n_kda, n_mla = b.kda_pages.shape[1], b.tables.shape[1]
        b.ids.copy_(torch.tensor([t[0] for t in tokens] + [0] * pad, dtype=torch.long).view(b.size, 1))
        b.positions.copy_(torch.tensor(list(starts) + [0] * pad, dtype=torch.long))
        if n_kda:
            b.kda_pages.copy_(torch.tensor([list(s.kda_pages) for s in slots] + [[scr] * n_kda] * pad,
                                           dtype=torch.long))
        if n_mla:
            rows = [[list(t) + [scr] * (width - len(t)) for t in s.mla_tables] for s in slots]
            rows += [[[scr] * width] * n_mla] * pad
            b.tables[:, :, :width].copy_(torch.tensor(rows, dtype=torch.long))

    def _bucket(self, size: int) -> _Bucket | None:
        b = self._static.get(size)
        if b is not None:
            return b
        b = _Bucket(size, len(self.runner.kda_layers), len(self.runner.mla_layers), self.max_pages, self.scratch,
                    self.num_splits(size), self.runner.device)
        if self.capture:
            t0 = time.perf_counter()
            try:
                self._capture(b)
            except Exception as e:  # keep serving, eagerly
                self.disabled = f"capturing the step of {size} requests failed ({type(e).__name__}: {e})"
                notice(f"decode steps run without CUDA graphs from now on: {self.disabled}")
                return None
            notice(f"captured the decode CUDA graph for batches of up to {size} requests "
                   f"(num_splits {b.num_splits}, {time.perf_counter() - t0:.1f} s)")
        self._static[size] = b
        return b

    def _capture(self, b: _Bucket) -> None:
        """Warm up on a side stream (the buffers hold padding only: just the scratch page is touched), then
        capture the step into b.graph with b.logits as its output."""
        dev = self.runner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(b)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            b.logits = self._step(b)
        b.graph = graph
