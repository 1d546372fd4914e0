"""Tests for megacritic.plots: training curves from a metrics.jsonl."""

import json
import math

from megacritic.plots import plot_training_curves, read_curves


def write_metrics(path, n=20):
    with open(path, "w") as f:
        for step in range(1, n + 1):
            record = {
                "step": step,
                "iteration": step,
                "critic/vf_loss": 0.5 * math.exp(-step / 5),
                "critic/vf_explained_var": 1 - math.exp(-step / 5) if step != 3 else None,
                "critic/grad_norm": float("nan") if step == 4 else 1.0 / step,   # a skipped step
                "critic/vf_clipfrac": [0.1, 0.3],
            }
            f.write(json.dumps(record) + "\n")
        f.write("\n")
        f.write(json.dumps({"note": "no step here"}) + "\n")


def test_read_curves_skips_null_and_non_finite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path)
    curves = read_curves(path)
    assert curves["critic/vf_loss"][0] == list(range(1, 21))
    assert 3 not in curves["critic/vf_explained_var"][0] and len(curves["critic/vf_explained_var"][0]) == 19
    assert 4 not in curves["critic/grad_norm"][0]
    assert curves["critic/vf_clipfrac"][1][0] == 0.2


def test_plot_writes_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path)
    out = plot_training_curves(str(path), str(tmp_path / "plots" / "curves.png"))
    data = out.read_bytes()
    assert len(data) > 10_000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_with_missing_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "critic/vf_loss": 0.0}) + "\n")   # not positive: linear scale
    out = plot_training_curves(path, tmp_path / "c.png")
    assert out.stat().st_size > 0
