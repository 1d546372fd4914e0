"""The ``megacritic train`` job: the PPO critic phase on a rollout file or the embedded synthetic task.

Each iteration draws a rollout batch, computes its values (the old values of PPO) unless the rollouts carry
them, turns rewards into returns with GAE unless they carry returns, then updates the critic over
ppo_epochs x mini-batches. ``<trainer.output_dir>/metrics.jsonl`` gets one JSON object per optimizer step;
only global rank 0 writes and prints. The job's own settings (data.*, algorithm.*, trainer.*) are checked
here, where they are used; the library never reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from megacritic.advantages import compute_gae
from megacritic.checkpoint import latest_checkpoint
from megacritic.config import CriticConfig, to_dict
from megacritic.config.load import complete
from megacritic.config.schema import fail, positive
from megacritic.data.rollouts import BatchError
from megacritic.data.sources import rollout_source
from megacritic.flops import model_forward_flops, peak_flops
from megacritic.model.layers import attention_impl_of
from megacritic.plots import plot_training_curves
from megacritic.worker import CriticWorker


class TrainingError(RuntimeError):
    """Training cannot usefully go on (e.g. too many skipped steps in a row)."""


class CommunicationError(RuntimeError):
    """A collective failed or timed out: another process died or hung."""


# ------------------------------------------------------------------------------------------ the job's config


def job_config(settings: CriticConfig) -> CriticConfig:
    """The config of a run from its layered, not yet resolved settings (``megacritic.config.load.merge``):
    the job's checks, the LR schedule's length from trainer.steps where optim.total_training_steps is unset;
    then model.path is read and everything validated."""
    check_job_settings(settings)
    optim = settings.optim
    if optim.total_training_steps == -1:
        optim = dataclasses.replace(optim, total_training_steps=lr_schedule_length(settings))
    config = complete(dataclasses.replace(settings, optim=optim))
    d, m = config.data, config.model
    if d.prompt_length[1] + d.response_length[1] > m.max_position_embeddings:
        fail("data.response_length", d.response_length,
             f"prompt + response ({d.prompt_length[1]} + {d.response_length[1]}) exceed "
             f"model.max_position_embeddings ({m.max_position_embeddings})")
    return config


def check_job_settings(config: CriticConfig) -> None:
    """The checks of the job's own settings (and of the two library settings it divides by)."""
    t, d, a = config.trainer, config.data, config.algorithm
    positive("trainer.steps", t.steps)
    positive("trainer.max_consecutive_skips", t.max_consecutive_skips)
    if not all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= t.steps for i in t.profile_steps):
        fail("trainer.profile_steps", t.profile_steps, f"list iterations between 1 and trainer.steps ({t.steps})")
    if t.save_every < 0:
        fail("trainer.save_every", t.save_every, "must be 0 (no checkpoints) or a positive number of iterations")
    for key in ("gamma", "lam"):
        if not 0 <= getattr(a, key) <= 1:
            fail(f"algorithm.{key}", getattr(a, key), "must lie in [0, 1]")
    for key in ("prompt_length", "response_length"):
        lo_hi = getattr(d, key)
        if len(lo_hi) != 2 or not 1 <= lo_hi[0] <= lo_hi[1]:
            fail(f"data.{key}", lo_hi, "must be [min, max] with 1 <= min <= max")
    positive("data.rollouts_per_step", d.rollouts_per_step)
    positive("ppo_mini_batch_size", config.ppo_mini_batch_size)
    positive("ppo_epochs", config.ppo_epochs)
    if d.rollouts_per_step % config.ppo_mini_batch_size:
        fail("data.rollouts_per_step", d.rollouts_per_step,
             f"must be a multiple of ppo_mini_batch_size ({config.ppo_mini_batch_size})")


def lr_schedule_length(config: CriticConfig) -> int:
    """What the run's LR schedule spans, in optim.schedule_unit: trainer.steps update_critic calls, each of
    data.rollouts_per_step / ppo_mini_batch_size x ppo_epochs optimizer steps."""
    if config.optim.schedule_unit == "call":
        return config.trainer.steps
    return config.trainer.steps * config.data.rollouts_per_step // config.ppo_mini_batch_size * config.ppo_epochs


# --------------------------------------------------------------------------------------------- metrics log


def _open_log(path: str, keep_steps: int):
    """metrics.jsonl, keeping the records of the first ``keep_steps`` optimizer steps (those a resumed
    checkpoint covers) and dropping any written after it by the interrupted run."""
    kept = []
    if keep_steps and os.path.exists(path):
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the crash: everything after it is newer
                    break
                if record["step"] <= keep_steps:
                    kept.append(line)
    log = open(path, "w")
    log.writelines(kept)
    return log


class MetricsLog:
    """One record per optimizer step into <output_dir>/metrics.jsonl (non-finite numbers as null) and, with
    trainer.tensorboard, TensorBoard events in <output_dir>/tensorboard. Resumed after ``resumed_steps``
    steps, it drops what an interrupted run wrote after them."""

    def __init__(self, output_dir: str, resumed_steps: int, tensorboard: bool):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = _open_log(self.path, keep_steps=resumed_steps)
        self._board = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # only runs that log to TensorBoard need it

            self._board = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=resumed_steps + 1)

    def write(self, record: dict) -> None:
        finite = {k: (v if math.isfinite(v) else None) if isinstance(v, float) else v for k, v in record.items()}
        self._file.write(json.dumps(finite) + "\n")
        if self._board is not None:
            for key, value in record.items():
                if key not in ("step", "iteration") and isinstance(value, float) and math.isfinite(value):
                    self._board.add_scalar(key, value, record["step"])

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()


# ----------------------------------------------------------------------------------------------- the loop


def _iteration(worker: CriticWorker, batch, config: CriticConfig) -> tuple[dict[str, list[float]], float, float]:
    """One PPO iteration of the critic: values (unless the rollouts carry their producer's), GAE returns
    (unless given), then update_critic. Returns its metrics and the two calls' seconds."""
    start = time.perf_counter()
    if "values" not in batch.keys():
        batch["values"] = worker.compute_values(batch)
    values_time = time.perf_counter() - start
    if "returns" not in batch.keys():
        _, batch["returns"] = compute_gae(batch["token_level_rewards"], batch["values"], batch["response_mask"],
                                          config.algorithm.gamma, config.algorithm.lam)
    start = time.perf_counter()
    metrics = worker.update_critic(batch)
    return metrics, values_time, time.perf_counter() - start


def _batch_metrics(batch, update_time: float, config: CriticConfig, peak: float) -> dict[str, float]:
    """Per-iteration statistics of the values and returns (response tokens) and the update's MFU on the
    real, unpadded tokens against the device's dense bf16 peak (NaN where the peak is unknown, e.g. CPU)."""
    r = batch["responses"].shape[1]
    mask = batch["attention_mask"][:, -r:].bool()
    out = {}
    for key in ("values", "returns"):
        x = batch[key][mask].double()
        out.update({f"critic/{key}/mean": x.mean().item(), f"critic/{key}/max": x.max().item(),
                    f"critic/{key}/min": x.min().item()})
    flops = 3 * model_forward_flops(config.model, batch["attention_mask"].sum(1).tolist())  # backward = 2x
    out["perf/mfu"] = flops * config.ppo_epochs / update_time / peak
    return out


@contextlib.contextmanager
def _profiled(enabled: bool, folder: str, iteration: int):
    """PyTorch profiler over one iteration (trainer.profile_steps): a Chrome trace per rank."""
    if not enabled:
        yield
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    os.makedirs(folder, exist_ok=True)
    prof.export_chrome_trace(os.path.join(folder, f"iteration_{iteration:06d}.rank{dist.get_rank()}.json"))


def _resume(worker: CriticWorker, root: str, speaker: bool) -> dict:
    """Trainer state of the newest intact checkpoint (empty when there is none)."""
    found, skipped = latest_checkpoint(root)
    if speaker:
        for reason in skipped:
            print(f"megacritic: skipping checkpoint: {reason}", file=sys.stderr)
    if found is None:
        if speaker:
            print(f"megacritic: trainer.resume=true but no complete checkpoint in {root}; starting fresh",
                  file=sys.stderr)
        return {}
    state = worker.load_checkpoint(found)  # verified once, by latest_checkpoint
    if speaker:
        print(f"megacritic: resumed from {found.folder} (iteration {state['iteration']}, step {state['step']})")
    return state


def _rollouts(config: CriticConfig):
    """The run's rollout source; a rollout file is read (and checked) before any model is built."""
    try:
        return rollout_source(config)
    except BatchError as exc:
        if config.data.path is None:
            raise
        raise BatchError(f"data.path={config.data.path!r}: {exc}") from None


def _is_communication_failure(exc: BaseException) -> bool:
    # NCCL and the rendezvous store raise DistError subclasses; gloo raises a plain RuntimeError whose
    # message carries the location in gloo's transport ("Connection closed by peer", "Timed out waiting").
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "/gloo/" in str(exc))


def train(config: CriticConfig) -> dict[str, float]:
    """Run the job of ``config`` (from :func:`job_config`); returns the last optimizer step's metrics."""
    t = config.trainer
    data = _rollouts(config)
    worker = CriticWorker(config)
    worker.init_model()
    speaker = dist.get_rank() == 0
    ckpt_root = os.path.join(t.output_dir, "checkpoints")
    state = _resume(worker, ckpt_root, speaker) if t.resume else {}
    first, step = state.get("iteration", 0), state.get("step", 0)
    peak = peak_flops()
    worker_attention = attention_impl_of(worker.state.model)  # fa4 / fa2 / sdpa, chosen once at build
    log = None
    if speaker:
        os.makedirs(t.output_dir, exist_ok=True)
        with open(os.path.join(t.output_dir, "config.json"), "w") as f:
            json.dump(to_dict(config), f, indent=2)
        log = MetricsLog(t.output_dir, resumed_steps=step, tensorboard=t.tensorboard)
    bar = tqdm(range(first, t.steps), desc="critic", initial=first, total=t.steps,
               disable=not (speaker and t.progress), dynamic_ncols=True)
    last, skips = {}, 0
    try:
        for iteration in bar:
            batch = data.batch(iteration)
            with _profiled(iteration + 1 in t.profile_steps, os.path.join(t.output_dir, "profile"), iteration + 1):
                metrics, values_time, update_time = _iteration(worker, batch, config)
            batch_metrics = _batch_metrics(batch, update_time, config, peak)
            for i in range(len(metrics["critic/vf_loss"])):
                step += 1
                last = {k: v[i] for k, v in metrics.items()}
                skips = skips + 1 if last["critic/skipped_steps"] else 0
                if log:
                    log.write({"step": step, "iteration": iteration + 1, **last, **batch_metrics,
                               "timing_s/values": values_time, "timing_s/update_critic": update_time})
            if log:
                log.flush()
            if skips >= t.max_consecutive_skips:
                raise TrainingError(f"{skips} optimizer steps in a row were skipped for a non-finite loss or "
                                    f"gradient (last at step {step}; trainer.max_consecutive_skips="
                                    f"{t.max_consecutive_skips}): check the rollouts' returns and optim.lr")
            bar.set_postfix(vf_loss=f"{last['critic/vf_loss']:.4g}",
                            expl_var=f"{last['critic/vf_explained_var']:.3f}")
            done = iteration + 1
            if t.save_every and (done % t.save_every == 0 or done == t.steps):
                worker.save_checkpoint(ckpt_root, done, {"iteration": done, "step": step})
    except RuntimeError as exc:
        if not _is_communication_failure(exc):
            raise
        raise CommunicationError(
            f"rank {dist.get_rank()}: a collective failed during {worker.operation}: {str(exc).splitlines()[0]} "
            f"-- another process died or hung (megatron.nccl_timeout={config.megatron.nccl_timeout} s)") from None
    finally:
        bar.close()
        if log:
            log.close()
        worker.close()
    if speaker and last:
        curves = plot_training_curves(log.path, os.path.join(t.output_dir, "training_curves.png"))
        print(f"done: {step} optimizer steps over {t.steps} iterations\n"
              f"  vf_loss {last['critic/vf_loss']:.4g}   explained variance {last['critic/vf_explained_var']:.4f}   "
              f"clip fraction {last['critic/vf_clipfrac']:.3f}   grad norm {last['critic/grad_norm']:.3g}\n"
              f"  metrics {log.path}\n  curves  {curves}\n  attention kernel {worker_attention}")
    return last
