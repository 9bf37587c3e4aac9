"""The router's Prometheus text (format 0.0.4) for GET /metrics: per backend (label `backend`, its URL) and per
request class (label `class`). Every name starts with `k3_route_`."""

from __future__ import annotations

import bisect

from k3.route.budget import Admission
from k3.route.fleet import Fleet
from k3.serve.metrics import CONTENT_TYPE, LATENCY_BUCKETS

__all__ = ["CONTENT_TYPE", "Histogram", "render"]

BACKEND_COUNTERS = (
    ("k3_route_backend_requests_total", "requests", "Requests sent to the backend (retries included)."),
    ("k3_route_backend_errors_total", "errors",
     "Requests that failed on the backend (connection refused or lost, HTTP 502/503/504)."),
    ("k3_route_backend_affinity_hits_total", "affinity_hits", "Requests the backend answered as the session's primary."),
    ("k3_route_backend_failovers_total", "failovers",
     "Requests of sessions whose primary is the backend, sent to another one because it was down."),
    ("k3_route_backend_retries_total", "retries", "Requests retried on another backend after failing on this one."),
    ("k3_route_backend_marked_down_total", "marked_down", "Times the backend was marked down."),
)
BACKEND_GAUGES = (
    ("k3_route_backend_healthy", lambda b: int(b.healthy), "1 when the backend is up, 0 when down."),
    ("k3_route_backend_in_flight", lambda b: b.in_flight, "Requests being answered by the backend."),
)
CLASS_COUNTERS = (
    ("k3_route_class_admitted_total", "admitted", "Requests admitted."),
    ("k3_route_class_queued_total", "queued", "Requests that waited in the queue (admitted later or not)."),
    ("k3_route_class_rejected_total", "rejected", "Requests refused with 429 (the queue was full or the wait too long)."),
    ("k3_route_class_queue_wait_seconds_total", "wait_seconds", "Seconds admitted requests waited in the queue."),
)
CLASS_GAUGES = (
    ("k3_route_class_queue", lambda c: sum(1 for _, f in c.waiters if not f.done()), "Requests waiting now."),
    ("k3_route_class_running", lambda c: c.running, "Requests admitted and not finished."),
    ("k3_route_class_in_flight_tokens", lambda c: c.in_flight, "Estimated prompt tokens of the running requests."),
    ("k3_route_class_budget_tokens", lambda c: c.budget, "The class's budget of in-flight prompt tokens."),
)


class Histogram:
    """Cumulative-bucket histogram of seconds (LATENCY_BUCKETS)."""

    def __init__(self):
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, v)] += 1
        self.sum += v

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(LATENCY_BUCKETS, self.counts):
            acc += c
            out.append(f'{name}_bucket{{{labels},le="{_fmt(b)}"}} {acc}')
        acc += self.counts[-1]
        out += [f'{name}_bucket{{{labels},le="+Inf"}} {acc}', f"{name}_sum{{{labels}}} {_fmt(self.sum)}",
                f"{name}_count{{{labels}}} {acc}"]
        return out


def _fmt(v) -> str:
    return str(v) if isinstance(v, int) else repr(float(v))


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(fleet: Fleet, admission: Admission, first_output: dict[str, Histogram],
           extra_counters: dict | None = None) -> str:
    """`first_output`: per class, seconds from a request's arrival at the router to its first output sent."""
    lines: list[str] = []
    backends = list(fleet.backends.values())
    for name, attr, hlp in BACKEND_COUNTERS:
        lines += [f"# HELP {name} {hlp}", f"# TYPE {name} counter"]
        lines += [f'{name}{{backend="{_label(b.url)}"}} {getattr(b, attr)}' for b in backends]
    for name, fn, hlp in BACKEND_GAUGES:
        lines += [f"# HELP {name} {hlp}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{backend="{_label(b.url)}"}} {fn(b)}' for b in backends]
    for name, attr, hlp in CLASS_COUNTERS:
        lines += [f"# HELP {name} {hlp}", f"# TYPE {name} counter"]
        lines += [f'{name}{{class="{c.name}"}} {_fmt(getattr(c, attr))}' for c in admission.classes]
    for name, fn, hlp in CLASS_GAUGES:
        lines += [f"# HELP {name} {hlp}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{class="{c.name}"}} {fn(c)}' for c in admission.classes]
    name = "k3_route_time_to_first_output_seconds"
    lines += [(f"# HELP {name} Time from a request's arrival at the router (queue included) to its first output "
              f"sent (a stream's first output event, or a whole answer)."), f"# TYPE {name} histogram"]
    for c in admission.classes:
        lines += first_output[c.name].lines(name, f'class="{c.name}"')
    for name, (hlp, value) in (extra_counters or {}).items():
        lines += [f"# HELP {name} {hlp}", f"# TYPE {name} counter", f"{name} {_fmt(value)}"]
    return "\n".join(lines) + "\n"
