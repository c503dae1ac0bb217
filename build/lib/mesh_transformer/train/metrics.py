"""Where training metrics go: a live terminal line, metrics.jsonl, TensorBoard, and W&B if asked.

`metrics.jsonl` (one JSON object per logged step) is the record every other view is made from;
`plot_metrics` renders it to a PNG.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional


class MetricsLogger:
    def __init__(self, log_dir: str | os.PathLike, run_name: str, wandb_project: Optional[str] = None,
                 config: Optional[dict] = None, tensorboard: bool = True, live: bool = True):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.dir / "metrics.jsonl", "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                print("wandb_project is set but wandb is not installed (pip install wandb); not logging to W&B",
                      file=sys.stderr)
            else:
                self._wandb = wandb.init(project=wandb_project, name=run_name, config=config, resume="allow")
        self._live = live and sys.stdout.isatty()
        self._start = time.time()

    def log(self, step: int, values: dict) -> None:
        values = {k: float(v) for k, v in values.items()}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def progress(self, step: int, total: int, values: dict) -> None:
        """One status line, rewritten in place on a terminal, printed every call otherwise."""
        parts = [f"step {step}/{total}"]
        for key, fmt in (("train/loss", ".4f"), ("grad_norm", ".3f"), ("learning_rate", ".2e"),
                         ("tokens_per_sec", ".0f"), ("tokens_processed", ".3g")):
            if key in values:
                parts.append(f"{key.split('/')[-1]} {values[key]:{fmt}}")
        for key, value in values.items():
            if key.startswith(("val/", "eval/")):
                parts.append(f"{key} {value:.4f}")
        line = " | ".join(parts)
        if self._live:
            sys.stdout.write("\r\033[K" + line)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def message(self, text: str) -> None:
        if self._live:
            sys.stdout.write("\r\033[K")
        print(text, flush=True)

    def close(self) -> None:
        if self._live:
            sys.stdout.write("\n")
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_path: str | os.PathLike, out_png: str | os.PathLike) -> Path:
    """Train and validation loss against step, as a PNG; with eval_harness_tasks logged, their
    metrics (eval/<task>/<metric>) in a second panel beside it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path}: no metrics logged yet")
    evals = sorted({k for r in rows for k in r if k.startswith("eval/")})
    fig, axes = plt.subplots(1, 2 if evals else 1, figsize=(13 if evals else 7, 4), dpi=120, squeeze=False)
    series = sorted({k for r in rows for k in r if k == "train/loss" or k.startswith("val/")})
    _panel(axes[0][0], rows, series, "loss (nats/token)", marked="val/")
    if evals:
        _panel(axes[0][1], rows, evals, "lm-eval metric", marked="eval/")
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return Path(out_png)


def _panel(ax, rows: list[dict], keys: list[str], ylabel: str, marked: str) -> None:
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*points), label=key, marker="o" if key.startswith(marked) else None, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
