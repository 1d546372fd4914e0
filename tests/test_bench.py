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
    assert bench.main(["--shapes", "tiny", "--rollouts", "8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {(r["system"], r["phase"]) for r in rows} == {
        (s, p) for s in bench.SYSTEMS for p in ("update_critic", "compute_values")}
    for row in rows:
        assert {"system", "model", "phase", "real_tokens_per_s", "mfu", "peak_mem_gib"} <= row.keys()
        assert row["real_tokens_per_s"] > 0


@pytest.mark.slow
def test_moe_gpu_script_runs_its_cpu_tiny_path():
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).parents[1] / "bench" / "moe_gpu.py"
    proc = subprocess.run([sys.executable, str(script), "--cpu-tiny"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "update_critic" in proc.stdout and "real tokens/s" in proc.stdout
