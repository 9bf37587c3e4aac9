"""What a training run shows while it runs: `metrics.jsonl` (one JSON line per logged step and evaluation),
`loss.png` (training and held-out loss, redrawn at every evaluation), the progress bar, and the data plan
(tokens available, tokens per step, epochs planned, with a warning when the run would repeat its data more
than `EPOCHS_WARNING` times: a model that sees its data that often memorizes it, and its held-out loss rises)."""

from __future__ import annotations

import json
import os

from k3.files import atomic_write_text


class MetricsLog:
    """Appends records to `OUT/metrics.jsonl`, each flushed at once (a killed run keeps every line written), and
    to `history`; redraws `OUT/loss.png` whenever a record carries a held-out loss. The file is open inside
    `with`."""

    def __init__(self, out: str, history: list[dict], log=print, enabled: bool = True):
        self.enabled = enabled  # False: records go to `history` only (the non-writing ranks of a distributed run)
        self.path = os.path.join(out, "metrics.jsonl")
        self.png_path = os.path.join(out, "loss.png")
        self.history, self.log = history, log
        self.last_val_loss: tuple[int, float] | None = None  # (step, val_loss) of the last kept record (resume_at)
        self._f = None

    def resume_at(self, step: int) -> int:
        """Drop the records of steps after `step` (a run resumed from its checkpoint of `step` trains them again;
        kept, they would appear twice). Rewrites the file atomically; returns how many records were dropped. A line
        that is not JSON (a run killed mid-write) is dropped too."""
        if not self.enabled or not os.path.isfile(self.path):
            return 0
        kept, dropped = [], 0
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    dropped += 1
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
                    dropped += 1
                else:
                    kept.append(line if line.endswith("\n") else line + "\n")
                    if isinstance(rec, dict) and isinstance(rec.get("val_loss"), (int, float)):
                        self.last_val_loss = (rec.get("step"), float(rec["val_loss"]))
        if dropped:
            atomic_write_text(self.path, "".join(kept))
        return dropped

    def __enter__(self) -> "MetricsLog":
        if self.enabled:
            self._f = open(self.path, "a", encoding="utf-8")
        return self

    def __exit__(self, *exc) -> None:
        if self._f is not None:
            self._f.close()
        self._f = None

    def record(self, rec: dict) -> None:
        self.history.append(rec)
        if not self.enabled:
            return
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        if "val_loss" in rec:
            self.plot()

    def plot(self) -> None:
        if not self.enabled:
            return
        try:
            plot_metrics(self.path, self.png_path)
        except Exception as e:  # a plot must never stop training
            self.log(f"(could not update loss.png: {e})")


def plot_metrics(metrics_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses, vsteps, vlosses = [], [], [], []
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                steps.append(r["step"])
                losses.append(r["loss"])
            if "val_loss" in r:
                vsteps.append(r["step"])
                vlosses.append(r["val_loss"])
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        ax.plot(steps, losses, lw=0.8, label="train")
    if vsteps:
        ax.plot(vsteps, vlosses, "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    if steps or vsteps:  # a run stopped before its first step and evaluation has nothing to label
        ax.legend()
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)


class ProgressBar:
    """tqdm bar showing step, loss, tokens/s, lr and the remaining time (by steps, or by the time budget when the
    run has no step limit)."""

    def __init__(self, max_steps: int | None, max_minutes: float | None, start: int, enabled: bool):
        self.max_steps, self.max_minutes = max_steps, max_minutes
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, initial=start, unit="step", dynamic_ncols=True, leave=True)

    def update(self, m, elapsed: float) -> None:
        """One step done: `m` is its k3.train.trainer.StepMetrics, `elapsed` the run's training seconds so far."""
        if self.bar is None:
            return
        post = {"loss": f"{m.loss:.3f}", "tok/s": f"{m.tokens_per_s:,.0f}", "lr": f"{m.lr:.2e}"}
        post.update(m.progress_postfix() if hasattr(m, "progress_postfix") else {})  # a run's own rates (images)
        if self.max_steps is None and self.max_minutes is not None:
            post["left"] = f"{max(0.0, 60 * self.max_minutes - elapsed) / 60:.1f}min"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


EPOCHS_WARNING = 4.0  # passes over the training data beyond which a run is warned that it will memorize it


def _epochs_warning(epochs: float, data_flag: str = "--data") -> str:
    return (f"warning: this run repeats its training data {epochs:.1f} times (more than {EPOCHS_WARNING:g}): the "
            f"model will memorize it and its held-out loss will rise; add data ({data_flag}), or cap the run with "
            "--epochs, --max-steps or --max-minutes")


def plan_messages(tokens_per_epoch: int, tokens_per_step: int, steps: int | None, max_minutes: float | None,
                  project_at: int, data_flag: str = "--data") -> list[str]:
    """Lines the run prints before its first step: the data available and, for a run whose length is a step
    count (--max-steps, --epochs), the epochs it plans (with the warning, which names the command's data flag
    `data_flag`). A run bounded by time alone learns its epochs from its speed at step `project_at`
    (`projection_messages`)."""
    head = (f"data: {tokens_per_epoch:,} training tokens per epoch, {tokens_per_step:,} tokens per step "
            f"({tokens_per_epoch / tokens_per_step:,.1f} steps per epoch)")
    if steps is None:
        return [f"{head}; the run's length is --max-minutes {max_minutes:g}: its epochs are projected at step "
                f"{project_at}"]
    epochs = steps * tokens_per_step / tokens_per_epoch
    out = [f"{head}; {steps:,} steps planned = {epochs:.2f} epochs"]
    if epochs > EPOCHS_WARNING:
        out.append(_epochs_warning(epochs, data_flag))
    return out


def projection_messages(tokens_per_epoch: int, tokens_per_step: int, step: int, elapsed_s: float,
                        seconds_per_step: float, max_minutes: float, data_flag: str = "--data") -> list[str]:
    """The epochs a time-bounded run will reach at its measured speed, with the warning when too many."""
    steps = step + max(0.0, 60 * max_minutes - elapsed_s) / max(seconds_per_step, 1e-9)
    epochs = steps * tokens_per_step / tokens_per_epoch
    out = [f"data: at {seconds_per_step:.3g} s per step the {max_minutes:g}-minute budget comes to ~{steps:,.0f} "
           f"steps = ~{epochs:.2f} epochs"]
    if epochs > EPOCHS_WARNING:
        out.append(_epochs_warning(epochs, data_flag))
    return out
