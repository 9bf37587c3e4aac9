"""`reward.png` of a `k3 rl` run: the trained reward and success per step, and held-out success per evaluation."""

from __future__ import annotations

import json
import os


def read_metrics(path: str) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a killed run
    return out


def plot_rl(metrics_path: str, png_path: str, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    steps = [r["step"] for r in recs if "reward" in r]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if steps:
        ax.plot(steps, [r["reward"] for r in recs if "reward" in r], lw=0.8, label="trained reward")
        ax.plot(steps, [r["success"] for r in recs if "reward" in r], lw=0.8, label="rollout success")
    vals = [(r["step"], r["val_success"]) for r in recs if "val_success" in r]
    if vals:
        ax.plot([s for s, _ in vals], [v for _, v in vals], "o-", label="held-out success")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / success rate")
    ax.grid(alpha=0.3)
    if steps or vals:
        ax.legend()
    if steps:
        ax2.plot(steps, [r["response_len"] for r in recs if "reward" in r], lw=0.8, label="tokens per trajectory")
        ax2.set_ylabel("tokens")
        ax3 = ax2.twinx()
        ax3.plot(steps, [r.get("staleness", 0.0) for r in recs if "reward" in r], color="tab:red", lw=0.8,
                 label="staleness (versions)")
        ax3.set_ylabel("mean staleness of trained tokens")
        ax2.legend(loc="upper left")
        ax3.legend(loc="upper right")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
