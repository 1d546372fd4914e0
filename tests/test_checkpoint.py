"""Checkpoints: exact resume, resume under another parallel layout, and integrity (manifest, atomicity)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from megacritic.checkpoint import CheckpointError, latest_checkpoint, verify_checkpoint

TASK = ["data.rollouts_per_step=16", "ppo_mini_batch_size=8", "trainer.progress=false", "model.num_hidden_layers=2"]
CRITIC_KEYS = ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean",
               "critic/vf_explained_var", "critic/lr")


def _train(out, *args, nproc=1):
    launcher = [sys.executable, "-m", "megacritic"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "megacritic"]
    proc = subprocess.run([*launcher, "train", f"trainer.output_dir={out}", *TASK, *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A 3-iteration run saving at the end, then resumed to 6 iterations; and the uninterrupted 6."""
    tmp = tmp_path_factory.mktemp("ckpt")
    full = _train(tmp / "full", "trainer.steps=6")
    _train(tmp / "resumed", "trainer.steps=3", "trainer.save_every=3")
    resumed = _train(tmp / "resumed", "trainer.steps=6", "trainer.save_every=3", "trainer.resume=true")
    return tmp, full, resumed


@pytest.mark.slow
def test_resumed_run_equals_uninterrupted_run(interrupted):
    _, full, resumed = interrupted
    assert [r["step"] for r in resumed] == [r["step"] for r in full] == list(range(1, 13))
    for a, b in zip(full, resumed):
        for key in CRITIC_KEYS:
            assert a[key] == b[key], (a["step"], key)  # bit-for-bit on CPU


@pytest.mark.slow
def test_checkpoint_resumes_under_another_layout(tmp_path):
    # Uninterrupted under (TP, PP) = (2, 1), saving after iteration 2; then resume that checkpoint
    # under (1, 2) and compare the next optimizer step.
    tp2 = _train(tmp_path / "tp2", "trainer.steps=3", "trainer.save_every=2",
                 "megatron.tensor_model_parallel_size=2", nproc=2)
    os.makedirs(tmp_path / "pp2" / "checkpoints")
    shutil.copytree(tmp_path / "tp2" / "checkpoints" / "step_00000002",
                    tmp_path / "pp2" / "checkpoints" / "step_00000002")
    pp2 = _train(tmp_path / "pp2", "trainer.steps=3", "trainer.resume=true",
                 "megatron.pipeline_model_parallel_size=2", nproc=2)
    expected = {r["step"]: r for r in tp2}
    assert [r["step"] for r in pp2][-2:] == [5, 6]
    for record in pp2[-2:]:
        ref = expected[record["step"]]
        for key in ("critic/vf_loss", "critic/grad_norm"):
            assert abs(record[key] - ref[key]) <= 1e-5 * abs(ref[key]), (record["step"], key)


@pytest.mark.slow
def test_integrity_checks_and_fallback(interrupted):
    tmp, _, _ = interrupted
    root = tmp / "resumed" / "checkpoints"
    newest, older = root / "step_00000006", root / "step_00000003"
    verify_checkpoint(str(newest))
    assert latest_checkpoint(str(root))[0].folder == str(newest)
    assert (newest / "rng_rank00000.pt").exists()  # RNG states travel with the checkpoint
    assert "rng_rank00000.pt" in (newest / "MANIFEST.json").read_text()

    # an interrupted save (no manifest, .tmp- name) is never picked
    os.makedirs(root / ".tmp-step_00000009")
    assert latest_checkpoint(str(root))[0].folder == str(newest)

    # corrupt one byte of the newest: detected, and resume falls back to the older one
    victim = next(p for p in sorted(newest.iterdir()) if p.suffix == ".distcp")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        verify_checkpoint(str(newest))
    found, skipped = latest_checkpoint(str(root))
    assert found.folder == str(older) and "checksum" in skipped[0]

    # a truncated file is reported by size
    victim.write_bytes(bytes(data[:10]))
    with pytest.raises(CheckpointError, match="bytes"):
        verify_checkpoint(str(newest))
    (newest / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="did not finish"):
        verify_checkpoint(str(newest))



def _snapshot_state(**megatron):
    layout = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
              "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
              "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None, "use_distributed_optimizer": True}
    return {"snapshot": True, "world_size": 2, "config": {"megatron": {**layout, **megatron}}}


def test_snapshot_loads_only_under_its_layout():
    from megacritic import load_config
    from megacritic.checkpoint import Checkpoint, check_snapshot_layout
    from megacritic.config import TINY_MODEL_OVERRIDES
    config = load_config(list(TINY_MODEL_OVERRIDES))
    check_snapshot_layout(Checkpoint("snap", _snapshot_state()), config, world_size=2)
    with pytest.raises(CheckpointError, match=r"world size 2 \(here 4\), megatron.tensor_model_parallel_size=2 "
                                              r"\(here 1\)$"):
        check_snapshot_layout(Checkpoint("snap", _snapshot_state(tensor_model_parallel_size=2)), config, 4)
    # a checkpoint (not a snapshot) loads under any layout
    check_snapshot_layout(Checkpoint("ckpt", {**_snapshot_state(tensor_model_parallel_size=2), "snapshot": False}),
                          config, 4)


def test_snapshot_round_trip_in_process(tmp_path):
    """A snapshot restores the exact state (the next updates are bit-identical), lists sizes without hashes,
    and its loader refuses a truncated file."""
    from megacritic import CriticWorker, load_config
    from megacritic.config import TINY_MODEL_OVERRIDES
    from megacritic.data.sources import SyntheticRollouts
    config = load_config([*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4",
                          "ppo_micro_batch_size_per_gpu=2"])
    worker = CriticWorker(config)
    worker.init_model()
    try:
        batch = SyntheticRollouts(config).batch(0)
        batch["values"] = worker.compute_values(batch)
        worker.update_critic(batch)  # the optimizer has state (moments, step) to restore
        folder = worker.save_checkpoint(str(tmp_path), 1, {}, snapshot=True)
        first = [worker.update_critic(batch) for _ in range(2)]
        worker.load_checkpoint(folder)
        again = [worker.update_critic(batch) for _ in range(2)]
        for a, b in zip(first, again):
            for key in CRITIC_KEYS[:5]:
                assert a[key] == b[key], key  # bit-for-bit
        manifest = json.loads((tmp_path / "step_00000001" / "MANIFEST.json").read_text())
        assert manifest["snapshot"] and all(set(meta) == {"bytes"} for meta in manifest["files"].values())
        victim = next(p for p in sorted((tmp_path / "step_00000001").iterdir()) if p.suffix == ".distcp")
        victim.write_bytes(victim.read_bytes()[:10])
        with pytest.raises(CheckpointError, match="bytes"):
            worker.load_checkpoint(folder)
    finally:
        worker.close()
