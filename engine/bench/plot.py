"""`--plot out.png`: bars per backend for offline modes, latency CDFs for serve."""

from __future__ import annotations

import os

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, names, values, title, unit):
    bars = ax.bar(names, values, color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"][: len(names)])
    ax.set_title(title)
    ax.set_ylabel(unit)
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom")


def _save(plt, fig, path: str) -> None:
    """A PNG at `path` (.png added where it has no extension, as matplotlib would), said with its real name."""
    path = path if os.path.splitext(path)[1] else path + ".png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def plot_throughput(results: list[dict], path: str) -> None:
    plt = _pyplot()
    ok = [r for r in results if "metrics" in r]
    names = [r["backend"] for r in ok]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    _bars(axes[0], names, [r["metrics"]["requests_per_s"] for r in ok], "requests / s", "req/s")
    _bars(axes[1], names, [r["metrics"]["output_tokens_per_s"] for r in ok], "output tokens / s", "tok/s")
    _bars(axes[2], names, [r["metrics"]["total_tokens_per_s"] for r in ok], "total tokens / s", "tok/s")
    _bars(axes[3], names, [r["startup_s"] for r in ok], "start-up (outside the window)", "s")
    fig.tight_layout()
    _save(plt, fig, path)


def plot_latency(results: list[dict], path: str, percentiles: list[float]) -> None:
    plt = _pyplot()
    ok = [r for r in results if "e2e" in r]
    keys = ["mean_ms", *(f"p{q:g}_ms" for q in percentiles)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric in zip(axes, ("e2e", "ttft", "tpot")):
        x = np.arange(len(keys))
        width = 0.8 / max(1, len(ok))
        for i, r in enumerate(ok):
            ax.bar(x + i * width, [r[metric][k] for k in keys], width, label=r["backend"])
        ax.set_xticks(x + width * (len(ok) - 1) / 2, [k.replace("_ms", "") for k in keys])
        ax.set_title(f"{metric.upper()} (ms)")
        ax.legend()
    fig.tight_layout()
    _save(plt, fig, path)


def plot_serve(runs: dict[str, dict[str, list[float]]], path: str) -> None:
    """Empirical CDFs of per-request TTFT / TPOT / E2EL and pooled ITL, one line per run (ms)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, key in zip(axes, ("ttft", "tpot", "itl", "e2el")):
        for label, samples in runs.items():
            v = np.sort(np.asarray(samples.get(key, []), dtype=np.float64) * 1000.0)
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)
        ax.set_title(f"{key.upper()} CDF")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    _save(plt, fig, path)
