"""Training curves of a run, drawn from its ``metrics.jsonl`` (one JSON object per optimizer step).

Uses matplotlib's object-oriented API on the Agg canvas: no display is needed and pyplot's global state
(and backend choice) is left alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["PANELS", "plot_training_curves", "read_curves"]

# (metric, panel title); critic/vf_loss is drawn on a log scale when all its points are positive.
PANELS = (
    ("critic/vf_loss", "value loss"),
    ("critic/vf_explained_var", "explained variance"),
    ("critic/grad_norm", "gradient norm (before clipping)"),
    ("critic/vf_clipfrac", "value clip fraction"),
)


def _number(x) -> float | None:
    """A finite float from a metric entry (a number, or a list of numbers: their mean), else None."""
    if isinstance(x, list):
        xs = [v for v in (_number(v) for v in x) if v is not None]
        return sum(xs) / len(xs) if xs else None
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
        return float(x)
    return None


def read_curves(metrics_jsonl: str | Path, keys=tuple(k for k, _ in PANELS)) -> dict[str, tuple[list, list]]:
    """``{metric: (steps, values)}`` from a metrics file. Entries that are missing, null or not finite (a
    skipped step's NaN grad norm) are left out, as are lines without a numeric ``step`` and blank lines;
    a line that is not JSON raises ValueError naming it."""
    curves = {k: ([], []) for k in keys}
    with open(metrics_jsonl, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{metrics_jsonl}: line {lineno} is not valid JSON ({exc.msg})") from exc
            step = _number(record.get("step")) if isinstance(record, dict) else None
            if step is None:
                continue
            for k in keys:
                value = _number(record.get(k))
                if value is not None:
                    curves[k][0].append(step)
                    curves[k][1].append(value)
    return curves


def plot_training_curves(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """Draw a 2x2 PNG of ``critic/vf_loss`` (log scale if all positive), ``critic/vf_explained_var``,
    ``critic/grad_norm`` and ``critic/vf_clipfrac`` against ``step``; null or non-finite points are skipped
    and a metric without any point gets an empty panel saying so. Creates the parent folder of ``out_png``
    if needed and returns its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = read_curves(metrics_jsonl)
    fig = Figure(figsize=(10, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).flatten()
    for ax, (key, title) in zip(axes, PANELS):
        steps, values = curves[key]
        ax.set_title(f"{title}\n{key}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if not steps:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        ax.plot(steps, values, marker="." if len(steps) <= 50 else None, linewidth=1.2)
        if key == "critic/vf_loss" and all(v > 0 for v in values):
            ax.set_yscale("log")
    src = Path(metrics_jsonl)
    fig.suptitle(f"{src.parent.name}/{src.name}" if src.parent.name else src.name)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
