"""The critic's training state and the small functions that build it.

:class:`TrainState` holds what an update changes and a checkpoint restores: the model chunks (Megatron DDP),
Megatron's optimizer, its LR scheduler, and the count of ``update_critic`` calls (which seeds each call's
shuffle). The critic trains it, :mod:`megacritic.checkpoint` saves and loads it, :mod:`megacritic.offload`
moves it to host memory; :class:`megacritic.CriticWorker` builds it with the functions below, in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig

from megacritic.compat.kernels import precision_aware_without_te, use_fused_adamw
from megacritic.config import ConfigError, CriticConfig, is_moe
from megacritic.hf.safetensors_reader import weight_source
from megacritic.model.cuda_graphs import DecoderGraphs
from megacritic.model.value_model import build_value_model, padded_vocab_size
from megacritic.model.weights import load_full_weights
from megacritic.optim import MOMENT_DTYPES, use_moment_dtypes
from megacritic.packing.micro_batches import MicroBatchPolicy
from megacritic.parallel import ParallelLayout, Ranks


@dataclass
class TrainState:
    """Everything an update changes: model chunks, optimizer, LR scheduler, update-call count."""

    model: list  # Megatron DDP chunks, one per virtual pipeline stage
    optimizer: object  # Megatron's (distributed) optimizer
    lr_scheduler: OptimizerParamScheduler
    update_calls: int = 0  # update_critic calls so far (each call's shuffle is seeded by it)

    def parameters(self):
        return (p for chunk in self.model for p in chunk.parameters())

    def state_dict(self) -> dict:
        """The state besides the tensors (which Megatron's distributed checkpointing saves)."""
        return {"update_calls": self.update_calls, "scheduler": self.lr_scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.lr_scheduler.load_state_dict(state["scheduler"])
        self.update_calls = state["update_calls"]


def cpu_optimizer_options(config: CriticConfig, on_cpu: bool) -> dict:
    """OptimizerConfig fields of megatron.optimizer_cpu_offload: Megatron's HybridDeviceOptimizer keeps the
    float32 main parameters and Adam moments of optimizer_offload_fraction of the parameters in pinned host
    memory and steps them there (torch's CPU AdamW). Megatron runs it through its precision-aware path, where
    the distributed optimizer keeps no float32 copy on the device: the GPU holds only the bf16 parameters
    and the float32 gradient buffer (6 bytes per parameter instead of 18). Its settings were checked by
    :func:`megacritic.config.validate`; what it needs of the machine is checked here, before anything is
    built."""
    mg = config.megatron
    if not mg.optimizer_cpu_offload:
        return {}
    if on_cpu:
        raise ConfigError("megatron.optimizer_cpu_offload=true needs a CUDA GPU (the hybrid device optimizer "
                          "moves gradients and parameters between the GPU and the host); set it to false")
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=mg.optimizer_offload_fraction,
                overlap_cpu_optimizer_d2h_h2d=True, store_param_remainders=False)


def lr_schedule_steps(config: CriticConfig) -> tuple[int, int]:
    """Length and warm-up of the LR schedule, in optim.schedule_unit (optimizer steps or update calls).
    An unset length (-1) validates only for a constant schedule without warm-up, whose LR no length changes
    (Megatron's scheduler still wants a positive one)."""
    o = config.optim
    total = o.total_training_steps if o.total_training_steps > 0 else 1
    warmup = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * total)
    return total, warmup


class _FinalizeGrads:
    """Megatron's grad finalisation (DP reduction, SP norm all-reduce) without its per-token scaling:
    our loss is already normalised over the whole mini-batch (megacritic.losses)."""

    def __call__(self, model, num_tokens=None, **kwargs):
        finalize_model_grads(model, None, **kwargs)


def build_model(config: CriticConfig, tconfig: TransformerConfig, layout: ParallelLayout, ranks: Ranks) -> list:
    """This rank's model chunks with their weights (model.path's checkpoint, or the seed: identical for every
    layout, each rank reading only its shard), wrapped in Megatron DDP (contiguous float32 gradient buffers,
    reduced once per step)."""
    cfg, mg = config, config.megatron
    chunks = build_value_model(cfg.model, tconfig, ranks.chunk_roles)
    if ranks.device.type == "cuda" and is_moe(cfg.model):
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
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=mg.use_distributed_optimizer)
    model = [DistributedDataParallel(tconfig, ddp_config, chunk) for chunk in chunks]
    tconfig.finalize_model_grads_func = _FinalizeGrads()
    if cfg.model.cuda_graphs:  # after DDP: the graphs' weights carry their main_grad
        policy = MicroBatchPolicy.from_config(cfg, layout)
        lengths = {train: policy.graph_lengths(forward_only=not train) for train in (True, False)}
        for chunk in chunks:
            DecoderGraphs.install(chunk.decoder, slots=cfg.model.cuda_graph_max_rollouts + 1, lengths=lengths)
    return model


def build_optimizer(config: CriticConfig, model: list, dtype: torch.dtype, timers, fused: bool,
                    cpu_optimizer: dict):
    """Megatron's Adam (distributed over DP by default) over ``model``; ``cpu_optimizer``: the fields of
    :func:`cpu_optimizer_options`."""
    o, mg = config.optim, config.megatron
    optimizer = get_megatron_optimizer(precision_aware_without_te(OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps,
        # clip_grad=0 disables clipping; an infinite threshold keeps Megatron measuring the norm.
        clip_grad=o.clip_grad if o.clip_grad > 0 else math.inf,
        bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=mg.use_distributed_optimizer, timers=timers, **cpu_optimizer)), model)
    if (o.exp_avg_dtype, o.exp_avg_sq_dtype) != ("float32", "float32"):  # opt-in: Adam moments stored in bf16
        use_moment_dtypes(optimizer, MOMENT_DTYPES[o.exp_avg_dtype], MOMENT_DTYPES[o.exp_avg_sq_dtype], fused)
    elif fused and not cpu_optimizer:  # the hybrid one fuses its own
        use_fused_adamw(optimizer)
    return optimizer


def build_lr_scheduler(config: CriticConfig, optimizer) -> OptimizerParamScheduler:
    """Megatron's LR schedule: linear warm-up, then optim.lr_decay_style down to optim.min_lr."""
    o = config.optim
    total, warmup = lr_schedule_steps(config)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else o.lr, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=total, lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay,
        end_wd=o.weight_decay, wd_incr_steps=total, wd_incr_style="constant")
