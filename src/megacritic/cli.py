"""``megacritic``: argv to a subcommand, and a failure with a known cause to one line and an exit code.

    python -m megacritic train [--config FILE.yaml] [dotted.key=value ...]
    torchrun --nproc_per_node 2 -m megacritic train megatron.tensor_model_parallel_size=2
    python -m megacritic export-hf --checkpoint DIR --out DIR
    python -m megacritic init-hf --out DIR [dotted.key=value ...]
    python -m megacritic bench [...]

The job of ``train`` is :mod:`megacritic.train_loop`; ``bench`` is :mod:`megacritic.bench`. Without
model.path, ``train`` and ``init-hf`` use the embedded tiny critic (``megacritic.config.presets.TINY_MODEL``)
for every architecture field left unset.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings

# These import no Megatron-Core (the train loop, the worker and checkpoints do: they are imported by the
# subcommands, after main installed the warning filters).
from megacritic.config import TINY_MODEL, ConfigError, CriticConfig
from megacritic.config.load import complete, load_config, merge
from megacritic.data.rollouts import BatchError


def _quiet_upstream() -> None:
    """Notices of upstream internals that a CLI user can do nothing about; installed before Megatron-Core
    is imported (which is why the subcommands import their modules when they run)."""
    # megacritic does not use Transformer Engine or Apex (its attention, norm and optimizer paths are chosen
    # for that), so Megatron-Core's import-time notice that they are missing only misleads.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
    # Deprecations that Megatron-Core's own internals trigger (collective names, its config defaults, its
    # optimizer probing non-leaf .grad).
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=UserWarning,
                            module=r"megatron\.core\.(transformer\.transformer_config|optimizer\.optimizer)$")


def _user_errors() -> dict[type, tuple[str, int]]:
    """Failures with a known cause (a setting, the data, a checkpoint, a dead peer): one clean line and an
    exit code, no traceback."""
    from megacritic.checkpoint import CheckpointError
    from megacritic.train_loop import CommunicationError, TrainingError
    return {
        ConfigError: ("config error", 2),
        BatchError: ("data error", 2),
        CheckpointError: ("checkpoint error", 2),
        TrainingError: ("training stopped", 3),
        CommunicationError: ("communication failed", 4),
    }


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
    from megacritic.train_loop import job_config
    return job_config(_settings(overrides, path))


def export_checkpoint(checkpoint: str, out: str, overrides: list[str]) -> None:
    """Rebuild the critic a checkpoint was saved from (its own config), load it, write a HF folder."""
    import torch.distributed as dist

    from megacritic.checkpoint import open_checkpoint
    from megacritic.worker import CriticWorker
    opened = open_checkpoint(checkpoint)  # verified here, once
    saved = opened.state["config"]
    # The architecture is in the saved config; weights come from the checkpoint, not from model.path.
    saved = {**saved, "model": {**saved["model"], "path": None, "value_head_init": "normal"}}
    config = load_config(["megatron.tensor_model_parallel_size=1", "megatron.pipeline_model_parallel_size=1",
                          "megatron.virtual_pipeline_model_parallel_size=null", *overrides], base=saved)
    worker = CriticWorker(config)
    worker.init_model()
    try:
        worker.load_checkpoint(opened)
        worker.export_hf(out)
    finally:
        worker.close()
    if dist.get_rank() == 0 if dist.is_initialized() else True:
        print(f"exported {checkpoint} to {out}")


def init_hf(out: str, overrides: list[str], path: str | None) -> None:
    """Write the seeded initial critic of the settings as a HF folder (by default the embedded tiny critic,
    which ``make train`` then trains from)."""
    from megacritic.worker import CriticWorker
    worker = CriticWorker(complete(_settings(overrides, path)))
    worker.init_model()
    try:
        worker.export_hf(out)
    finally:
        worker.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megacritic", description="PPO critic training on Megatron-Core")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train the critic on a rollout file or the embedded rollout task")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_upstream()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from megacritic.bench import main as bench_main
        return bench_main(argv[1:])
    args = _parser().parse_args(argv)
    user_errors = _user_errors()
    try:
        if args.command == "train":
            from megacritic.train_loop import train
            train(train_config(args.overrides, args.config))
        elif args.command == "export-hf":
            export_checkpoint(args.checkpoint, args.out, args.overrides)
        elif args.command == "init-hf":
            init_hf(args.out, args.overrides, args.config)
    except tuple(user_errors) as exc:
        what, code = next(v for t, v in user_errors.items() if isinstance(exc, t))
        print(f"megacritic: {what}: {exc}", file=sys.stderr)
        return code
    return 0
