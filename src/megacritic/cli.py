"""``megacritic train``: the PPO critic phase on the embedded rollout task, under torchrun or alone.
(``megacritic bench``, the throughput benchmark, lives in megacritic.bench.)

    python -m megacritic train [--config FILE.yaml] [dotted.key=value ...]
    torchrun --nproc_per_node 2 -m megacritic train megatron.tensor_model_parallel_size=2

Each iteration draws a rollout batch, computes its values (the old values of PPO), then updates the critic
over ppo_epochs x mini-batches. ``<trainer.output_dir>/metrics.jsonl`` gets one JSON object per optimizer
step; only global rank 0 writes and prints.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import warnings

# Deprecation notices that Megatron-Core's own internals trigger (collective names, its config defaults,
# its optimizer probing non-leaf .grad): nothing a CLI user can act on.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
warnings.filterwarnings("ignore", category=UserWarning,
                        module=r"megatron\.core\.(transformer\.transformer_config|optimizer\.optimizer)$")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megacritic.checkpoint import CheckpointError, latest_checkpoint, read_trainer_state  # noqa: E402
from megacritic.config import TINY_MODEL, ConfigError, CriticConfig, to_dict  # noqa: E402
from megacritic.config.load import complete, load_config, merge  # noqa: E402
from megacritic.config.schema import fail, positive  # noqa: E402
from megacritic.advantages import compute_gae  # noqa: E402
from megacritic.data.rollouts import BatchError  # noqa: E402
from megacritic.data.sources import rollout_source  # noqa: E402
from megacritic.flops import model_forward_flops, peak_flops  # noqa: E402
from megacritic.plots import plot_training_curves  # noqa: E402
from megacritic.worker import CriticWorker  # noqa: E402


def _finite_or_none(x: float):
    return x if math.isfinite(x) else None


class TrainingError(RuntimeError):
    """Training cannot usefully go on (e.g. too many skipped steps in a row)."""


class CommunicationError(RuntimeError):
    """A collective failed or timed out: another process died or hung."""


def _is_communication_failure(exc: BaseException) -> bool:
    # NCCL and the rendezvous store raise DistError subclasses; gloo raises a plain RuntimeError whose
    # message carries the location in gloo's transport ("Connection closed by peer", "Timed out waiting").
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "/gloo/" in str(exc))


def _settings(overrides: list[str], path: str | None) -> CriticConfig:
    """The layered settings, the embedded tiny critic filling the architecture fields left unset when
    model.path is."""
    settings = merge(overrides, path)
    if settings.model.path is not None:
        return settings
    model = dataclasses.replace(settings.model,
                                **{k: v for k, v in TINY_MODEL.items() if getattr(settings.model, k) is None})
    return dataclasses.replace(settings, model=model)


def train_config(overrides: list[str], path: str | None = None) -> CriticConfig:
    """The config of a ``megacritic train`` run: settings, the job's checks and schedule, validation."""
    return job_config(_settings(overrides, path))


def job_config(settings: CriticConfig) -> CriticConfig:
    """The config of a run from its layered, not yet resolved settings: the job's checks, the LR schedule's
    length from trainer.steps where optim.total_training_steps is unset; then model.path is read and
    everything validated."""
    check_job_settings(settings)
    optim = settings.optim
    if optim.total_training_steps == -1:
        optim = dataclasses.replace(optim, total_training_steps=schedule_length(settings))
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


def schedule_length(config: CriticConfig) -> int:
    """What the run's LR schedule spans, in optim.schedule_unit: trainer.steps update_critic calls, each of
    data.rollouts_per_step / ppo_mini_batch_size x ppo_epochs optimizer steps."""
    if config.optim.schedule_unit == "call":
        return config.trainer.steps
    return config.trainer.steps * config.data.rollouts_per_step // config.ppo_mini_batch_size * config.ppo_epochs


def _rollouts(config: CriticConfig):
    """The run's rollout source; a rollout file is read (and checked) before any model is built."""
    try:
        return rollout_source(config)
    except BatchError as exc:
        if config.data.path is None:
            raise
        raise BatchError(f"data.path={config.data.path!r}: {exc}") from None


def _resume(worker: CriticWorker, root: str, speaker: bool) -> dict:
    """Trainer state of the newest intact checkpoint (empty when there is none)."""
    folder, skipped = latest_checkpoint(root)
    if speaker:
        for reason in skipped:
            print(f"megacritic: skipping checkpoint: {reason}", file=sys.stderr)
    if folder is None:
        if speaker:
            print(f"megacritic: trainer.resume=true but no complete checkpoint in {root}; starting fresh",
                  file=sys.stderr)
        return {}
    state = worker.load_checkpoint(folder)
    if speaker:
        print(f"megacritic: resumed from {folder} (iteration {state['iteration']}, step {state['step']})")
    return state


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


def _batch_metrics(batch, update_time: float, config, peak: float) -> dict[str, float]:
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


def _critic_iteration(worker: CriticWorker, batch, config) -> tuple[dict[str, list[float]], float, float]:
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


def train(config) -> dict[str, float]:
    """Run the job of ``config`` (from :func:`train_config`); returns the last optimizer step's metrics."""
    t = config.trainer
    data = _rollouts(config)
    worker = CriticWorker(config)
    worker.init_model()
    speaker = dist.get_rank() == 0
    ckpt_root = os.path.join(t.output_dir, "checkpoints")
    state = _resume(worker, ckpt_root, speaker) if t.resume else {}
    first, step = state.get("iteration", 0), state.get("step", 0)
    peak = peak_flops()
    log = board = None
    if speaker:
        os.makedirs(t.output_dir, exist_ok=True)
        with open(os.path.join(t.output_dir, "config.json"), "w") as f:
            json.dump(to_dict(config), f, indent=2)
        log = _open_log(os.path.join(t.output_dir, "metrics.jsonl"), keep_steps=step)
        if t.tensorboard:
            from tensorboardX import SummaryWriter  # only runs that log to TensorBoard need it

            board = SummaryWriter(os.path.join(t.output_dir, "tensorboard"), purge_step=step + 1)
    bar = tqdm(range(first, t.steps), desc="critic", initial=first, total=t.steps,
               disable=not (speaker and t.progress), dynamic_ncols=True)
    last, skips = {}, 0
    try:
        for iteration in bar:
            batch = data.batch(iteration)
            with _profiled(iteration + 1 in t.profile_steps, os.path.join(t.output_dir, "profile"), iteration + 1):
                metrics, values_time, update_time = _critic_iteration(worker, batch, config)
            batch_metrics = _batch_metrics(batch, update_time, config, peak)
            for i in range(len(metrics["critic/vf_loss"])):
                step += 1
                last = {k: v[i] for k, v in metrics.items()}
                skips = skips + 1 if last["critic/skipped_steps"] else 0
                record = {"step": step, "iteration": iteration + 1, **last, **batch_metrics,
                          "timing_s/values": values_time, "timing_s/update_critic": update_time}
                if log:
                    log.write(json.dumps({k: _finite_or_none(v) if isinstance(v, float) else v
                                          for k, v in record.items()}) + "\n")
                if board:
                    for key, value in record.items():
                        if key not in ("step", "iteration") and isinstance(value, float) and math.isfinite(value):
                            board.add_scalar(key, value, step)
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
        if board:
            board.close()
        worker.close()
    if speaker and last:
        curves = plot_training_curves(os.path.join(t.output_dir, "metrics.jsonl"),
                                      os.path.join(t.output_dir, "training_curves.png"))
        print(f"done: {step} optimizer steps over {t.steps} iterations\n"
              f"  vf_loss {last['critic/vf_loss']:.4g}   explained variance {last['critic/vf_explained_var']:.4f}   "
              f"clip fraction {last['critic/vf_clipfrac']:.3f}   grad norm {last['critic/grad_norm']:.3g}\n"
              f"  metrics {os.path.join(t.output_dir, 'metrics.jsonl')}\n  curves  {curves}")
    return last


def export_checkpoint(checkpoint: str, out: str, overrides: list[str]) -> None:
    """Rebuild the critic a checkpoint was saved from (its own config), load it, write a HF folder."""
    saved = read_trainer_state(checkpoint)["config"]
    # The architecture is in the saved config; weights come from the checkpoint, not from model.path.
    saved = {**saved, "model": {**saved["model"], "path": None, "value_head_init": "normal"}}
    config = load_config(["megatron.tensor_model_parallel_size=1", "megatron.pipeline_model_parallel_size=1",
                          "megatron.virtual_pipeline_model_parallel_size=null", *overrides], base=saved)
    worker = CriticWorker(config)
    worker.init_model()
    try:
        worker.load_checkpoint(checkpoint)
        worker.export_hf(out)
    finally:
        worker.close()
    if dist.get_rank() == 0 if dist.is_initialized() else True:
        print(f"exported {checkpoint} to {out}")


def init_hf(out: str, config) -> None:
    """Write the seeded initial critic of ``config`` as a HF folder (by default the embedded tiny critic,
    which ``make train`` then trains from)."""
    worker = CriticWorker(config)
    worker.init_model()
    try:
        worker.export_hf(out)
    finally:
        worker.close()


# Failures with a known cause (a setting, the data, a checkpoint, a dead peer): one clean line and an exit
# code, no traceback.
_USER_ERRORS = {
    ConfigError: ("config error", 2),
    BatchError: ("data error", 2),
    CheckpointError: ("checkpoint error", 2),
    TrainingError: ("training stopped", 3),
    CommunicationError: ("communication failed", 4),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megacritic", description="PPO critic training on Megatron-Core")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train the critic on the embedded rollout task")
    p_train.add_argument("--config", help="YAML file of settings (defaults < file < overrides)")
    p_train.add_argument("overrides", nargs="*", help="dotted.key=value settings, e.g. ppo_epochs=2")
    p_export = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face *ForTokenClassification folder")
    p_export.add_argument("--checkpoint", required=True, help="a checkpoint folder (<output_dir>/checkpoints/step_N)")
    p_export.add_argument("--out", required=True, help="folder to write (config.json + safetensors)")
    p_export.add_argument("overrides", nargs="*", help="layout overrides when run under torchrun, e.g. "
                                                       "megatron.tensor_model_parallel_size=2")
    p_init = sub.add_parser("init-hf", help="write the seeded initial critic as a Hugging Face folder")
    p_init.add_argument("--out", required=True, help="folder to write")
    p_init.add_argument("--config", help="YAML file of settings")
    p_init.add_argument("overrides", nargs="*", help="dotted.key=value settings (model.* defines the model)")
    sub.add_parser("bench", add_help=False, help="throughput benchmark (see `megacritic bench --help`)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from megacritic.bench import main as bench_main
        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    try:
        if args.command == "export-hf":
            export_checkpoint(args.checkpoint, args.out, args.overrides)
            return 0
        if args.command == "train":
            train(train_config(args.overrides, args.config))
        elif args.command == "init-hf":
            init_hf(args.out, complete(_settings(args.overrides, args.config)))
    except tuple(_USER_ERRORS) as exc:
        what, code = next(v for t, v in _USER_ERRORS.items() if isinstance(exc, t))
        print(f"megacritic: {what}: {exc}", file=sys.stderr)
        return code
    return 0
