"""CriticWorker: builds the critic (distributed setup, model, optimizer, LR schedule) and serves its calls.

Works under ``torchrun`` (one process per GPU, or per CPU rank with gloo), in a plain Python process, where it
sets up a world of one, and in a process that another role already set up (its torch.distributed world, or a
Megatron parallel state of the same degrees: :func:`megacritic.parallel.init_megatron`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.timers import Timers

from megacritic import checkpoint, compat
from megacritic.compat.kernels import precision_aware_without_te, use_fused_adamw
from megacritic.config import ConfigError, CriticConfig, is_moe, to_dict, validate
from megacritic.critic import MegatronPPOCritic
from megacritic.model.value_model import build_value_model, padded_vocab_size, transformer_config
from megacritic.hf.checkpoint import weight_source
from megacritic.model.weights import load_full_weights
from megacritic.offload import PinnedOffload
from megacritic.optim import torch_optimizers
from megacritic.packing.micro_batches import MicroBatchPolicy
from megacritic.parallel import ParallelLayout, Ranks, init_megatron, world_size
from megacritic.schedule import Schedule, StepTimers


def cpu_optimizer_options(config: CriticConfig, on_cpu: bool) -> dict:
    """OptimizerConfig fields of megatron.optimizer_cpu_offload: Megatron's HybridDeviceOptimizer keeps the
    float32 main parameters and Adam moments of optimizer_offload_fraction of the parameters in pinned host
    memory and steps them there (torch's CPU AdamW). Megatron runs it through its precision-aware path, where
    the distributed optimizer keeps no float32 copy on the device: the GPU holds only the bf16 parameters
    and the float32 gradient buffer (6 bytes per parameter instead of 18). Raises before anything is built."""
    mg = config.megatron
    if not mg.optimizer_cpu_offload:
        return {}
    if on_cpu:
        raise ConfigError("megatron.optimizer_cpu_offload=true needs a CUDA GPU (the hybrid device optimizer "
                          "moves gradients and parameters between the GPU and the host); set it to false")
    if not mg.use_distributed_optimizer:
        raise ConfigError("megatron.optimizer_cpu_offload=true needs megatron.use_distributed_optimizer=true "
                          "(Megatron's hybrid device optimizer runs inside its distributed optimizer)")
    if mg.optimizer_offload:
        raise ConfigError("megatron.optimizer_offload=true and megatron.optimizer_cpu_offload=true both move the "
                          "optimizer state to the host: choose one (optimizer_cpu_offload keeps it there)")
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=mg.optimizer_offload_fraction,
                overlap_cpu_optimizer_d2h_h2d=True, store_param_remainders=False)


def optimizer_steps(config: CriticConfig) -> int:
    """Steps the LR schedule spans: optim.total_training_steps. Unset (-1) validates only for a constant
    schedule without warm-up, whose LR no length changes (Megatron's scheduler still wants a positive one)."""
    return config.optim.total_training_steps if config.optim.total_training_steps > 0 else 1


OFFLOAD_PARTS = ("params", "grads", "optimizer")


def _optimizer_tensors(optimizer):
    """The device tensors a Megatron optimizer keeps: main parameters (float32 copies) and their state."""
    for torch_optimizer in torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            yield from (p for p in group["params"] if p.is_cuda)
        for state in torch_optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v) and v.is_cuda)


class _FinalizeGrads:
    """Megatron's grad finalisation (DP reduction, SP norm all-reduce) without its per-token scaling:
    our loss is already normalised over the whole mini-batch (megacritic.losses)."""

    def __call__(self, model, num_tokens=None, **kwargs):
        finalize_model_grads(model, None, **kwargs)


class CriticWorker:
    """verl's CriticWorker interface: ``init_model()``, then ``compute_values`` / ``update_critic``."""

    def __init__(self, config: CriticConfig):
        validate(config)
        self.config = config
        self.layout: ParallelLayout | None = None
        self.ranks: Ranks | None = None
        self.critic: MegatronPPOCritic | None = None
        self._owns_process_group = False
        self._owns_parallel_state = False  # False: a colocated model's parallel state, reused (init_megatron)
        self._on_host: set[str] = set()  # offload parts now in host memory
        self._host = {"params": PinnedOffload(), "optimizer": PinnedOffload()}

    def setup_parallel(self) -> Ranks:
        """Stage 1 of :meth:`init_model` alone: the distributed world and Megatron's parallel state (checked
        before anything is built); this process' ranks. For a trainer that needs the ranks before the model
        (verl's TrainingWorker plans its dispatch when the engine is created). Idempotent."""
        if self.ranks is None:
            cfg, mg = self.config, self.config.megatron
            layout = ParallelLayout.from_config(mg, world_size())
            layout.check_batch_sizes(cfg)
            on_cpu = not torch.cuda.is_available()
            cpu_optimizer_options(cfg, on_cpu=on_cpu)  # its checks, before anything is set up
            # megacritic's departures from upstream megatron-core, all of them
            compat.apply(on_cpu=on_cpu, fused=cfg.model.use_fused_kernels and not on_cpu)
            initialised = init_megatron(layout, mg.seed, mg.nccl_timeout)
            self._owns_process_group = initialised.owns_process_group
            self._owns_parallel_state = initialised.owns_parallel_state
            self.layout, self.ranks = layout, initialised.ranks
        return self.ranks

    def init_model(self) -> None:
        cfg, mg = self.config, self.config.megatron
        # 1. Distributed world and Megatron's parallel state (checked before anything is built).
        ranks = self.setup_parallel()
        layout = self.layout
        on_cpu = not torch.cuda.is_available()
        fused = cfg.model.use_fused_kernels and not on_cpu
        cpu_optimizer = cpu_optimizer_options(cfg, on_cpu=on_cpu)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            cfg.model.dtype, torch.float32 if on_cpu else torch.bfloat16)

        # 2. Model chunks with our spec, weights from model.path's checkpoint or the seed (identical for every
        #    layout; each rank reads only its shard).
        tconfig = transformer_config(cfg.model, layout, dtype=dtype, on_cpu=on_cpu, megatron=mg)
        # Megatron's own timers (schedule, gradient reduction, optimizer) feed the timing_s/* metrics.
        timers = Timers(log_level=mg.timing_level, log_option="max") if mg.timing_level else None
        tconfig.timers = timers
        chunks = build_value_model(cfg.model, tconfig)
        if not on_cpu and is_moe(cfg.model):
            # Megatron's router and shared-expert gate create their weights in host memory (an upstream TODO);
            # Megatron-LM moves every model to the GPU once built, and so do we (dense modules are already there).
            for chunk in chunks:
                chunk.cuda(torch.cuda.current_device())
        load_full_weights(chunks, weight_source(cfg.model, mg.seed), cfg.model, ranks.tp_rank, layout.tp,
                          padded_vocab_size(cfg.model.vocab_size, layout.tp), ranks.experts)
        if cfg.model.freeze_moe_router:
            # Before DDP and the optimizer are built, so the routers get neither gradient buffers nor state.
            for chunk in chunks:
                for name, param in chunk.named_parameters():
                    if name.endswith("mlp.router.weight"):
                        param.requires_grad_(False)

        # 3. Megatron DDP: contiguous fp32 gradient buffers, reduced once per step.
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=mg.use_distributed_optimizer)
        model = [DistributedDataParallel(tconfig, ddp_config, chunk) for chunk in chunks]
        tconfig.finalize_model_grads_func = _FinalizeGrads()

        # 4. Optimizer (Adam, distributed over DP by default) and 5. LR schedule.
        o = cfg.optim
        optimizer = get_megatron_optimizer(precision_aware_without_te(OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps,
            # clip_grad=0 disables clipping; an infinite threshold keeps Megatron measuring the norm.
            clip_grad=o.clip_grad if o.clip_grad > 0 else math.inf,
            bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_distributed_optimizer=mg.use_distributed_optimizer, timers=timers, **cpu_optimizer)), model)
        if fused and not cpu_optimizer:  # the hybrid one fuses its own
            use_fused_adamw(optimizer)
        total, warmup = self._schedule_steps()
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if warmup else o.lr, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
            lr_decay_steps=total, lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay,
            end_wd=o.weight_decay, wd_incr_steps=total, wd_incr_style="constant")

        # 6. The critic itself, and the schedule it runs its micro-batches through.
        schedule = Schedule(model, MicroBatchPolicy.from_config(cfg, layout), layout, ranks, cfg.model,
                            cfg.cliprange_value, StepTimers(timers, mg.timing_level))
        self.critic = MegatronPPOCritic(cfg, layout, ranks, model, schedule, optimizer, scheduler)
        self.offload()  # with megatron.*_offload, the critic waits in host memory for its first call

    def _schedule_steps(self) -> tuple[int, int]:
        """Length and warm-up of the LR schedule, in optim.schedule_unit (optimizer steps or update calls)."""
        o = self.config.optim
        total = optimizer_steps(self.config)
        warmup = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * total)
        return total, warmup

    @property
    def operation(self) -> str:
        """What the critic is doing (or was doing when a call failed), e.g. for a failed collective."""
        return self.critic.operation if self.critic is not None else "init_model"

    def _require_model(self) -> MegatronPPOCritic:
        if self.critic is None:
            raise RuntimeError("call CriticWorker.init_model() first")
        return self.critic

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

    def forward_backward(self, local, loss, forward_only: bool, mini_batch_tokens: int = 0):
        """This rank's :class:`~megacritic.data.rollouts.Rollouts` ``local`` through Megatron's schedule with
        ``loss`` (see :meth:`megacritic.schedule.Schedule.run`); gradients accumulate in the model's buffers.
        ``mini_batch_tokens``: the real tokens of the whole mini-batch (MoE load-balancing loss)."""
        return self._require_model().forward_backward(local, loss, forward_only, mini_batch_tokens)

    def zero_grad(self) -> None:
        self._require_model().zero_grad()

    def optimizer_step(self, loss_finite: bool = True) -> tuple[bool, float]:
        """(applied, grad norm): skipped, weights kept and NaN, when the loss or a gradient is not finite."""
        return self._require_model().optimizer_step(loss_finite)

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one of its units; returns the learning rate now in effect."""
        critic = self._require_model()
        critic.scheduler.step(increment=1)
        return float(critic.optimizer.param_groups[0]["lr"])

    @property
    def data_parallel_group(self):
        """The torch process group of this rank's data-parallel peers (after :meth:`setup_parallel`)."""
        if self.ranks is None:
            raise RuntimeError("call CriticWorker.setup_parallel() or init_model() first")
        return mpu.get_data_parallel_group()

    # ---------------------------------------------------------------- offload (megatron.*_offload)

    @contextlib.contextmanager
    def _onloaded(self, parts, read_only: bool = False):
        """With offloading configured, the critic lives in host memory between calls: onload what the call
        needs, offload after it (also when it raises). ``read_only``: the call changed nothing onloaded, whose
        host copies are then still current (the device memory is freed without copying back)."""
        brought_back = [part for part in parts if part in self._on_host]  # (what was on the device may differ)
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
        critic, mg = self._require_model(), self.config.megatron
        if parts is None:
            flags = {"params": mg.param_offload, "grads": mg.grad_offload, "optimizer": mg.optimizer_offload}
            parts = [part for part in OFFLOAD_PARTS if flags[part]]
        unknown = [part for part in parts if part not in OFFLOAD_PARTS]
        if unknown:
            raise ValueError(f"offload parts {unknown}: choose from {', '.join(OFFLOAD_PARTS)}")
        todo = [part for part in OFFLOAD_PARTS if part in parts and part not in self._on_host]
        if self.ranks.device.type != "cuda" or not todo:
            return
        params = [p for chunk in critic.model for p in chunk.parameters()]
        # The optimizer first, while the parameters are still on the device: with float32 parameters the
        # optimizer's main parameters are the model's own (or views of them), and those stay.
        if "optimizer" in todo:
            model_storages = {p.untyped_storage().data_ptr() for p in params}
            self._host["optimizer"].offload(t for t in _optimizer_tensors(critic.optimizer)
                                            if t.untyped_storage().data_ptr() not in model_storages)
        if "grads" in todo:
            for chunk in critic.model:
                chunk.offload_grad_buffers(synchronize=False, empty_cache=False)
        if "params" in todo:
            if "params" in unchanged:
                self._host["params"].release()
            else:
                self._host["params"].offload(params)
        self._on_host.update(todo)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def onload(self, parts=OFFLOAD_PARTS) -> None:
        """Bring offloaded state back to the device (gradient buffers come back zeroed); ``parts``: some of
        "params", "grads", "optimizer" (default all)."""
        critic = self._require_model()
        for part in (p for p in parts if p in self._on_host):
            if part == "grads":
                for chunk in critic.model:
                    chunk.restore_grad_buffers(synchronize=False)
            else:
                self._host[part].onload()
            self._on_host.discard(part)

    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> str:
        """Collective: write ``<root>/step_<step>`` (model, optimizer, LR schedule, shuffle position and
        ``trainer_state``) atomically; returns its folder."""
        critic = self._require_model()
        self.onload()
        state = {"trainer": trainer_state, "update_calls": critic.update_calls,
                 "scheduler": critic.scheduler.state_dict(), "config": to_dict(self.config)}
        with critic._doing(f"save_checkpoint (step {step} to {root})"):
            return checkpoint.save_checkpoint(root, step, critic.model, critic.optimizer, state)

    def load_checkpoint(self, folder: str) -> dict:
        """Collective: restore a checkpoint saved under any TP / PP / DP layout; returns its trainer_state."""
        critic = self._require_model()
        self._check_expert_layout(folder)
        self.onload()
        with critic._doing(f"load_checkpoint ({folder})"):
            state = checkpoint.load_checkpoint(folder, critic.model, critic.optimizer)
        critic.scheduler.load_state_dict(state["scheduler"])
        critic.update_calls = state["update_calls"]
        return state["trainer"]

    def _check_expert_layout(self, folder: str) -> None:
        """megatron-core gives the experts an optimizer of their own only with expert parallelism > 1, and the
        two optimizer layouts' checkpoints do not load into each other."""
        saved = checkpoint.read_trainer_state(folder).get("config", {}).get("megatron", {})
        saved_ep, ep = saved.get("expert_model_parallel_size", 1), self.config.megatron.expert_model_parallel_size
        if is_moe(self.config.model) and (saved_ep > 1) != (ep > 1):
            raise ConfigError(f"megatron.expert_model_parallel_size={ep}: the checkpoint {folder} was saved with "
                              f"{saved_ep}; a mixture-of-experts checkpoint resumes only with expert parallelism "
                              f"{'> 1' if saved_ep > 1 else '= 1'} (megatron-core keeps the experts' optimizer "
                              "state apart only when it is > 1)")

    def close(self) -> None:
        """Tear down Megatron's parallel state (unless it was a colocated model's, reused) and the process
        group if this worker created it."""
        if self.ranks is not None:  # set up (setup_parallel), with or without a model built
            if self._owns_parallel_state:
                mpu.destroy_model_parallel()
            self.critic, self.ranks = None, None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False

    def export_hf(self, out_dir: str) -> None:
        """Write the critic as a Hugging Face ``*ForTokenClassification`` (num_labels=1) folder, gathered from
        any TP / PP layout. Collective: every rank calls it; rank 0 writes."""
        from megacritic.hf.export import export_hf
        self.onload()
        export_hf(self._require_model().model, self.config.model, out_dir)
