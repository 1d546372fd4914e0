"""`megacritic train` end to end: the embedded default learns; errors are clean; torchrun works."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

METRIC_NAMES = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
                "critic/vf_explained_var")


def _train(args, tmp_path, launcher=(sys.executable, "-m", "megacritic")):
    out = tmp_path / "run"
    cmd = [*launcher, "train", f"trainer.output_dir={out}", "trainer.progress=false", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    return proc, out


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_default_job_learns(tmp_path):
    # as `make train` runs it: the embedded default written as a Hugging Face folder, then loaded from it
    folder = tmp_path / "default-critic"
    init = subprocess.run([sys.executable, "-m", "megacritic", "init-hf", "--out", str(folder)],
                          capture_output=True, text=True, timeout=600)
    assert init.returncode == 0, init.stderr[-4000:]
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    proc, out = _train([f"model.path={folder}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = _records(out)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert all(name in records[0] for name in METRIC_NAMES)
    assert records[0]["critic/vf_explained_var"] < 0.5  # it starts out not knowing the task
    assert records[-1]["critic/vf_explained_var"] >= 0.9
    assert "explained variance" in proc.stdout


def test_config_error_is_clean(tmp_path):
    proc, out = _train(["megatron.tensor_model_parallel_size=3"], tmp_path)
    assert proc.returncode == 2
    assert "megatron.tensor_model_parallel_size=3" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()  # refused before anything was written


def test_world_size_error_is_clean(tmp_path):
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "megacritic")
    proc, _ = _train(["megatron.pipeline_model_parallel_size=2", "megatron.tensor_model_parallel_size=2"],
                     tmp_path, launcher)
    assert proc.returncode != 0
    assert "world size 2" in proc.stderr


@pytest.mark.slow
def test_torchrun_tensor_parallel(tmp_path):
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "megacritic")
    proc, out = _train(["megatron.tensor_model_parallel_size=2", "trainer.steps=2"], tmp_path, launcher)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(_records(out)) == 2 * 64 // 16


@pytest.mark.slow
def test_export_hf_from_checkpoint_matches_the_critic(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from megacritic import CriticWorker
    from megacritic.cli import train_config
    from megacritic.data.sources import SyntheticRollouts

    args = ["data.rollouts_per_step=16", "ppo_mini_batch_size=8", "trainer.steps=2", "trainer.save_every=2"]
    proc, out = _train(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    checkpoint = out / "checkpoints" / "step_00000002"
    export = subprocess.run([sys.executable, "-m", "megacritic", "export-hf", "--checkpoint", str(checkpoint),
                             "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=600)
    assert export.returncode == 0, export.stderr[-4000:]

    config = train_config(args)  # the run's own config
    worker = CriticWorker(config)
    worker.init_model()
    worker.load_checkpoint(str(checkpoint))
    batch = SyntheticRollouts(config).batch(7)
    ours = worker.compute_values(batch)
    worker.close()
    model = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "hf").eval()
    r = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -r - 1:-1, 0]
    theirs = logits * batch["attention_mask"][:, -r:]
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-5


@pytest.mark.slow
def test_example_rollout_file_trains_end_to_end(tmp_path):
    # GAE (gamma = lam = 1) on the file's score rewards, as `make train ARGS="data.path=..."` runs it
    example = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"
    proc, out = _train([f"data.path={example}", "trainer.steps=100"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = _records(out)
    assert len(records) == 400
    assert all(k in records[0] for k in ("critic/values/mean", "critic/returns/max", "perf/mfu"))
    assert records[-1]["critic/vf_explained_var"] >= 0.9
    assert (out / "training_curves.png").stat().st_size > 10_000


def test_missing_rollout_file_is_a_config_error(tmp_path):
    proc, _ = _train(["data.path=does/not/exist.jsonl"], tmp_path)
    assert proc.returncode == 2 and "data.path" in proc.stderr


def test_tensorboard_events_are_written(tmp_path):
    from tensorboardX.event_file_writer import EventFileWriter  # noqa: F401  (the writer is installed)

    proc, out = _train(["trainer.steps=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 1000


def test_consecutive_skipped_steps_stop_the_run(tmp_path):
    # returns of 1e30 square to inf in float32: every step is skipped (weights kept), then the run stops
    rows = [{"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "score": 1e30} for _ in range(16)]
    path = tmp_path / "overflow.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc, out = _train([f"data.path={path}", "data.rollouts_per_step=16", "ppo_mini_batch_size=8",
                        "trainer.max_consecutive_skips=3", "trainer.steps=10"], tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "trainer.max_consecutive_skips=3" in proc.stderr and "Traceback" not in proc.stderr
    records = _records(out)
    assert len(records) == 4 and all(r["critic/skipped_steps"] == 1.0 for r in records)
    assert all(r["critic/grad_norm"] is None for r in records)  # NaN is written as null


def test_resumed_log_keeps_checkpointed_steps_and_drops_a_torn_line(tmp_path):
    from megacritic.train_loop import _open_log

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "critic/vf_loss": 0.1 * s}) + "\n" for s in (1, 2, 3, 4)]
    path.write_text("".join(lines[:3]) + lines[3][:9])  # the crash cut step 4's record short
    _open_log(str(path), keep_steps=2).close()
    assert path.read_text() == "".join(lines[:2])
    path.write_text("".join(lines) + "\n")
    _open_log(str(path), keep_steps=4).close()
    assert path.read_text() == "".join(lines)


# Rank 1 of a 2-process run stops inside the Megatron schedule of its 3rd optimizer step: it exits at once
# (dead) or sleeps (hung), after writing the time to FAULT_STAMP.
FAULTY_RANK = '''
import os
import sys
import time

from megacritic.cli import main
from megacritic.forward_backward import ForwardBackward

if __name__ == "__main__":
    if os.environ["RANK"] == "1":
        original, calls = ForwardBackward._forward_step, []

        def faulty(self, forward_only, *args):
            if not forward_only:
                calls.append(None)
                if len(calls) == 3:
                    with open(os.environ["FAULT_STAMP"], "w") as f:
                        f.write(str(time.time()))
                    if os.environ["FAULT"] == "dead":
                        os._exit(13)
                    time.sleep(3600)
            return original(self, forward_only, *args)

        ForwardBackward._forward_step = faulty
    sys.exit(main())
'''


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["dead", "hung"])
def test_survivor_of_a_dead_or_hung_rank_exits_naming_the_operation(tmp_path, fault):
    """Without a launcher to tear the job down (e.g. a multi-node job whose peer node vanished), the
    surviving rank must fail within megatron.nccl_timeout, with a message, instead of hanging."""
    import os
    import socket
    import time

    script = tmp_path / "faulty_rank.py"
    script.write_text(FAULTY_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout = 10
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", FAULT=fault, FAULT_STAMP=str(tmp_path / "fault"))
        procs.append(subprocess.Popen(
            [sys.executable, str(script), "train", f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false",
             "trainer.tensorboard=false", "trainer.steps=2", f"megatron.nccl_timeout={timeout}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        _, err = procs[0].communicate(timeout=300)
        ended = time.time()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    print(err.strip().splitlines()[-1])
    assert procs[0].returncode == 4, err[-3000:]
    assert "megacritic: communication failed: rank 0: a collective failed during update_critic" in err, err[-3000:]
    assert "Traceback" not in err
    waited = ended - float((tmp_path / "fault").read_text())
    # dead: the peer's socket closes at once; hung: the collective's timeout (plus process exit)
    assert waited < (15 if fault == "dead" else timeout + 15), waited


@pytest.mark.slow
def test_profile_steps_write_a_chrome_trace(tmp_path):
    proc, out = _train(["trainer.steps=2", "trainer.profile_steps=[2]", "trainer.tensorboard=false"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = sorted((out / "profile").iterdir())
    assert [t.name for t in traces] == ["iteration_000002.rank0.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("aten::mm" in n or "aten::addmm" in n or "aten::linear" in n for n in names)
    record = _records(out)[-1]
    assert record["timing_s/forward_backward"] > 0 and record["timing_s/optimizer"] > 0


def test_mfu_counts_the_experts_a_token_runs_through():
    from megacritic.config import TINY_MODEL_OVERRIDES
    from megacritic.config.load import load_config
    from megacritic.flops import active_shape, forward_flops, model_forward_flops
    dense = load_config([*TINY_MODEL_OVERRIDES, "model.num_hidden_layers=2"]).model
    assert active_shape(dense)["intermediate_size"] == dense.intermediate_size
    # layer 0 dense (FFN 128), layer 1 MoE: top-2 of 4 experts of 32, a shared expert of 48, a 4-way router
    moe = load_config([*TINY_MODEL_OVERRIDES, "model.num_hidden_layers=2", "model.num_experts=4",
                       "model.moe_intermediate_size=32", "model.shared_expert_intermediate_size=48",
                       "model.mlp_only_layers=[0]"]).model
    h = moe.hidden_size
    ffn = 3 * h * (128 + 2 * 32 + 48) + h * 4
    assert forward_flops(active_shape(moe), [10]) - forward_flops(active_shape(dense), [10]) == \
        pytest.approx(2 * 10 * (ffn - 2 * 3 * h * 128))
    assert model_forward_flops(moe, [10, 3]) == forward_flops(active_shape(moe), [10, 3])


# ------------------------------------------------------------------------------ the job's config (no run)


def test_train_without_a_model_path_is_the_tiny_critic_with_the_fields_set():
    from megacritic.cli import train_config
    from megacritic.config import tiny_model
    assert train_config([]).model == tiny_model()
    assert train_config(["model.num_hidden_layers=4", "model.rope_theta=500000"]).model == \
        tiny_model(num_hidden_layers=4, rope_theta=500000.0)


@pytest.mark.parametrize("overrides, key", [
    (["trainer.save_every=-1"], "trainer.save_every"),
    (["trainer.steps=0"], "trainer.steps"),
    (["trainer.steps=2", "trainer.profile_steps=[3]"], "trainer.profile_steps"),
    (["data.rollouts_per_step=24", "ppo_mini_batch_size=16"], "data.rollouts_per_step"),
    (["model.max_position_embeddings=32", "data.prompt_length=[4,16]", "data.response_length=[4,32]"],
     "data.response_length"),
    (["algorithm.lam=1.5"], "algorithm.lam"),
    (["data.prompt_length=[0,4]"], "data.prompt_length"),
])
def test_the_jobs_own_settings_are_checked_by_the_cli(overrides, key):
    from megacritic.cli import train_config
    from megacritic.config import TINY_MODEL_OVERRIDES, ConfigError
    from megacritic.config.load import load_config
    with pytest.raises(ConfigError) as info:
        train_config(overrides)
    assert str(info.value).startswith(f"{key}="), str(info.value)
    load_config([*TINY_MODEL_OVERRIDES, *overrides])  # the library does not read them


def test_the_cli_sets_the_schedule_length_from_trainer_steps():
    from megacritic.cli import train_config
    # 3 iterations x 64 rollouts / 16 per mini-batch x 2 epochs
    assert train_config(["trainer.steps=3", "ppo_epochs=2"]).optim.total_training_steps == 24
    assert train_config(["trainer.steps=3", "optim.schedule_unit=call"]).optim.total_training_steps == 3
    assert train_config(["optim.total_training_steps=10"]).optim.total_training_steps == 10
    # a decaying schedule needs its length: the CLI gives it one
    assert train_config(["optim.lr_decay_style=cosine", "trainer.steps=5"]).optim.total_training_steps == 20


def test_the_cli_imports_neither_the_bench_nor_megatron_before_main():
    import os
    # megacritic.cli alone: the root package's __init__ (which imports the worker) is bypassed
    code = ("import sys, types, importlib, importlib.util; "
            "p = types.ModuleType('megacritic'); "
            "p.__path__ = list(importlib.util.find_spec('megacritic').submodule_search_locations); "
            "sys.modules['megacritic'] = p; importlib.import_module('megacritic.cli'); "
            "print(sorted(m for m in sys.modules if m.startswith(('megacritic.bench', 'megatron'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[]", out.stdout


def test_main_silences_only_the_upstream_notices():
    import warnings

    from megacritic.cli import _quiet_upstream
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _quiet_upstream()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
        warnings.warn("a user's own warning")
    assert [str(w.message) for w in caught] == ["a user's own warning"]
