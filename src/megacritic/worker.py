"""CriticWorker: builds the critic (distributed setup, model, optimizer, LR schedule) and serves its calls.

Works under ``torchrun`` (one process per GPU, or per CPU rank with gloo), in a plain Python process, where it
sets up a world of one, and in a process that another role already set up (its torch.distributed world, or a
Megatron parallel state of the same degrees: :func:`megacritic.parallel.init_megatron`).

The worker is a facade: it builds the parts in one order (:meth:`CriticWorker.init_model`) and hands each
the objects it needs: the :class:`~megacritic.train_state.TrainState` goes to the critic (which trains it),
the checkpoint functions and the :class:`~megacritic.offload.Offloader`.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.timers import Timers

from megacritic import checkpoint, compat
from megacritic.config import CriticConfig, to_dict
from megacritic.critic import MegatronPPOCritic
from megacritic.forward_backward import ForwardBackward, StepTimers
from megacritic.model.value_model import transformer_config
from megacritic.offload import OFFLOAD_PARTS, Offloader
from megacritic.packing.micro_batches import MicroBatchPolicy
from megacritic.parallel import (Initialised, ParallelLayout, ProcessGroups, Ranks, init_megatron, teardown,
                                 use_deterministic_algorithms, world_size)
from megacritic.train_state import (TrainState, build_lr_scheduler, build_model, build_optimizer,
                                    cpu_optimizer_options)


class CriticWorker:
    """verl's CriticWorker interface: ``init_model()``, then ``compute_values`` / ``update_critic``."""

    def __init__(self, config: CriticConfig):
        # ``config`` comes validated from load_config (or megacritic.config.validate, for one built by hand).
        self.config = config
        self.layout: ParallelLayout | None = None
        self.ranks: Ranks | None = None
        self.groups: ProcessGroups | None = None
        self._initialised: Initialised | None = None
        self._state: TrainState | None = None
        self._critic: MegatronPPOCritic | None = None
        self._offloader: Offloader | None = None

    def setup_parallel(self) -> Ranks:
        """Stage 1 of :meth:`init_model` alone: the distributed world and Megatron's parallel state (checked
        before anything is built); this process' ranks. For a trainer that needs the ranks before the model
        (verl's TrainingWorker plans its dispatch when the engine is created). Idempotent until :meth:`close`."""
        if self._initialised is None:
            cfg, mg = self.config, self.config.megatron
            layout = ParallelLayout.from_config(mg, world_size())
            layout.check_batch_sizes(cfg)
            on_cpu = not torch.cuda.is_available()
            cpu_optimizer_options(cfg, on_cpu=on_cpu)  # its checks, before anything is set up
            # megacritic's departures from upstream megatron-core, all of them
            compat.apply(on_cpu=on_cpu, fused=cfg.model.use_fused_kernels and not on_cpu)
            if mg.full_determinism:
                use_deterministic_algorithms()
            self._initialised = initialised = init_megatron(layout, mg.seed, mg.nccl_timeout)
            self.layout, self.ranks, self.groups = layout, initialised.ranks, initialised.groups
        return self.ranks

    def init_model(self) -> None:
        cfg, mg = self.config, self.config.megatron
        if mg.expandable_segments and torch.cuda.is_available():
            # PYTORCH_CUDA_ALLOC_CONF's setting at run time, before the world's and the model's allocations:
            # every segment reserved after this grows in place
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        # 1. Distributed world and Megatron's parallel state (checked before anything is built).
        self.setup_parallel()
        layout = self.layout
        on_cpu = not torch.cuda.is_available()
        fused = cfg.model.use_fused_kernels and not on_cpu
        cpu_optimizer = cpu_optimizer_options(cfg, on_cpu=on_cpu)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            cfg.model.dtype, torch.float32 if on_cpu else torch.bfloat16)

        # 2. Model chunks with our spec and their weights, in Megatron DDP. Megatron's own timers (schedule,
        #    gradient reduction, optimizer) feed the timing_s/* metrics.
        tconfig = transformer_config(cfg.model, layout, dtype=dtype, on_cpu=on_cpu, megatron=mg)
        timers = Timers(log_level=mg.timing_level, log_option="max") if mg.timing_level else None
        tconfig.timers = timers
        model = build_model(cfg, tconfig, layout, self.ranks)

        # 3. Optimizer (Adam, distributed over DP by default) and 4. LR schedule: the training state.
        optimizer = build_optimizer(cfg, model, dtype, timers, fused, cpu_optimizer)
        self._state = TrainState(model, optimizer, build_lr_scheduler(cfg, optimizer))

        # 5. The critic, and the runner of Megatron's schedule it passes its micro-batches to.
        forward_backward = ForwardBackward(model, MicroBatchPolicy.from_config(cfg, layout), layout, self.ranks,
                                           self.groups, cfg.model, cfg.cliprange_value,
                                           StepTimers(timers, mg.timing_level))
        self._critic = MegatronPPOCritic(cfg, layout, self.ranks, self.groups, self._state, forward_backward)
        self._offloader = Offloader(self._state, self.ranks.device)
        self.offload()  # with megatron.*_offload, the critic waits in host memory for its first call

    @property
    def state(self) -> TrainState:
        """The training state: model chunks, optimizer, LR scheduler, update-call count."""
        if self._state is None:
            raise RuntimeError("call CriticWorker.init_model() first")
        return self._state

    @property
    def operation(self) -> str:
        """What the critic is doing (or was doing when a call failed), e.g. for a failed collective."""
        return self._critic.operation if self._critic is not None else "init_model"

    def _require_model(self) -> MegatronPPOCritic:
        if self._critic is None:
            raise RuntimeError("call CriticWorker.init_model() first")
        return self._critic

    def compute_values(self, data) -> torch.Tensor:
        # A forward needs neither gradients nor optimizer state, and leaves the parameters as they were.
        with self._onloaded(("params",), read_only=True):
            return self._require_model().compute_values(data)

    def update_critic(self, data) -> dict[str, list[float]]:
        with self._onloaded(OFFLOAD_PARTS):
            return self._require_model().update_critic(data)

    # ---------------------------------------------------------------- step-level calls
    # For a trainer that runs the PPO loop itself and brings its own loss (verl's TrainingWorker through
    # megacritic.integrations.verl.engine): one rank's micro-batches through the schedule, then the optimizer
    # and LR schedule on the trainer's cue. Offload is the trainer's too (offload / onload).

    def forward_backward_batch(self, local, loss, forward_only: bool, mini_batch_tokens: int = 0):
        """This rank's :class:`~megacritic.data.rollouts.Rollouts` ``local`` through Megatron's schedule with
        ``loss`` (see :meth:`megacritic.forward_backward.ForwardBackward.run`); gradients accumulate in the
        model's buffers. ``mini_batch_tokens``: the real tokens of the whole mini-batch (MoE load-balancing
        loss)."""
        return self._require_model().forward_backward_batch(local, loss, forward_only, mini_batch_tokens)

    def local_values(self, local) -> torch.Tensor | None:
        """Values of this rank's own :class:`~megacritic.data.rollouts.Rollouts` ``local`` (a trainer that deals
        its batches to data-parallel ranks itself): what :meth:`compute_values` computes for this rank's
        shard, float32 [len(local), R] on the device, on the last pipeline stage (None on the others)."""
        return self._require_model().local_values(local)

    def zero_grad(self) -> None:
        self._require_model().zero_grad()

    def optimizer_step(self, loss_finite: bool = True, grads_finite: bool | None = None) -> tuple[bool, float]:
        """(applied, grad norm): skipped, weights kept and NaN, when the loss or a gradient is not finite.
        ``grads_finite``: the caller's read of :meth:`nonfinite_grads` (None: checked here, one more host read)."""
        return self._require_model().optimizer_step(loss_finite, grads_finite)

    def nonfinite_grads(self) -> torch.Tensor:
        """A device scalar, non-zero when some rank's gradient buffer holds a non-finite value (collective), for
        a caller that reads it with its other results, in one host read."""
        return self._require_model().nonfinite_grads()

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one of its units; returns the learning rate now in effect."""
        self._require_model()
        self._state.lr_scheduler.step(increment=1)
        return float(self._state.optimizer.param_groups[0]["lr"])

    # ---------------------------------------------------------------- offload (megatron.*_offload)

    @contextlib.contextmanager
    def _onloaded(self, parts, read_only: bool = False):
        """With offloading configured, the critic lives in host memory between calls: onload what the call
        needs, offload after it (also when it raises). ``read_only``: the call changed nothing onloaded, whose
        host copies are then still current (the device memory is freed without copying back)."""
        self._require_model()
        brought_back = [part for part in parts if part in self._offloader.on_host]  # (the rest was on the device)
        self.onload(parts)
        try:
            yield
        finally:
            self.offload(unchanged=brought_back if read_only else ())

    def offload(self, parts=None, unchanged=()) -> None:
        """Move ``parts`` (some of "params", "grads", "optimizer"; default: what megatron.{param,grad,
        optimizer}_offload name) to host memory (pinned; gradient buffers are released, not copied) and
        release the device memory; parts already on the host stay there. Nothing to move on CPU. Parts moved
        by hand that the switches do not name come back for each call and stay on the device after it.
        ``unchanged``: parts only read since their onload (freed without a copy)."""
        self._require_model()
        if parts is None:
            mg = self.config.megatron
            flags = {"params": mg.param_offload, "grads": mg.grad_offload, "optimizer": mg.optimizer_offload}
            parts = [part for part in OFFLOAD_PARTS if flags[part]]
        self._offloader.offload(parts, unchanged)

    def onload(self, parts=OFFLOAD_PARTS) -> None:
        """Bring offloaded state back to the device (gradient buffers come back zeroed); ``parts``: some of
        "params", "grads", "optimizer" (default all)."""
        self._require_model()
        self._offloader.onload(parts)

    # ---------------------------------------------------------------- checkpoints, export

    def save_checkpoint(self, root: str, step: int, trainer_state: dict, snapshot: bool = False) -> str:
        """Collective: write ``<root>/step_<step>`` (model, optimizer, LR schedule, shuffle position and
        ``trainer_state``) atomically; returns its folder. ``snapshot``: the faster form that only this
        layout loads (:mod:`megacritic.checkpoint`), for restarting a group in place."""
        critic = self._require_model()
        self.onload()
        saved = {"trainer": trainer_state, "config": to_dict(self.config)}
        with critic.doing(f"save_checkpoint (step {step} to {root})"):
            return checkpoint.save_checkpoint(root, step, self._state, saved, snapshot=snapshot)

    def load_checkpoint(self, folder: str | checkpoint.Checkpoint) -> dict:
        """Collective: restore a checkpoint saved under any TP / PP / DP layout (a folder, verified here, or a
        :class:`~megacritic.checkpoint.Checkpoint` already opened); returns its trainer_state."""
        critic = self._require_model()
        opened = folder if isinstance(folder, checkpoint.Checkpoint) else checkpoint.open_checkpoint(folder)
        checkpoint.check_expert_layout(opened, self.config)  # before anything changes
        checkpoint.check_snapshot_layout(opened, self.config, world_size())
        self.onload()
        with critic.doing(f"load_checkpoint ({opened.folder})"):
            checkpoint.load_checkpoint(opened, self._state)
        return opened.trainer_state

    def close(self) -> None:
        """Tear down Megatron's parallel state (unless it was a colocated model's, reused) and the process
        group if this worker created it."""
        if self._initialised is not None:
            teardown(self._initialised)
        self._initialised, self._state, self._critic, self._offloader = None, None, None, None

    def export_hf(self, out_dir: str) -> None:
        """Write the critic as a Hugging Face ``*ForTokenClassification`` (num_labels=1) folder, gathered from
        any TP / PP layout. Collective: every rank calls it; rank 0 writes."""
        from megacritic.hf.export import export_hf
        self._require_model()
        self.onload()
        export_hf(self._state.model, self.config.model, out_dir, self.ranks, self.groups, self.layout.tp)
