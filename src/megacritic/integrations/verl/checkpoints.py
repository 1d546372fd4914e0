"""verl's checkpoint calls on a :class:`~megacritic.CriticWorker`: ``save_checkpoint(local_path, hdfs_path,
global_step, max_ckpt_to_keep)`` writes megacritic's atomic checkpoint ``<local_path>/step_<global_step>``;
``load_checkpoint(local_path)`` restores the newest intact one under ``local_path`` (saved under any layout).
Shared by the engine plugin and the legacy worker."""

from __future__ import annotations

import shutil

from megacritic.config import ConfigError


def save_and_prune(worker, local_path: str, hdfs_path, global_step: int, max_ckpt_to_keep: int | None,
                   saved: list[str], rank: int) -> str:
    """Collective. ``saved``: the folders written so far by this process, oldest first (updated in place);
    beyond ``max_ckpt_to_keep`` the oldest are removed (by rank 0)."""
    if hdfs_path is not None:
        raise ConfigError(f"hdfs_path={hdfs_path!r}: megacritic writes checkpoints to local_path only; "
                          "unset trainer.default_hdfs_dir")
    step = int(global_step)
    folder = worker.save_checkpoint(local_path, step, {"verl_global_step": step})
    saved[:] = [f for f in saved if f != folder] + [folder]
    if max_ckpt_to_keep and len(saved) > max_ckpt_to_keep:
        old = saved[:-max_ckpt_to_keep]
        del saved[:-max_ckpt_to_keep]
        if rank == 0:
            for path in old:
                shutil.rmtree(path, ignore_errors=True)
    return folder


def load_latest(worker, local_path: str, hdfs_path=None) -> dict:
    """Collective: restore the newest intact checkpoint under ``local_path``; returns its trainer state."""
    from megacritic.checkpoint import CheckpointError, latest_checkpoint
    if hdfs_path is not None:
        raise ConfigError(f"hdfs_path={hdfs_path!r}: megacritic reads checkpoints from local_path only")
    found, skipped = latest_checkpoint(local_path)  # opened and verified
    if found is None:
        raise CheckpointError(f"no intact megacritic checkpoint under {local_path}"
                              + (f" ({'; '.join(skipped)})" if skipped else ""))
    return worker.load_checkpoint(found)
