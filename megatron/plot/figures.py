"""Figures of runs: one per quantity, every run on it with a legend; PNG files through Agg.

`build_figures` returns matplotlib `Figure` objects (made without pyplot, so nothing global is
touched and nothing needs a display), `write_figures` saves them. Each curve carries a gid that
says what it is, so that a test (or a notebook) can read the plotted points back:

    "<label>|raw"        the logged values (every figure)
    "<label>|smoothed"   their exponential moving average (loss, grad norm, tokens/s)
    "<label>|valid"      validation losses; "<label>|test": test losses (the loss figure)

The per-layer gradient norms are a heat map (layer group x step, logarithmic colours), one panel
per run that logged them, its `QuadMesh` with gid "<label>|layers"; a run with more than
`MAX_HEATMAP_COLUMNS` such lines shows that many of them, evenly spaced (each column still one
logged line, not an average).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

from megatron.plot.runs import Run


class MissingMatplotlib(ImportError):
    """matplotlib is not installed (the message says how to get it)."""


def require_matplotlib() -> None:
    """Raises MissingMatplotlib, naming the extra, when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingMatplotlib("plotting needs matplotlib: pip install 't5-pretrain[plot]' "
                                "(or pip install matplotlib)") from None


@dataclass(frozen=True)
class Quantity:
    name: str
    """The figure's name and file name (name.png)."""
    metric: str
    """The Run.train series drawn."""
    ylabel: str
    smoothed: bool
    """Noisy from step to step: also drawn smoothed."""


QUANTITIES = (
    Quantity("loss", "loss", "loss", True),
    Quantity("lr", "lr", "learning rate", False),
    Quantity("grad_norm", "grad_norm", "gradient norm (before clipping)", True),
    Quantity("tokens_per_s", "tokens_per_s", "tokens/s (encoder input, all ranks)", True),
    Quantity("memory", "memory_gib", "peak memory per device (GiB)", False),
)
X_LABELS = {"step": "step", "samples": "consumed samples", "tokens": "consumed tokens",
            "time": "hours in training steps (logged step times summed; evaluation, checkpoint "
                    "saves, start-up and restarts left out)"}
"""The time axis is not the job's elapsed time: see Run.x_values."""
LAYERS_FIGURE = "grad_norm_per_layer"
MAX_HEATMAP_COLUMNS = 2000


def smooth(values: Sequence[float], weight: float) -> List[float]:
    """TensorBoard's smoothing: an exponential moving average with weight `weight` in [0, 1),
    debiased so that the first points are not pulled towards 0. Non-finite values are passed
    through and do not enter the average."""
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1.0 - weight) * v
        n += 1
        out.append(last / (1.0 - weight ** n) if weight > 0 else v)
    return out


def build_figures(runs: Sequence[Run], x: str = "step",
                  smoothing: float = 0.6) -> Dict[str, "object"]:
    """{figure name: matplotlib Figure} for the quantities at least one run logged.

    x: 'step', 'samples', 'tokens' or 'time' (see Run.x_values); smoothing: the moving
    average's weight (0: raw curves only).
    Raises:
        MissingMatplotlib: matplotlib is not installed.
        ValueError: smoothing outside [0, 1), or an x axis a run cannot give (names the run).
    """
    require_matplotlib()
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    figures = {}
    for quantity in QUANTITIES:
        if any(run.train.get(quantity.metric) for run in runs) or (
                quantity.name == "loss" and any(run.evals for run in runs)):
            figures[quantity.name] = _line_figure(quantity, runs, x, smoothing)
    with_layers = [run for run in runs if run.layers]
    if with_layers:
        figures[LAYERS_FIGURE] = _layers_figure(with_layers, x)
    return figures


def _new_figure(height: float = 4.8, width: float = 8.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _finite(values: Sequence[float]) -> List[float]:
    return [v if math.isfinite(v) else float("nan") for v in values]


def _line_figure(quantity: Quantity, runs: Sequence[Run], x: str, smoothing: float):
    figure = _new_figure()
    ax = figure.add_subplot()
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        iterations, values = run.series(quantity.metric)
        if iterations:
            xs = run.x_values(iterations, x)
            if quantity.smoothed and smoothing > 0:
                ax.plot(xs, _finite(values), color=color, alpha=0.3, linewidth=1,
                        gid=f"{run.label}|raw")
                ax.plot(xs, _finite(smooth(values, smoothing)), color=color, linewidth=1.8,
                        label=run.label, gid=f"{run.label}|smoothed")
            else:
                ax.plot(xs, _finite(values), color=color, linewidth=1.5, label=run.label,
                        gid=f"{run.label}|raw")
        if quantity.name != "loss":
            continue
        for split, style in (("valid", dict(marker="o", linestyle="--")),
                             ("test", dict(marker="x", linestyle="none", markersize=9))):
            points = sorted(run.evals.get(split, {}).items())
            if points:
                its = [it for it, _ in points]
                ax.plot(run.x_values(its, x), _finite([v for _, v in points]), color=color,
                        label=f"{run.label} ({'validation' if split == 'valid' else 'test'})",
                        gid=f"{run.label}|{split}", **style)
    ax.set_xlabel(X_LABELS[x])
    ax.set_ylabel(quantity.ylabel)
    ax.set_title(quantity.ylabel + (f" (smoothing {smoothing:g})"
                                     if quantity.smoothed and smoothing > 0 else ""))
    ax.grid(True, alpha=0.3)
    points = sum(len(line.get_xdata()) for line in ax.get_lines())
    # "best" tries every place against every point: slow for long runs
    ax.legend(fontsize="small", loc="best" if points <= 2000 else "upper right")
    return figure


def _edges(xs: Sequence[float]) -> List[float]:
    """Cell edges around points xs (midpoints between neighbours; half a gap beyond the ends)."""
    if len(xs) == 1:
        half = max(abs(xs[0]) * 0.01, 0.5)
        return [xs[0] - half, xs[0] + half]
    mids = [(a + b) / 2 for a, b in zip(xs, xs[1:])]
    return [xs[0] - (mids[0] - xs[0])] + mids + [xs[-1] + (xs[-1] - mids[-1])]


def _layers_figure(runs: Sequence[Run], x: str):
    import numpy as np
    from matplotlib.colors import LogNorm

    groups_max = max(len({g for norms in run.layers.values() for g in norms}) for run in runs)
    figure = _new_figure(height=min(2.0 + 0.22 * groups_max, 12.0) * len(runs), width=9.0)
    axes = figure.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs):
        iterations = sorted(run.layers)
        if len(iterations) > MAX_HEATMAP_COLUMNS:
            keep = np.unique(np.linspace(0, len(iterations) - 1, MAX_HEATMAP_COLUMNS).round())
            iterations = [iterations[int(k)] for k in keep]
        groups: List[str] = []  # in the order the log lists them: embedding first
        for it in iterations:
            groups += [g for g in run.layers[it] if g not in groups]
        grid = np.full((len(groups), len(iterations)), np.nan)
        for j, it in enumerate(iterations):
            for g, value in run.layers[it].items():
                grid[groups.index(g), j] = value
        shown = np.ma.masked_where(~np.isfinite(grid) | (grid <= 0), grid)
        positive = shown.compressed()
        norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
        mesh = ax.pcolormesh(_edges(run.x_values(iterations, x)),
                             np.arange(len(groups) + 1), shown, norm=norm, cmap="viridis",
                             shading="flat")
        mesh.set_gid(f"{run.label}|layers")
        ax.set_yticks(np.arange(len(groups)) + 0.5, groups,
                      fontsize="x-small" if len(groups) > 20 else "small")
        ax.invert_yaxis()
        ax.set_xlabel(X_LABELS[x])
        ax.set_title(f"{run.label}: gradient norm per layer")
        figure.colorbar(mesh, ax=ax, label="gradient norm")
    return figure


def write_figures(figures: Dict[str, object], output: Path, dpi: int = 110) -> List[Path]:
    """Save each figure as output/<name>.png (written to a temporary name, then renamed, so
    that a viewer never sees half a file); returns the paths. Raises OSError."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, figure in figures.items():
        path = output / f"{name}.png"
        tmp = output / f".{name}.png.tmp"
        figure.savefig(tmp, dpi=dpi, format="png")
        os.replace(tmp, path)
        paths.append(path)
    return paths
