"""Elastic recovery: under ``torchrun --max-restarts N`` a rank that dies mid-training restarts the job, which
resumes from the newest complete checkpoint and ends with the metrics of an uninterrupted run."""

import json
import os
import subprocess
import sys

import pytest

# 2 iterations of 2 optimizer steps each between checkpoints; 6 iterations = 12 steps in all.
TASK = ["data.rollouts_per_step=16", "ppo_mini_batch_size=8", "model.num_hidden_layers=2", "trainer.steps=6",
        "trainer.save_every=2", "trainer.resume=true", "trainer.progress=false", "trainer.tensorboard=false"]
KEYS = ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var",
        "critic/lr", "critic/skipped_steps", "critic/values/mean", "critic/values/max", "critic/returns/mean")

# `python -m megacritic` with crashes. MEGACRITIC_TEST_KILL lists them as ATTEMPT:WHERE:K, comma-separated:
# in restart attempt ATTEMPT (TORCHELASTIC_RESTART_COUNT), rank MEGACRITIC_TEST_KILL_RANK exits at once
# (os._exit: no cleanup, no flush), WHERE=step: right after its K-th optimizer step of that attempt,
# WHERE=save: as it enters its K-th checkpoint save of that attempt (the other rank is then in that save).
WRAPPER = '''
import os
import sys

from megacritic.cli import main
from megacritic.critic import MegatronPPOCritic
from megacritic.worker import CriticWorker


def die_at(cls, name, count, before):
    original, calls = getattr(cls, name), []

    def wrapped(self, *args, **kwargs):
        calls.append(None)
        if before and len(calls) == count:
            os._exit(13)
        result = original(self, *args, **kwargs)
        if len(calls) == count:
            os._exit(13)
        return result

    setattr(cls, name, wrapped)


if __name__ == "__main__":
    if os.environ["RANK"] == os.environ.get("MEGACRITIC_TEST_KILL_RANK"):
        for kill in filter(None, os.environ["MEGACRITIC_TEST_KILL"].split(",")):
            attempt, where, count = kill.split(":")
            if attempt == os.environ.get("TORCHELASTIC_RESTART_COUNT"):
                if where == "step":
                    die_at(MegatronPPOCritic, "_finish_step", int(count), before=False)
                else:
                    die_at(CriticWorker, "save_checkpoint", int(count), before=True)
    sys.exit(main())
'''


def _torchrun(tmp_path, name, kill="", max_restarts=0):
    wrapper = tmp_path / "crashing_megacritic.py"
    wrapper.write_text(WRAPPER)
    out = tmp_path / name
    env = dict(os.environ, MEGACRITIC_TEST_KILL_RANK="1", MEGACRITIC_TEST_KILL=kill)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.1", str(wrapper), "train",
           f"trainer.output_dir={out}", *TASK]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc, out, records


@pytest.mark.slow
def test_killed_ranks_restart_and_resume_to_the_uninterrupted_metrics(tmp_path):
    _, _, uninterrupted = _torchrun(tmp_path, "full")
    # Attempt 0: rank 1 dies after optimizer step 7, in the middle of iteration 4 (rank 0 has logged steps
    # 5-6 past the newest checkpoint, step_00000002). Attempt 1 resumes there, saves step_00000004, and rank 1
    # dies entering the next save: rank 0 has begun .tmp-step_00000006 and cannot finish it. Attempt 2
    # resumes from step_00000004 and completes the run.
    proc, out, recovered = _torchrun(tmp_path, "killed", "0:step:7,1:save:2", max_restarts=2)

    assert proc.stderr.count("exitcode: 13") == 2  # rank 1 died twice, and torchrun restarted the workers
    resumes = [line for line in proc.stdout.splitlines() if "resumed from" in line]
    assert len(resumes) == 2, proc.stdout[-3000:]
    assert resumes[0].endswith("step_00000002 (iteration 2, step 4)")
    assert resumes[1].endswith("step_00000004 (iteration 4, step 8)")
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000002", "step_00000004", "step_00000006"]

    # The same 12 optimizer steps, bit-for-bit: same layout (DP=2 over gloo), same data and seeds, and the
    # checkpoint restores weights, Adam state, LR schedule, shuffle position and RNG exactly (CPU is
    # deterministic), so any difference is a resume bug, not rounding. Timings and MFU are left out.
    assert [r["step"] for r in recovered] == [r["step"] for r in uninterrupted] == list(range(1, 13))
    for a, b in zip(uninterrupted, recovered):
        assert a["iteration"] == b["iteration"]
        for key in KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
