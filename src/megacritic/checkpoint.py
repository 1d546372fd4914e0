"""Checkpoints: Megatron distributed checkpointing, written atomically, verified by a manifest.

Layout of ``<root>``::

    step_00000012/            a complete checkpoint (the folder is renamed into place only when done)
        <dist_checkpointing files>   model and optimizer state, resharded on load to any TP/PP/DP layout
        trainer.json          step, iteration, critic call counter, LR scheduler state, config
        rng_rank*.pt          each rank's RNG states (restored when the world size matches)
        MANIFEST.json         every file's size and SHA-256, written last
    .tmp-step_00000015/       a save in progress (or interrupted): never loaded

A *snapshot* (``save_checkpoint(..., snapshot=True)``: what :class:`megacritic.ray.CriticGroup` takes to restore
a restarted group) has the same layout but stores the distributed optimizer's shards as they lie in memory
(megatron-core's "dp_reshardable" format: no gather, no copy into the model's coordinates) and lists its files'
sizes without hashing them: it is written and read by the same group, in host memory, and loads only under the
parallel layout that saved it.

A crash while saving leaves only a ``.tmp-*`` folder; ``latest_checkpoint`` picks the newest folder whose
manifest matches its files, so a truncated or corrupted checkpoint is skipped, not loaded. A folder's files are
hashed once per load: :func:`open_checkpoint` (or ``latest_checkpoint``) verifies it and returns a
:class:`Checkpoint`, which the reader of its trainer state and :func:`load_checkpoint` take as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megacritic.compat.adam_step import adam_step_kept_per_parameter
from megacritic.config import ConfigError, CriticConfig, is_moe
from megacritic.optim import torch_optimizers
from megacritic.train_state import TrainState

MANIFEST = "MANIFEST.json"
TRAINER_STATE = "trainer.json"
# The optimizer state is stored per parameter in the model's own coordinates, so a checkpoint saved
# under one TP/PP/DP layout loads under another. The memory-efficient variant gathers the distributed
# optimizer's shards over the data-parallel gloo group (the other one moves them through NCCL, and
# hard-codes .cuda() on the way): host memory only, on GPU and CPU alike.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable",
                     "distrib_optim_fully_reshardable_mem_efficient": True}
# A snapshot's: each rank's shards as they are (at 1.5B on one H200 the fully reshardable save took most of
# the 120 s of a 20 GiB snapshot, bench/NOTES.md).
_SNAPSHOT_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}
# What a snapshot must be loaded under: the degrees that decide each rank's shards.
_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
                "use_distributed_optimizer")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder whose files matched its manifest when it was opened, and its trainer state."""

    folder: str
    state: dict  # trainer.json: the trainer's own state, the TrainState's non-tensor state, config, world size

    @property
    def trainer_state(self) -> dict:
        return self.state["trainer"]


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _sharded_state(model: list, optimizer, loading: bool, fmt: dict) -> dict:
    # Tensor keys inside are global (layers by their global number), so they do not depend on how the
    # layers are split over pipeline stages and virtual chunks.
    state = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model)}
    state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=loading, metadata=fmt)
    return state


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _list_files(folder: str) -> list[str]:
    out = []
    for base, _, files in os.walk(folder):
        out += [os.path.relpath(os.path.join(base, f), folder) for f in files if f != MANIFEST]
    return sorted(out)


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(folder: str, saved_world_size: int | None) -> None:
    """Each rank's RNG states (torch, CUDA, Megatron's model-parallel tracker), when the world size is the
    one saved; under another layout the ranks do not correspond and the fresh seeds stay (the critic draws
    no random numbers in training: no dropout, seeded data and shuffles)."""
    path = os.path.join(folder, _rng_file(dist.get_rank()))
    if saved_world_size != dist.get_world_size() or not os.path.isfile(path):
        return
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(root: str, step: int, train_state: TrainState, saved_state: dict, *,
                    snapshot: bool = False) -> str:
    """Collective: every rank calls it. Writes ``train_state`` (its tensors through Megatron's distributed
    checkpointing, the rest in trainer.json beside ``saved_state``). Returns the final folder. ``snapshot``:
    a snapshot (this module's docstring), for a restart of the same layout."""
    model, optimizer = train_state.model, train_state.optimizer
    final = os.path.join(root, checkpoint_name(step))
    tmp = os.path.join(root, ".tmp-" + checkpoint_name(step))
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    fmt = _SNAPSHOT_FORMAT if snapshot else _OPTIMIZER_FORMAT
    dist_checkpointing.save(_sharded_state(model, optimizer, loading=False, fmt=fmt), tmp, content_metadata=fmt)
    torch.save(_rng_state(), os.path.join(tmp, _rng_file(dist.get_rank())))
    dist.barrier()
    if rank0:
        with open(os.path.join(tmp, TRAINER_STATE), "w") as f:
            json.dump({**saved_state, **train_state.state_dict(), "world_size": dist.get_world_size(),
                       "snapshot": snapshot}, f)
        files = {name: {"bytes": os.path.getsize(os.path.join(tmp, name))} for name in _list_files(tmp)}
        if not snapshot:
            for name, meta in files.items():
                meta["sha256"] = _file_digest(os.path.join(tmp, name))
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({"step": step, "snapshot": snapshot, "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # atomic: the checkpoint appears complete or not at all
    dist.barrier()
    return final


def verify_checkpoint(folder: str) -> None:
    """Raise CheckpointError unless every file listed in the manifest is present with its size and hash (a
    snapshot's: its size)."""
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{folder}: no {MANIFEST} (the save did not finish)")
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{folder}: unreadable {MANIFEST}: {exc}") from None
    for name, meta in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{folder}: {name} is missing")
        if os.path.getsize(path) != meta["bytes"]:
            raise CheckpointError(f"{folder}: {name} has {os.path.getsize(path)} bytes, expected {meta['bytes']}")
        if "sha256" in meta and _file_digest(path) != meta["sha256"]:
            raise CheckpointError(f"{folder}: {name} does not match its checksum (corrupted)")


def open_checkpoint(folder: str) -> Checkpoint:
    """Verify ``folder`` against its manifest (CheckpointError if it does not match) and read its state; no
    collective, any process can open one."""
    verify_checkpoint(folder)
    try:
        with open(os.path.join(folder, TRAINER_STATE)) as f:
            return Checkpoint(folder, json.load(f))
    except ValueError as exc:
        raise CheckpointError(f"{folder}: unreadable {TRAINER_STATE}: {exc}") from None


def check_expert_layout(checkpoint: Checkpoint, config: CriticConfig) -> None:
    """ConfigError unless ``checkpoint`` loads under ``config``'s expert parallelism: megatron-core gives the
    experts an optimizer of their own only with expert parallelism > 1, and the two optimizer layouts'
    checkpoints do not load into each other."""
    saved = checkpoint.state.get("config", {}).get("megatron", {})
    saved_ep, ep = saved.get("expert_model_parallel_size", 1), config.megatron.expert_model_parallel_size
    if is_moe(config.model) and (saved_ep > 1) != (ep > 1):
        raise ConfigError(f"megatron.expert_model_parallel_size={ep}: the checkpoint {checkpoint.folder} was saved "
                          f"with {saved_ep}; a mixture-of-experts checkpoint resumes only with expert parallelism "
                          f"{'> 1' if saved_ep > 1 else '= 1'} (megatron-core keeps the experts' optimizer "
                          "state apart only when it is > 1)")


def check_snapshot_layout(checkpoint: Checkpoint, config: CriticConfig, world_size: int) -> None:
    """CheckpointError if ``checkpoint`` is a snapshot saved under another world size or other parallel degrees
    than these (its optimizer shards are each rank's own)."""
    if not checkpoint.state.get("snapshot"):
        return
    saved = checkpoint.state.get("config", {}).get("megatron", {})
    here = {key: getattr(config.megatron, key) for key in _LAYOUT_KEYS}
    differ = [f"megatron.{key}={saved.get(key)} (here {here[key]})" for key in _LAYOUT_KEYS
              if saved.get(key) != here[key]]
    if checkpoint.state.get("world_size") != world_size:
        differ.insert(0, f"world size {checkpoint.state.get('world_size')} (here {world_size})")
    if differ:
        raise CheckpointError(f"{checkpoint.folder} is a snapshot, which loads only under the layout that saved it: "
                              f"it was saved with {', '.join(differ)}")


def latest_checkpoint(root: str) -> tuple[Checkpoint | None, list[str]]:
    """The newest intact checkpoint under ``root`` (or None), and why newer ones were skipped."""
    if not os.path.isdir(root):
        return None, []
    skipped = []
    for name in sorted((n for n in os.listdir(root) if n.startswith("step_")), reverse=True):
        try:
            return open_checkpoint(os.path.join(root, name)), skipped
        except CheckpointError as exc:
            skipped.append(str(exc))
    return None, skipped


def _materialise_adam_state(optimizer) -> None:
    """torch's Adam creates its state (step, moments) at the first step; Megatron's state-dict code expects
    it to exist when loading into a fresh optimizer. Zeros here; the checkpoint overwrites them."""
    for torch_optimizer in torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            for p in group["params"]:
                state = torch_optimizer.state[p]
                if not state:
                    state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))


def _place_adam_steps(optimizer) -> None:
    """torch's fused (and capturable) Adam keeps ``step`` on the parameter's device, the others on the
    host; the restored steps go where the optimizer's own would be."""
    for torch_optimizer in torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                state = torch_optimizer.state.get(p, {})
                if "step" in state:
                    state["step"] = state["step"].to(p.device if on_device else "cpu", torch.float32)


def load_checkpoint(checkpoint: Checkpoint, train_state: TrainState) -> None:
    """Collective: load ``checkpoint`` (saved under any layout, opened by :func:`open_checkpoint`) into
    ``train_state``."""
    folder, model, optimizer = checkpoint.folder, train_state.model, train_state.optimizer
    fmt = dist_checkpointing.load_content_metadata(folder) or _OPTIMIZER_FORMAT
    _materialise_adam_state(optimizer)
    state = dist_checkpointing.load(_sharded_state(model, optimizer, loading=True, fmt=fmt), folder)
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(state[f"model{i}"])
    with adam_step_kept_per_parameter(optimizer):
        optimizer.load_state_dict(state["optimizer"])
    _place_adam_steps(optimizer)
    train_state.load_state_dict(checkpoint.state)
    _restore_rng(folder, checkpoint.state.get("world_size"))
