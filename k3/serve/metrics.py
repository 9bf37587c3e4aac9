"""Prometheus text exposition (format 0.0.4) of the serving engine's metrics, for GET /metrics.

Latencies are histograms in seconds, token and request counts are counters, queue depth and the cache pool are
gauges; every name starts with `k3_`. The engine keeps its latency samples in bounded windows (`SampleWindow`:
the most recent samples plus a running total, so a server that runs for months holds constant memory); a
`MetricsExporter` folds the samples it has not seen yet into cumulative bucket counts at each scrape, so a scrape
costs O(new samples), not O(all samples).
"""

from __future__ import annotations

import bisect
import collections
import math
import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket upper bounds in seconds; +Inf is implicit.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                         5.0, 10.0)

HISTOGRAMS = (
    # (name, EngineMetrics attribute, help, buckets)
    ("k3_time_to_first_token_seconds", "ttft", "Time from a request's arrival to its first generated token.",
     LATENCY_BUCKETS),
    ("k3_time_per_output_token_seconds", "tpot", "Time between consecutive generated tokens of a request.",
     TOKEN_LATENCY_BUCKETS),
    ("k3_queue_time_seconds", "queue_time", "Time a request waited before it was first admitted into the cache.",
     LATENCY_BUCKETS),
)

COUNTERS = (
    ("k3_prompt_tokens_cached_total", "prompt_tokens_cached", "Prompt tokens served from the prefix cache."),
    ("k3_prompt_tokens_computed_total", "prompt_tokens_computed", "Prompt tokens run through the model."),
    ("k3_generation_tokens_total", "generation_tokens", "Tokens sampled."),
    ("k3_requests_finished_total", "requests_finished", "Requests that finished (stop or length)."),
    ("k3_preemptions_total", "preemptions", "Requests preempted for lack of cache pages (recomputed later)."),
    ("k3_spec_verifications_total", "spec_verifications", "Speculative decode steps of a request (drafts verified)."),
    ("k3_spec_draft_tokens_total", "draft_tokens_proposed", "Draft tokens proposed for verification."),
    ("k3_spec_draft_tokens_accepted_total", "draft_tokens_accepted", "Draft tokens the target accepted."),
    ("k3_spec_drafted_ahead_total", "spec_drafted_ahead",
     "Requests' proposals drafted before their previous verification was read back (EngineConfig.draft_ahead)."),
    ("k3_spec_drafted_ahead_taken_total", "spec_drafted_ahead_taken",
     "Proposals drafted ahead that were taken (the verification before them accepted every draft)."),
    ("k3_spec_verified_ahead_total", "spec_verified_ahead",
     "Requests' verifications launched before their previous verification was read back (EngineConfig.verify_ahead)."),
    ("k3_spec_verified_ahead_used_total", "spec_verified_ahead_used",
     "Verifications launched ahead that were used (kept by the acceptance before them, then their step's)."),
    ("k3_written_back_tokens_total", "written_back_tokens", "Prefix tokens written back to host memory."),
    ("k3_prefetched_tokens_total", "prefetched_tokens", "Prefix tokens fetched from host memory into the cache."),
    ("k3_images_encoded_total", "images_encoded", "Images run through the vision encoder at prefill."),
)


class SampleWindow:
    """The last `maxlen` samples of a latency series, with the count of all samples ever added.

    Samples are numbered 0, 1, 2, ... in arrival order; `since(i)` returns those numbered >= i that are still
    kept. A scraper that falls more than `maxlen` samples behind misses the oldest ones (and can tell, from
    `total`, how many)."""

    def __init__(self, maxlen: int = 100_000):
        if not isinstance(maxlen, int) or isinstance(maxlen, bool) or maxlen < 1:
            raise ValueError(f"maxlen must be a positive int, got {maxlen!r}")
        self._kept: collections.deque = collections.deque(maxlen=maxlen)
        self.total = 0

    def append(self, value: float) -> None:
        self._kept.append(value)
        self.total += 1

    def since(self, index: int) -> list:
        first_kept = self.total - len(self._kept)
        skip = max(0, index - first_kept)
        return list(self._kept)[skip:] if skip < len(self._kept) else []

    def __len__(self) -> int:
        return len(self._kept)

    def __iter__(self):
        return iter(self._kept)


class EngineMetrics:
    """The serving engine's counters and latency samples, what /metrics renders (Prometheus text)."""

    def __init__(self) -> None:
        # Bounded: the most recent samples (the /metrics histograms count every sample ever added).
        self.ttft = SampleWindow()
        self.tpot = SampleWindow()
        self.queue_time = SampleWindow()
        self.prompt_tokens_cached = 0
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.requests_finished = 0
        self.preemptions = 0
        # speculative decoding: verified request-steps, drafts proposed and accepted (mean accepted length, tokens
        # emitted per verification: (accepted + verifications) / verifications)
        self.spec_verifications = 0
        self.draft_tokens_proposed = 0
        self.draft_tokens_accepted = 0
        # proposals drafted ahead of their acceptance's read-back, per request, and those taken
        self.spec_drafted_ahead = 0
        self.spec_drafted_ahead_taken = 0
        # verifications launched ahead of the read-back before them, per request, and those used
        self.spec_verified_ahead = 0
        self.spec_verified_ahead_used = 0
        # host write-back (prefixes copied to host memory) and prefetch (copied back into the pool)
        self.written_back_tokens = 0
        self.written_back_bytes = 0
        self.prefetched_tokens = 0
        self.prefetched_bytes = 0
        self.images_encoded = 0  # images run through the vision encoder (a prefix-cache hit over one skips it)

    @property
    def mean_accepted_length(self) -> float:
        n = self.spec_verifications
        return (self.draft_tokens_accepted + n) / n if n else 0.0


class _Histogram:
    def __init__(self, buckets):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket (not cumulative); the last one is +Inf
        self.sum = 0.0
        self.seen = 0  # number of the next sample of the source window to fold in

    def update(self, samples: SampleWindow) -> None:
        for v in samples.since(self.seen):
            v = float(v)
            if math.isnan(v):
                continue
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.sum += v
        self.seen = samples.total

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{_fmt(b)}"}} {acc}')
        acc += self.counts[-1]
        out.append(f'{name}_bucket{{le="+Inf"}} {acc}')
        out.append(f"{name}_sum {_fmt(self.sum)}")
        out.append(f"{name}_count {acc}")
        return out


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    v = float(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(v)


class MetricsExporter:
    """Renders one engine's metrics; keep one per engine (it remembers which latency samples it has counted).
    `extra_counters` adds server-side counters: {name: (help, value)}."""

    def __init__(self, engine):
        self.engine = engine
        self._hist = {name: _Histogram(buckets) for name, _, _, buckets in HISTOGRAMS}
        self._lock = threading.Lock()

    def render(self, extra_counters: dict | None = None) -> str:
        eng = self.engine
        with self._lock:
            lock = getattr(eng, "lock", None)
            if lock is not None:
                lock.acquire()
            try:  # one consistent snapshot: the engine does not step while we read
                m = eng.metrics
                for name, attr, _, _ in HISTOGRAMS:
                    self._hist[name].update(getattr(m, attr))
                counters = [(name, hlp, getattr(m, attr, 0)) for name, attr, hlp in COUNTERS]
                mean_accepted = getattr(m, "mean_accepted_length", 0.0)
                running = len(eng.scheduler.running)
                waiting = eng.scheduler.num_waiting
                cache = dict(eng.cache_stats())
                switch = getattr(eng, "spec_switch", None)
                switch = switch.state() if switch is not None else {}
            finally:
                if lock is not None:
                    lock.release()
            lines: list[str] = []
            for name, _, hlp, _ in HISTOGRAMS:
                lines += [f"# HELP {name} {hlp}", f"# TYPE {name} histogram"]
                lines += self._hist[name].lines(name)
        counters.append(("k3_prefix_cache_queries_total", "Admissions that looked up the prefix cache.",
                         cache.get("queries", 0)))
        counters.append(("k3_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache at admission "
                         "(including re-admissions after preemption).", cache.get("hit_tokens", 0)))
        counters.append(("k3_prefix_cache_evictions_total", "Prefix-cache entries evicted.", cache.get("evictions", 0)))
        for name, (hlp, value) in (extra_counters or {}).items():
            counters.append((name, hlp, value))
        for name, hlp, value in counters:
            lines += [f"# HELP {name} {hlp}", f"# TYPE {name} counter", f"{name} {_fmt(value)}"]
        page_bytes = int(cache.get("page_bytes", 0))
        num_pages = int(cache.get("num_pages", 0))
        free = int(cache.get("free_pages", 0))
        gauges = [
            ("k3_requests_running", "Requests admitted into the cache and being processed.", running),
            ("k3_requests_waiting", "Requests waiting for admission.", waiting),
            ("k3_cache_pages_total", "Pages in the cache pool.", num_pages),
            ("k3_cache_pages_free", "Pages held by nothing.", free),
            ("k3_cache_pages_evictable", "Pages held only by the prefix cache (reclaimable).",
             int(cache.get("evictable_pages", 0))),
            ("k3_cache_page_bytes", "Bytes per page.", page_bytes),
            ("k3_cache_bytes", "Bytes of the cache pool.", int(cache.get("pool_bytes", num_pages * page_bytes))),
            ("k3_cache_used_bytes", "Bytes of pages not free (running requests and the prefix cache).",
             (num_pages - free) * page_bytes),
            ("k3_prefix_cache_blocks", "Hash blocks indexed by the prefix cache.", int(cache.get("cached_blocks", 0))),
            ("k3_prefix_cache_checkpoints", "KDA state checkpoints held by the prefix cache.",
             int(cache.get("checkpoints", 0))),
            ("k3_spec_mean_accepted_length", "Tokens emitted per speculative verification (accepted drafts + 1; 0 "
             "before the first).", float(mean_accepted)),
        ]
        for name, hlp, value in gauges:
            lines += [f"# HELP {name} {hlp}", f"# TYPE {name} gauge", f"{name} {_fmt(value)}"]
        if switch:  # speculation on or off per decode batch size (k3.serve.speculative.switch), labelled by bucket
            labelled = [
                ("k3_spec_auto_enabled", "Speculation per decode batch-size bucket (le: its largest batch): 1 on, 0 "
                 "off (measured slower), -1 still probing.", lambda st: -1 if st["speculative"] is None
                 else int(st["speculative"])),
                ("k3_spec_auto_tokens_per_second", "Median tokens emitted per second of decode-only steps, by bucket "
                 "and arm (NaN before a measurement).", None),
            ]
            for name, hlp, value in labelled:
                lines += [f"# HELP {name} {hlp}", f"# TYPE {name} gauge"]
                for le, st in switch.items():
                    if value is not None:
                        lines.append(f'{name}{{le="{le}"}} {_fmt(value(st))}')
                    else:
                        for arm in ("spec", "plain"):
                            v = st[f"{arm}_tokens_per_s"]
                            lines.append(f'{name}{{le="{le}",arm="{arm}"}} {_fmt(float("nan") if v is None else v)}')
        return "\n".join(lines) + "\n"


def render_metrics(engine, extra_counters: dict | None = None) -> str:
    """One-off rendering (histograms rebuilt from all samples); a server keeps a MetricsExporter instead."""
    return MetricsExporter(engine).render(extra_counters)
