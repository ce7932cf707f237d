"""Charts of a load run (matplotlib, Agg backend, imported only when drawing).

Latency CDFs (TTFT, ITL, e2e; one line per point), acceptance by draft position, the split of a round's wall time
(exposed draft, verify, state refresh, other), and for QPS sweeps output throughput and p95 ITL against offered
QPS, one line per speculation mode. Every function takes the points of a run and the PNG path to write.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.load.sweep import Point, mode_name


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(axis, values: Sequence[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        axis.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=label)


def plot_latency_cdfs(points: Sequence[Point], path: Path) -> Path:
    plt = _pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for run, summary in points:
        done = [r for r in run.measured if r.ok]
        _cdf(axes[0], [1e3 * r.ttft_s for r in done if r.ttft_s is not None], summary["label"])
        _cdf(axes[1], [1e3 * gap for r in done for gap in r.itl_s], summary["label"])
        _cdf(axes[2], [1e3 * r.e2el_s for r in done], summary["label"])
    for axis, title in zip(axes, ("TTFT", "inter-token latency (chunk gaps)", "end-to-end latency"), strict=True):
        axis.set(title=title, xlabel="ms", ylabel="fraction of requests" if axis is axes[0] else "fraction")
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize="small")
    return _save(figure, path)


def plot_acceptance(points: Sequence[Point], path: Path) -> Path:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    for _, summary in points:
        rates = summary["acceptance_by_position"]
        if rates:
            axis.plot(range(1, len(rates) + 1), rates, marker="o", label=summary["label"])
    axis.set(title="acceptance by draft position", xlabel="position", ylabel="rounds accepting it / rounds")
    axis.grid(alpha=0.3)
    if axis.lines:
        axis.legend(fontsize="small")
    return _save(figure, path)


def plot_round_split(points: Sequence[Point], path: Path) -> Path:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(max(6, 1.2 * len(points)), 4))
    labels = [summary["label"] for _, summary in points]
    bottom = [0.0] * len(points)
    parts = ("exposed_draft", "verify", "state", "other")
    for part in parts:
        heights = [max(0.0, summary[f"{part}_ms_per_round"] or 0.0) for _, summary in points]
        axis.bar(labels, heights, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axis.set(title="wall time per round", ylabel="ms / round")
    axis.legend(fontsize="small")
    axis.tick_params(axis="x", labelrotation=30)
    return _save(figure, path)


def plot_sweep(points: Sequence[Point], key: str, ylabel: str, path: Path) -> Path:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    modes = dict.fromkeys(mode_name(summary["speculation"]) for _, summary in points)
    for mode in modes:
        series = [
            (s["request_rate"], s[key])
            for _, s in points
            if mode_name(s["speculation"]) == mode and isinstance(s["request_rate"], float | int) and s[key] is not None
        ]
        if series:
            axis.plot(*zip(*series, strict=True), marker="o", label=mode)
    axis.set(title=f"{ylabel} vs offered load", xlabel="offered QPS", ylabel=ylabel)
    axis.grid(alpha=0.3)
    if axis.lines:
        axis.legend(fontsize="small")
    return _save(figure, path)


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    _pyplot().close(figure)
    return path
