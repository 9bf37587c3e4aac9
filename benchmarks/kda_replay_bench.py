"""KDA rollback by replay (report §5.4.2): the fused replay kernel's state bandwidth against a copy of the state.

    python benchmarks/kda_replay_bench.py [--requests 1 16 64] [--heads 8] [--head-dim 128] [--accepted 4]
                                          [--window 4] [--runs 50]

For one KDA layer of k3-mini's shape (8 heads of 128 x 128 fp32 state per request by default), `--requests` rows
each replay `--accepted` of a `--window`-position verification from their committed state. Side by side in one run:
``triton`` (k3.ops.kda_replay.kda_replay_triton: the state read once and written once), ``torch`` (the reference,
kda_replay), ``copy`` (state.clone(): the bandwidth ceiling for reading and writing the state once) and the report's
form, the replay fused into the next verification (k3.ops.kda_verify_replay_triton: the `--accepted` pending positions
then a `--window`-position verification in one pass, the state read once and written once): ``verify_replay``, with
``verify`` (the same kernel with nothing pending: the verification alone, the state still read and written once) beside it, so the replay's own
cost in the fused form is verify_replay - verify. Bandwidth
counts the state's bytes read + written (the per-position inputs are a few percent more). The issue's goal: the
replay kernel at >= 80% of copy bandwidth. Medians of CUDA-event timings after a warm-up; one JSON line per case.

`--timing graph` (the default) times each arm as the serving engine runs it, inside a CUDA graph (`--graph-calls`
calls captured once, the replays timed, the time per call reported; the verification's pending counts as a device
tensor, as the engine's captured verification passes them): the GPU's time alone. `--timing eager` times the calls
as Python makes them, so the host's launches of the op's PyTorch part (the conv tail, the window's conv) count too.
An arm that cannot be captured is timed eagerly and says so (`"timing": "eager"` in its line).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from k3.ops.kda_replay import kda_replay, kda_replay_triton
from k3.ops.kda_verify_replay import kda_verify_replay_triton


def timed(fn, runs: int, calls: int = 1, graph: bool = False) -> tuple[float, str]:
    """(median seconds per call of `fn`, "graph" or "eager"): with `graph`, `calls` calls captured in one CUDA graph
    and its replays timed; an arm whose capture fails is timed eagerly."""
    fn()
    torch.cuda.synchronize()
    how = "eager"
    run = fn
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls):
                    fn()
            run, how = g.replay, "graph"
        except RuntimeError as e:
            print(json.dumps({"capture_failed": str(e).splitlines()[0][:200]}), flush=True)
            torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / (calls if how == "graph" else 1))
    return statistics.median(times), how


def main() -> None:
    from k3.cli_args import RawDefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--conv-channels", type=int, default=1024)
    ap.add_argument("--accepted", type=int, default=4)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--timing", choices=["graph", "eager"], default="graph",
                    help="graph: inside a CUDA graph (the GPU's time); eager: as Python calls it (host launches too)")
    ap.add_argument("--graph-calls", type=int, default=10, help="calls captured per graph (--timing graph)")
    args = ap.parse_args()
    if args.graph_calls < 1 or args.runs < 1:
        raise SystemExit("--graph-calls and --runs must be >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("kda_replay_bench.py measures GPU bandwidth: it needs a CUDA device")
    H, K, L, P = args.heads, args.head_dim, args.window, args.conv_channels
    g = torch.Generator(device="cuda").manual_seed(0)
    for N in args.requests:
        def r(*shape, dtype=torch.bfloat16):
            return torch.randn(*shape, generator=g, device="cuda").to(dtype)

        a = (r(N, L, H, K), r(N, L, H, K), r(N, L, H, K), r(N, L, H, K), r(N, L, H), r(N, L, 3, P),
             r(H, dtype=torch.float32) * 0.5, r(H * K, dtype=torch.float32), -5.0, r(N, H, K, K, dtype=torch.float32),
             r(N, 3, P, 3, dtype=torch.float32))
        q, k, v, z, beta, pre, A_log, dt_bias, lb, state, conv = a
        lengths = [args.accepted] * N
        state_bytes = 2 * state.numel() * 4  # read + write
        # the fused form: pending post-conv k, v, decay logits, beta logits and pre-conv inputs, then the window's
        # pre-conv inputs, decay and beta logits; the conv weight [3, H*K, W] of a width-4 short conv
        A = args.accepted
        pend = (r(N, A, H, K), r(N, A, H, K), r(N, A, H, K), r(N, A, H), r(N, A, 3, H * K))
        win = (r(N, L, 3, H * K), r(N, L, H, K), r(N, L, H), r(3, H * K, 4, dtype=torch.float32))
        gate = (A_log, dt_bias, lb, state, torch.zeros(N, 3, H * K, 3, device="cuda"))
        none = tuple(x[:, :0] for x in pend)
        # the pending counts on the device, as the engine's captured verification passes them
        dev_lengths = torch.full((N,), args.accepted, dtype=torch.int32, device="cuda")
        dev_none = torch.zeros(N, dtype=torch.int32, device="cuda")
        graph = args.timing == "graph"
        arms = {"triton": lambda: kda_replay_triton(*a, lengths),
                "torch": lambda: kda_replay(*a, lengths),
                "copy": lambda: state.clone(),
                "verify_replay": lambda: kda_verify_replay_triton(*pend, dev_lengths if graph else lengths, *win,
                                                                  *gate),
                "verify": lambda: kda_verify_replay_triton(*none, dev_none if graph else [0] * N, *win, *gate)}
        # the reference last: a capture that fails (host reads) cannot then disturb the arms after it
        rows = {name: timed(arms[name], args.runs, args.graph_calls, graph)
                for name in ("copy", "verify_replay", "verify", "triton", "torch")}
        for name, (s, how) in rows.items():
            print(json.dumps(dict(requests=N, impl=name, us=round(s * 1e6, 2), state_gb_per_s=round(
                state_bytes / s / 1e9, 1), share_of_copy=round(rows["copy"][0] / s, 3), accepted=args.accepted,
                timing=how, device=torch.cuda.get_device_name())), flush=True)


if __name__ == "__main__":
    main()
