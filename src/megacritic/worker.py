"""CriticWorker: builds the critic (distributed setup, model, optimizer, LR schedule) and serves its calls.

Works under ``torchrun`` (one process per GPU, or per CPU rank with gloo) and in a plain Python process,
where it sets up a world of one.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, clip_grads, get_megatron_optimizer
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.timers import Timers
from megatron.core.utils import local_multi_tensor_applier

from megacritic import checkpoint
from megacritic.compat.cpu import enable_cpu_backend
from megacritic.config import ConfigError, CriticConfig, is_moe, to_dict, validate, validate_layout
from megacritic.critic import Layout, MegatronPPOCritic, StepTimers
from megacritic.model.value_model import build_value_model, padded_vocab_size, transformer_config
from megacritic.hf.checkpoint import weight_source
from megacritic.model.weights import ExpertRanks, load_full_weights
from megacritic.offload import PinnedOffload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, under a prefix of this restart attempt.

    With TORCHELASTIC_USE_AGENT_STORE=True the store at MASTER_ADDR:MASTER_PORT belongs to torchrun's agent
    (the c10d rendezvous' shared TCPStore, or the static rendezvous' one) and outlives the workers: after a
    ``--max-restarts`` restart it still holds every key the dead workers wrote. Process groups name their
    keys deterministically (the same group names in every attempt), so the new workers would read the old
    ones' addresses (gloo: connectFullMesh to a port nobody listens on) or pass barriers on old counts.
    A prefix per attempt gives each one fresh keys. TORCHELASTIC_RESTART_COUNT is the same for all workers
    of one agent (one node); across nodes the agents count separately, so a multi-node elastic job should
    run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store each round; no prefix then)."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"megacritic/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(timeout_s: int = 600) -> bool:
    """Join the torchrun world, or create a world of one. Returns True if this call created a world of one
    (which :meth:`CriticWorker.close` then tears down; a torchrun world stays up for the process)."""
    if dist.is_initialized():
        return False
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = datetime.timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
        return False
    else:
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return True


def use_fused_adamw(optimizer) -> None:
    """Without Transformer Engine or apex, Megatron builds torch's AdamW with its multi-tensor (foreach)
    kernels; switch its groups to the fused CUDA kernel (one pass per update; bench/NOTES.md). torch
    reads these flags at every step, and keeps ``step`` on the parameter's device for fused groups."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            group.update(fused=True, foreach=False)


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """apex's multi_tensor_l2norm as Megatron calls it: the L2 norm of all tensors, as a [1] tensor."""
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """apex's multi_tensor_scale as Megatron calls it: dst = src * scale for every pair (dtypes may differ)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


def use_foreach_multi_tensor_ops() -> None:
    """Without Transformer Engine or apex, Megatron's grad-norm and grad-clip fall back to Python loops over
    the tensors, and the norm reads every tensor's norm on the host: one device synchronisation per
    parameter, ~800 per update_critic at 1.5B (``bench/profile_phase.py --sync-sites``), each draining the
    GPU's queue. torch's foreach kernels do the same arithmetic in a few launches and no synchronisation."""
    if clip_grads.multi_tensor_applier is not local_multi_tensor_applier:
        return  # apex or Transformer Engine kernels are there
    clip_grads.l2_norm_impl = _foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = _foreach_scale
    megatron_optimizer.multi_tensor_scale_impl = _foreach_scale


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


def _precision_aware(optimizer_config: OptimizerConfig) -> OptimizerConfig:
    """Turn on use_precision_aware_optimizer, which the hybrid device optimizer needs, after construction:
    megatron-core 0.16.1's OptimizerConfig.__post_init__ reads Transformer Engine's version whenever it is
    set and fails without TE (``None >= Version``), only to decide store_param_remainders (a TE FusedAdam
    feature, off here). The derived flag is what __post_init__ sets with CPU offload."""
    if optimizer_config.optimizer_cpu_offload:
        optimizer_config.use_precision_aware_optimizer = True
        optimizer_config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    return optimizer_config


def optimizer_steps(config: CriticConfig) -> int:
    """Optimizer steps the LR schedule spans: optim.total_training_steps, or what trainer.* implies."""
    if config.optim.total_training_steps > 0:
        return config.optim.total_training_steps
    per_iteration = config.data.rollouts_per_step // config.ppo_mini_batch_size * config.ppo_epochs
    return config.trainer.steps * per_iteration


OFFLOAD_PARTS = ("params", "grads", "optimizer")


def _optimizer_tensors(optimizer):
    """The device tensors a Megatron optimizer keeps: main parameters (float32 copies) and their state."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
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
        self.layout: Layout | None = None
        self.critic: MegatronPPOCritic | None = None
        self._owns_process_group = False
        self._on_host: set[str] = set()  # offload parts now in host memory
        self._host = {"params": PinnedOffload(), "optimizer": PinnedOffload()}

    def init_model(self) -> None:
        cfg, mg = self.config, self.config.megatron
        # 1. Distributed world and Megatron's parallel state (checked before anything is built).
        world = int(os.environ.get("WORLD_SIZE", 1)) if not dist.is_initialized() else dist.get_world_size()
        dp = validate_layout(cfg, world)
        self._check_schedule()
        cpu_optimizer = cpu_optimizer_options(cfg, on_cpu=not torch.cuda.is_available())
        self._owns_process_group = init_distributed(mg.nccl_timeout)
        on_cpu = enable_cpu_backend()
        vpp = mg.virtual_pipeline_model_parallel_size if (mg.virtual_pipeline_model_parallel_size or 1) > 1 else None
        mpu.initialize_model_parallel(mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size,
                                      virtual_pipeline_model_parallel_size=vpp,
                                      expert_model_parallel_size=mg.expert_model_parallel_size,
                                      expert_tensor_parallel_size=mg.expert_tensor_parallel_size,
                                      context_parallel_size=mg.context_parallel_size,
                                      distributed_timeout_minutes=max(1, math.ceil(mg.nccl_timeout / 60)))
        model_parallel_cuda_manual_seed(mg.seed)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
            cfg.model.dtype, torch.float32 if on_cpu else torch.bfloat16)
        tp = mg.tensor_model_parallel_size
        self.layout = layout = Layout(
            world_size=world, rank=dist.get_rank(), tp=tp, pp=mg.pipeline_model_parallel_size, vpp=vpp or 1,
            dp=dp, dp_rank=mpu.get_data_parallel_rank(), sequence_parallel=mg.sequence_parallel and tp > 1,
            device=torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device()),
            dtype=dtype, cp=mg.context_parallel_size, cp_rank=mpu.get_context_parallel_rank())

        # 2. Model chunks with our spec, weights from model.path's checkpoint or the seed (identical for every
        #    layout; each rank reads only its shard).
        tconfig = transformer_config(cfg.model, tp=tp, pp=layout.pp, vpp=vpp, cp=layout.cp,
                                     sequence_parallel=layout.sequence_parallel, dtype=dtype, on_cpu=on_cpu,
                                     variable_seq_lengths=layout.variable_seq_lengths,
                                     ep=mg.expert_model_parallel_size, etp=mg.expert_tensor_parallel_size,
                                     megatron=mg)
        # Megatron's own timers (schedule, gradient reduction, optimizer) feed the timing_s/* metrics.
        timers = Timers(log_level=mg.timing_level, log_option="max") if mg.timing_level else None
        tconfig.timers = timers
        chunks = build_value_model(cfg.model, tconfig)
        if not on_cpu and is_moe(cfg.model):
            # Megatron's router and shared-expert gate create their weights in host memory (an upstream TODO);
            # Megatron-LM moves every model to the GPU once built, and so do we (dense modules are already there).
            for chunk in chunks:
                chunk.cuda(torch.cuda.current_device())
        experts = ExpertRanks(mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size(),
                              mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size())
        load_full_weights(chunks, weight_source(cfg.model, mg.seed), cfg.model,
                          mpu.get_tensor_model_parallel_rank(), tp, padded_vocab_size(cfg.model.vocab_size, tp),
                          experts)
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
        use_foreach_multi_tensor_ops()
        o = cfg.optim
        optimizer = get_megatron_optimizer(_precision_aware(OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps,
            # clip_grad=0 disables clipping; an infinite threshold keeps Megatron measuring the norm.
            clip_grad=o.clip_grad if o.clip_grad > 0 else math.inf,
            bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_distributed_optimizer=mg.use_distributed_optimizer, timers=timers, **cpu_optimizer)), model)
        if cfg.model.use_fused_kernels and not on_cpu and not cpu_optimizer:  # the hybrid one fuses its own
            use_fused_adamw(optimizer)
        total, warmup = self._schedule_steps()
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if warmup else o.lr, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
            lr_decay_steps=total, lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay,
            end_wd=o.weight_decay, wd_incr_steps=total, wd_incr_style="constant")

        # 6. The critic itself.
        self.critic = MegatronPPOCritic(cfg, layout, model, optimizer, scheduler,
                                        StepTimers(timers, mg.timing_level))
        self.offload()  # with megatron.*_offload, the critic waits in host memory for its first call

    def _schedule_steps(self) -> tuple[int, int]:
        o = self.config.optim
        total = optimizer_steps(self.config)
        warmup = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * total)
        return total, warmup

    def _check_schedule(self) -> None:
        total, warmup = self._schedule_steps()
        if warmup >= total:
            raise ConfigError(f"optim.lr_warmup_steps: warm-up of {warmup} steps must be shorter than the "
                              f"{total} optimizer steps of the schedule (optim.total_training_steps / trainer.steps)")

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

    def offload(self, unchanged=()) -> None:
        """Move what megatron.{param,grad,optimizer}_offload name to host memory (pinned; gradient buffers are
        released, not copied) and release the device memory; parts already on the host stay there. Nothing
        to move on CPU. ``unchanged``: parts only read since their onload (freed without a copy)."""
        critic, mg = self._require_model(), self.config.megatron
        flags = {"params": mg.param_offload, "grads": mg.grad_offload, "optimizer": mg.optimizer_offload}
        todo = [part for part in OFFLOAD_PARTS if flags[part] and part not in self._on_host]
        if self.layout.device.type != "cuda" or not todo:
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
        critic.operation = f"save_checkpoint (step {step} to {root})"
        folder = checkpoint.save_checkpoint(root, step, critic.model, critic.optimizer, state)
        critic.operation = "idle"
        return folder

    def load_checkpoint(self, folder: str) -> dict:
        """Collective: restore a checkpoint saved under any TP / PP / DP layout; returns its trainer_state."""
        critic = self._require_model()
        self._check_expert_layout(folder)
        self.onload()
        critic.operation = f"load_checkpoint ({folder})"
        state = checkpoint.load_checkpoint(folder, critic.model, critic.optimizer)
        critic.operation = "idle"
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
        """Tear down Megatron's parallel state (and the process group if this worker created it)."""
        if self.critic is not None:
            mpu.destroy_model_parallel()
            self.critic = None
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False

    def export_hf(self, out_dir: str) -> None:
        """Write the critic as a Hugging Face ``*ForTokenClassification`` (num_labels=1) folder, gathered from
        any TP / PP layout. Collective: every rank calls it; rank 0 writes."""
        from megacritic.hf.export import export_hf
        self.onload()
        export_hf(self._require_model().model, self.config.model, out_dir)
