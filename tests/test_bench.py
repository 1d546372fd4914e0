"""The benchmark script runs end to end on CPU (tiny shape) and writes the documented row format."""

import json

import pytest

from megacritic import bench


def test_rollouts_are_verl_layout_and_long_tailed():
    batch = bench.rollouts(256, 1000, 1024, 8192)
    r_len = batch["attention_mask"][:, 1024:].sum(1).float()
    assert r_len.min() >= 16 and r_len.max() <= 8192
    assert 600 < r_len.median() < 1600  # median near 1024
    from megacritic.data.rollouts import rollouts_from_batch
    rollouts_from_batch(batch, need_targets=True, vocab_size=1000)  # a valid critic batch


def test_forward_flops_counts_matmuls_and_causal_attention():
    shape = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=16, vocab_size=10)
    per_token = 2 * (8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16 + 8)
    assert bench.forward_flops(shape, [3]) == per_token * 3 + 2 * 2 * 8 * (3 * 4 / 2)


@pytest.mark.slow
def test_bench_writes_rows(tmp_path):
    out = tmp_path / "cpu.json"
    assert bench.main(["--shapes", "tiny", "--rollouts", "8", "--processes", "1", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["machine"] == "cpu" and "commit" in run and "dirty" in run
    rows = run["rows"]
    assert {(r["system"], r["phase"]) for r in rows} == {
        (s, p) for s in bench.SYSTEMS for p in ("update_critic", "compute_values")}
    for row in rows:
        assert {"system", "model", "phase", "real_tokens_per_s", "mfu", "peak_mem_gib", "commit"} <= row.keys()
        assert row["real_tokens_per_s"] > 0
        assert row["seconds_min"] <= row["seconds"] <= row["seconds_max"]
        assert {"attention", "norm", "swiglu"} <= row["kernels"].keys()
    packed = next(r for r in rows if r["system"] == "megacritic-packed")
    assert packed["kernels"]["attention"] == "sdpa"  # CPU: the per-rollout SDPA loop


@pytest.mark.slow
def test_bench_reports_the_median_of_process_medians(tmp_path):
    out = tmp_path / "cpu.json"
    assert bench.main(["--shapes", "tiny", "--systems", "megacritic-packed", "--rollouts", "8", "--repeats", "3",
                       "--processes", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        assert row["processes"] == 2 and len(row["process_medians"]) == 2 and row["calls_per_process"] == 3
        assert row["seconds"] == pytest.approx(sum(row["process_medians"]) / 2)  # median of two
        assert row["seconds_min"] <= min(row["process_medians"]) and max(row["process_medians"]) <= row["seconds_max"]


def test_results_file_holds_one_commit(tmp_path):
    path = str(tmp_path / "r.json")
    run = {"machine": "m", "commit": "aaa", "dirty": False}
    bench._write(run, [{"model": "a", "system": "s", "phase": "p"}], path)
    bench._write(run, [{"model": "b", "system": "s", "phase": "p"}], path)  # a run in parts: both kept
    assert [r["model"] for r in json.loads(open(path).read())["rows"]] == ["a", "b"]
    bench._write(run, [{"model": "b", "system": "s", "phase": "q"}], path)  # the same shape again: replaced
    assert [(r["model"], r["phase"]) for r in json.loads(open(path).read())["rows"]] == [("a", "p"), ("b", "q")]
    bench._write({**run, "commit": "bbb"}, [{"model": "c", "system": "s", "phase": "p"}], path)
    data = json.loads(open(path).read())
    assert data["commit"] == "bbb" and [r["model"] for r in data["rows"]] == ["c"]  # another commit: afresh
    bench._write({**run, "commit": "bbb", "dirty": True}, [{"model": "d", "system": "s", "phase": "p"}], path)
    assert [r["model"] for r in json.loads(open(path).read())["rows"]] == ["d"]  # uncommitted: never merged


@pytest.mark.slow
def test_moe_gpu_script_runs_its_cpu_tiny_path():
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).parents[1] / "bench" / "moe_gpu.py"
    proc = subprocess.run([sys.executable, str(script), "--cpu-tiny"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "update_critic" in proc.stdout and "real tokens/s" in proc.stdout
