"""The benchmark script runs end to end on CPU (tiny shape) and writes the documented row format."""

import json

import pytest

from megacritic import bench
from megacritic.bench import results, runner


def test_rollouts_are_verl_layout_and_long_tailed():
    batch = bench.rollouts(256, 1000, 1024, 8192)
    r_len = batch["attention_mask"][:, 1024:].sum(1).float()
    assert r_len.min() >= 16 and r_len.max() <= 8192
    assert 600 < r_len.median() < 1600  # median near 1024
    from megacritic.data.rollouts import rollouts_from_batch
    rollouts_from_batch(batch, need_targets=True, vocab_size=1000)  # a valid critic batch


def test_the_gpu_rollouts_are_those_of_every_recorded_run():
    """The 32 seeded rollouts of the GPU shapes: 74,078 real tokens, the same token ids (bench/results)."""
    batch = bench.rollouts(32, 151936, 1024, 8192)
    assert int(batch["attention_mask"].sum()) == 74078
    assert int(batch["input_ids"].sum()) == 5613285287
    assert int(bench.rollouts(32, 152064, 1024, 8192)["attention_mask"].sum()) == 74078  # 7B's vocabulary


def test_forward_flops_counts_matmuls_and_causal_attention():
    from megacritic.flops import forward_flops
    shape = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=16, vocab_size=10)
    per_token = 2 * (8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16 + 8)
    assert forward_flops(shape, [3]) == per_token * 3 + 2 * 2 * 8 * (3 * 4 / 2)


@pytest.mark.slow
def test_bench_writes_rows(tmp_path):
    out = tmp_path / "cpu.json"
    assert bench.main(["--shapes", "tiny", "--rollouts", "8", "--processes", "1", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["machine"] == "cpu" and "commit" in run and "dirty" in run
    rows = run["rows"]
    assert {(r["system"], r["phase"]) for r in rows} == {
        (s, p) for s in bench.SYSTEMS for p in ("update_critic", "compute_values")}
    assert run["environment"]["attention_auto"] == "sdpa" and len(run["parts"]) == 1
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


def _part(tmp_path, name, rows, **run):
    path = tmp_path / f"{name}.json"
    base = {"machine": "m", "device": "d", "commit": "aaa", "dirty": False, "environment": {"attention_auto": "fa4"},
            "command": f"megacritic bench {name}", "started": "t"}
    path.write_text(json.dumps({**base, **run, "rows": [dict(system="s", phase="p", **r) for r in rows]}))
    return str(path)


def test_parts_of_one_run_merge_into_one_file(tmp_path):
    a = _part(tmp_path, "a", [{"model": "0.5b"}, {"model": "1.5b", "token_budget": 16384}])
    b = _part(tmp_path, "b", [{"model": "1.5b", "token_budget": 32768}], dirty=None)  # --commit: unknown tree
    out = tmp_path / "merged.json"
    results.merge([a, b], str(out))
    merged = json.loads(out.read_text())
    assert [(r["model"], r.get("token_budget")) for r in merged["rows"]] == [
        ("0.5b", None), ("1.5b", 16384), ("1.5b", 32768)]
    assert merged["commit"] == "aaa" and [p["command"] for p in merged["parts"]] == [
        "megacritic bench a", "megacritic bench b"]
    again = tmp_path / "again.json"
    results.merge([str(out), _part(tmp_path, "c", [{"model": "3b"}])], str(again))  # a merged file is a part too
    assert len(json.loads(again.read_text())["parts"]) == 3


@pytest.mark.parametrize("other, message", [
    (dict(commit="bbb"), "commit 'bbb' differs"),
    (dict(dirty=True), "uncommitted changes"),
    (dict(commit=None), "no commit recorded"),
    (dict(machine="other"), "machine 'other' differs"),
    (dict(environment={"attention_auto": "fa2"}), "environment .* differs"),
])
def test_parts_of_another_commit_or_kernels_are_refused(tmp_path, other, message):
    a = _part(tmp_path, "a", [{"model": "0.5b"}])
    b = _part(tmp_path, "b", [{"model": "3b"}], **other)
    out = tmp_path / "merged.json"
    with pytest.raises(results.ResultsError, match=message):
        results.merge([a, b], str(out))
    assert not out.exists()
    assert bench.main(["--merge", a, b, "--out", str(out)]) == 2 and not out.exists()


def test_a_row_in_two_parts_is_refused(tmp_path):
    a = _part(tmp_path, "a", [{"model": "0.5b"}])
    b = _part(tmp_path, "b", [{"model": "0.5b"}])
    with pytest.raises(results.ResultsError, match="both hold the row"):
        results.merge([a, b], str(tmp_path / "merged.json"))


def test_markdown_table_has_one_line_per_packed_row_and_the_speedup_over_hf():
    def row(system, phase, tok_s, budget=None):
        r = {"system": system, "model": "qwen2.5-1.5b", "phase": phase, "real_tokens_per_s": tok_s, "mfu": 0.5,
             "peak_mem_gib": 50.0, "seconds": 1.0, "seconds_min": 0.9, "seconds_max": 1.1,
             "process_medians": [1.0, 1.02]}
        return {**r, "token_budget": budget} if budget else r
    rows = [row("megacritic-packed", "update_critic", 47500, 16384), row("megacritic-packed", "update_critic",
                                                                          50000, 32768),
            row("hf-sdpa-padded", "update_critic", 6800)]
    lines = results.markdown({"rows": rows}).splitlines()
    assert len(lines) == 4 and "| 1.5B | update_critic | 16,384 | 47.5k | 0.500 |" in lines[2]
    assert lines[2].endswith("| 6.8k | 7.0x |") and lines[3].endswith("| 6.8k | 7.4x |")


def test_child_processes_get_their_own_shape_system_and_budget():
    argv = ["--shapes", "a,b", "--systems=x", "--token-budget", "1,2", "--out", "f", "--set", "k=v", "--processes", "3"]
    assert runner._child_argv(argv) == ["--set", "k=v", "--processes", "3"]


@pytest.mark.slow
def test_moe_gpu_script_runs_its_cpu_tiny_path():
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).parents[1] / "bench" / "moe_gpu.py"
    proc = subprocess.run([sys.executable, str(script), "--cpu-tiny"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "update_critic" in proc.stdout and "real tokens/s" in proc.stdout


def test_cuda_graphs_are_megacritic_packed_own_switch_at_the_small_shape():
    """The offload and padded systems cannot run with model.cuda_graphs (config validation refuses it)."""
    from megacritic.bench.workloads import system_switches

    assert {"model.cuda_graphs=true", "model.cuda_graph_pack_multiple=128"} <= set(
        system_switches("qwen2.5-0.5b", "megacritic-packed", []))
    for system in ("megacritic-offload", "megacritic-padded"):
        assert "model.cuda_graphs=true" not in system_switches("qwen2.5-0.5b", system, [])
    assert "model.cuda_graphs=true" not in system_switches("qwen2.5-1.5b", "megacritic-packed", [])
