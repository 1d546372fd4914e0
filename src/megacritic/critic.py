"""MegatronPPOCritic: values of rollout tokens, and PPO value-function updates, on Megatron-Core.

The path of a batch: checked (:mod:`megacritic.data.rollouts`) and broadcast from the last pipeline rank ->
split into mini-batches (epochs, seeded shuffle) -> loss weights computed over the whole mini-batch
(:mod:`megacritic.losses`) -> this data-parallel rank's shard -> micro-batches (:mod:`megacritic.packing.micro_batches`)
-> Megatron's pipeline schedule (forward, loss, backward, gradient reduction) -> optimizer step ->
metrics reduced once per step.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
from megatron.core.transformer.moe.router import TopKRouter

from megacritic.data.rollouts import BatchError, Rollouts, dp_shard, mini_batch_indices, rollouts_from_batch
from megacritic.packing.micro_batches import MicroBatch, build_micro_batch, plan_micro_batches
from megacritic.packing.pack import pack_length, round_up
from megacritic.config import CriticConfig, moe_layer_pattern
from megacritic.losses import STAT_KEYS, metrics_from_sums, stack_stats, token_weights, value_loss_and_stats
from megacritic.packing.partition import reverse_index

log = logging.getLogger(__name__)

# Megatron-Core's timer names (with the log level it creates them at) -> our timing_s/* metric. The schedule's
# "forward-backward" spans the whole schedule, transfers and gradient reduction included; the others are parts.
MEGATRON_TIMERS = {
    "forward-backward": (1, "forward_backward"),
    "all-grads-sync": (1, "grad_reduce"),
    **{name: (1, "optimizer") for name in (
        "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
        "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params",
        "params-all-gather")},
    "forward-compute": (2, "forward"),
    "backward-compute": (2, "backward"),
    **{name: (2, "pipeline_wait") for name in (
        "forward-recv", "backward-recv", "forward-send", "backward-send", "forward-send-backward-recv",
        "backward-send-forward-recv", "forward-send-forward-recv", "backward-send-backward-recv",
        "forward-backward-send-forward-backward-recv")},
}


class StepTimers:
    """Reads Megatron's timers (``TransformerConfig.timers`` / ``OptimizerConfig.timers``) as seconds per
    timing_s/* metric. Every timer is created up front at Megatron's own level, so those above ``level``
    are Megatron's no-op dummies and the rest always exist."""

    def __init__(self, timers, level: int):
        self.timers, self.level = timers, level
        if timers is not None:
            for name, (lvl, _) in MEGATRON_TIMERS.items():
                timers(name, log_level=lvl)

    def take(self) -> dict[str, float]:
        """Seconds accumulated since the last call, per metric (and the timers restarted from zero)."""
        out: dict[str, float] = {}
        if self.timers is None:
            return out
        for name, (lvl, metric) in MEGATRON_TIMERS.items():
            if lvl <= self.level:
                out[f"timing_s/{metric}"] = out.get(f"timing_s/{metric}", 0.0) + self.timers(name).elapsed(reset=True)
        return out


@dataclass(frozen=True)
class Layout:
    """The parallel layout of this run, derived once from the config and the world size."""

    world_size: int
    rank: int
    tp: int
    pp: int
    vpp: int  # model chunks per pipeline rank (1 without interleaving)
    dp: int
    dp_rank: int
    sequence_parallel: bool
    device: torch.device
    dtype: torch.dtype
    cp: int = 1  # context-parallel ranks that share each micro-batch (megacritic.packing.micro_batches)
    cp_rank: int = 0

    @property
    def is_last_stage(self) -> bool:
        return mpu.is_pipeline_last_stage(ignore_virtual=True)

    @property
    def fixed_micro_batch_shape(self) -> bool:
        # With two stages the interleaved schedule's previous and next peer are the same rank, and
        # megatron-core 0.16 mismatches the shape messages of the two directions: every micro-batch
        # of a mini-batch must then have the same shape (variable_seq_lengths off).
        return self.pp == 2 and self.vpp > 1

    @property
    def variable_seq_lengths(self) -> bool:
        return self.pp > 1 and not self.fixed_micro_batch_shape

    @property
    def micro_batch_multiple(self) -> int:
        return self.pp if self.vpp > 1 else 1


class MegatronPPOCritic:
    def __init__(self, config: CriticConfig, layout: Layout, model: list, optimizer=None, scheduler=None,
                 timers: StepTimers | None = None):
        self.config = config
        self.layout = layout
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.timers = timers or StepTimers(None, 0)
        self.update_calls = 0
        # What the critic is doing, for error messages when a collective fails (a peer died or hung).
        self.operation = "idle"
        self._data_time = 0.0  # this step's micro-batch planning, packing and copies to the device
        # MoE routers attach their load-balancing loss unscaled; _set_moe_aux_coeff says why.
        self._routers = [m for chunk in model for m in chunk.modules() if isinstance(m, TopKRouter)]
        for router in self._routers:
            router.calculate_per_token_loss = False
        self._aux_tokens = 1  # real tokens of the current training mini-batch (load-balancing loss)

    # ---------------------------------------------------------------- public calls

    @torch.no_grad()
    def compute_values(self, data) -> torch.Tensor:
        """Values of the response tokens, float32 [B, R], zero outside the response; on every rank."""
        self.operation = "compute_values: batch check and broadcast"
        rollouts = self._receive(data, need_targets=False)
        self.operation = "compute_values: forward (Megatron schedule)"
        rows = dp_shard(torch.arange(len(rollouts)), self.layout.dp_rank, self.layout.dp)
        local = rollouts.select(rows)
        modes = [chunk.training for chunk in self.model]
        for chunk in self.model:
            chunk.eval()
        try:
            parts, outputs = self.forward_backward_batch(local, forward_only=True)
        finally:
            for chunk, mode in zip(self.model, modes):
                chunk.train(mode)
        self.operation = "compute_values: gathering values over data-parallel and pipeline ranks"
        shape = (len(rollouts), rollouts.response_width)
        values = torch.empty(shape, dtype=torch.float32, device=self.layout.device)
        if self.layout.is_last_stage:
            local_values = torch.cat([o["values"][: len(p)] for o, p in zip(outputs, parts)])
            local_values = local_values[reverse_index(parts).to(local_values.device)]
            if self.layout.cp > 1:
                # Each context-parallel rank filled the values at the positions it holds and zeros
                # elsewhere: their sum is exact.
                dist.all_reduce(local_values, group=mpu.get_context_parallel_group())
            dist.all_gather_into_tensor(values, local_values.contiguous(), group=mpu.get_data_parallel_group())
        self._broadcast_from_last_stage(values)
        self.operation = "idle"
        return values.cpu()

    def update_critic(self, data) -> dict[str, list[float]]:
        """PPO value updates over ``ppo_epochs`` x mini-batches of ``data``; one optimizer step each.

        ``data`` is one batch or an iterable of batches. Returns verl's metric names, one value per step.
        """
        batches = [data] if _is_batch(data) else list(data)
        start = time.perf_counter()
        self.operation = "update_critic: batch check and broadcast"
        checked = [self._receive(b, need_targets=True) for b in batches]  # all refused before any step
        receive_time = time.perf_counter() - start
        metrics: dict[str, list[float]] = defaultdict(list)
        cfg = self.config
        for rollouts in checked:
            steps = list(mini_batch_indices(len(rollouts), cfg.ppo_mini_batch_size, cfg.ppo_epochs, cfg.shuffle,
                                            cfg.data_loader_seed, call_index=self.update_calls))
            for index, rows in enumerate(steps):
                mini = rollouts.select(rows)
                if not mini.response_mask.any():
                    step = self._empty_step(index)
                else:
                    weights = token_weights(mini.response_mask, cfg.loss_agg_mode)
                    local_rows = dp_shard(torch.arange(len(mini)), self.layout.dp_rank, self.layout.dp)
                    step = self.train_step(mini.select(local_rows), weights[local_rows], int(mini.seq_lens.sum()))
                # the check and broadcast of the batch, shared out over its steps
                step["timing_s/data"] += receive_time / (len(steps) * len(checked))
                for k, v in step.items():
                    metrics[k].append(v)
            self.update_calls += 1
        self.operation = "idle"
        return dict(metrics)

    def _empty_step(self, index: int) -> dict[str, float]:
        """A mini-batch without a single response token has no loss to minimise: no step is taken (an Adam
        step on zero gradients would still move the weights through momentum and weight decay)."""
        if self.layout.rank == 0:
            log.warning("update_critic: mini-batch %d has no response tokens (response_mask is all zero); "
                        "optimizer step skipped", index)
        metrics = metrics_from_sums(torch.zeros(len(STAT_KEYS), dtype=torch.float64))
        metrics.update({"critic/vf_explained_var": 0.0, "critic/grad_norm": 0.0,
                        "critic/lr": float(self.optimizer.param_groups[0]["lr"]), "critic/skipped_steps": 0.0,
                        "critic/empty_steps": 1.0, "perf/real_tokens": 0.0, "perf/tokens_per_s": 0.0,
                        "timing_s/step": 0.0, "timing_s/data": 0.0})
        metrics.update({key: 0.0 for key in self.timers.take()})
        return metrics

    # ---------------------------------------------------------------- one optimizer step

    def train_step(self, local: Rollouts, weights: torch.Tensor, global_tokens: int) -> dict[str, float]:
        start = time.perf_counter()
        self.timers.take()  # drop what earlier forward-only calls left on the timers
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.operation = "update_critic: forward/backward and gradient reduction (Megatron schedule)"
        self._aux_tokens = max(global_tokens, 1)
        parts, outputs = self.forward_backward_batch(local, forward_only=False, weights=weights)
        self.operation = "update_critic: reducing loss statistics"
        sums = self._reduce_stats(outputs)
        aux_loss = self._moe_aux_loss(len(parts))
        self.operation = "update_critic: optimizer step"
        lr = self.optimizer.param_groups[0]["lr"]
        # The loss is checked too: a loss that overflowed can still leave finite (huge) gradients, whose
        # norm then overflows and Megatron's clipping would zero them instead of reporting the fault.
        if bool(torch.isfinite(sums[STAT_KEYS.index("loss")])) and self._grads_finite():
            _, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            skipped = 0.0
        else:
            # A non-finite loss or gradient would poison the weights: keep them, report the step.
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            grad_norm, skipped = float("nan"), 1.0
        elapsed = time.perf_counter() - start
        metrics = metrics_from_sums(sums)
        metrics.update({
            "critic/grad_norm": float(grad_norm),
            "critic/lr": float(lr),
            "critic/skipped_steps": skipped,
            "perf/real_tokens": float(global_tokens),
            "perf/tokens_per_s": global_tokens / elapsed,
            "critic/empty_steps": 0.0,
            "timing_s/step": elapsed,
            "timing_s/data": self._data_time,
        })
        metrics.update(self.timers.take())
        if aux_loss is not None:
            metrics["critic/moe_aux_loss"] = aux_loss
        return metrics

    # ---------------------------------------------------------------- MoE load-balancing loss

    def _set_moe_aux_coeff(self, mb: MicroBatch) -> None:
        """Make the step's load-balancing loss coeff x (token-weighted mean over the mini-batch's micro-batches
        of each MoE layer's loss): normalised once for the whole mini-batch, like the value loss.

        Megatron's router (with calculate_per_token_loss) attaches coeff x aux x its local token count and
        leaves the division by the global count to grad finalisation, which our normalisation skips; under
        sequence parallelism each TP rank holds only its share of aux and of the tokens. So the routers attach
        their share unscaled (calculate_per_token_loss off on the routers alone), and before each micro-batch's
        forward the coefficient becomes coeff x its real tokens / the mini-batch's; the router reads it from
        its TransformerConfig at every forward (Megatron's config object, not ours).
        """
        coeff = self.config.model.moe_aux_loss_coeff
        if coeff and self._routers:
            # Positive even for a micro-batch of padding only: every TP rank must take part in the router's
            # token-count all-reduce, and padding contributes nothing to the loss.
            scale = coeff * max(mb.tokens, 1) / self._aux_tokens
            for router in self._routers:
                router.config.moe_aux_loss_coeff = scale

    def _moe_aux_loss(self, num_micro_batches: int) -> float | None:
        """The step's load-balancing loss (without its coefficient): mean over MoE layers and micro-batches,
        averaged over data-parallel ranks. None when it is off."""
        if self.config.model.moe_aux_loss_coeff == 0 or not any(moe_layer_pattern(self.config.model)):
            return None
        # Every rank takes part in the reductions, also a pipeline stage without MoE layers.
        values = torch.zeros(self.config.model.num_hidden_layers, dtype=torch.float64, device=self.layout.device)
        tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        if tracked is not None:
            values += tracked["values"].to(values)
        clear_aux_losses_tracker()
        dist.all_reduce(values, group=mpu.get_pipeline_model_parallel_group())  # layers live on their stage
        dist.all_reduce(values, group=mpu.get_tensor_model_parallel_group())  # each TP rank holds its share
        dist.all_reduce(values, group=mpu.get_data_parallel_group())
        layers = sum(moe_layer_pattern(self.config.model))
        return float(values.sum()) / (layers * num_micro_batches * self.layout.dp)

    # ---------------------------------------------------------------- Megatron schedule

    def forward_backward_batch(self, local: Rollouts, forward_only: bool, weights: torch.Tensor | None = None):
        """Run this rank's rollouts through Megatron's schedule in micro-batches.

        Returns (partitions, per-micro-batch outputs of the loss function; empty off the last stage).
        """
        cfg, layout = self.config, self.layout
        if cfg.use_dynamic_bsz:
            budget = cfg.ppo_max_token_len_per_gpu
            if forward_only:
                budget = cfg.forward_max_token_len_per_gpu or budget
            # As in verl: the budget is per GPU, and a micro-batch is shared by the CP ranks.
            budget *= layout.cp
            size = None
        else:
            budget = None
            size = cfg.ppo_micro_batch_size_per_gpu
            if forward_only:
                size = cfg.forward_micro_batch_size_per_gpu or size
            if len(local) % size:
                raise BatchError(f"{len(local)} rollouts per data-parallel rank are not a multiple of the "
                                 f"micro-batch size {size}")
        start = time.perf_counter()
        parts = plan_micro_batches(local.seq_lens.tolist(), micro_batch_size=size, max_tokens=budget,
                                   multiple_of=layout.micro_batch_multiple, max_over_ranks=self._max_over_dp)
        seq_multiple = layout.tp if layout.sequence_parallel else 1
        packed = cfg.model.use_remove_padding
        pad_to = None
        if layout.fixed_micro_batch_shape:
            lens = local.seq_lens
            if packed:
                pad_to = (1, max(pack_length(lens[p], seq_multiple, layout.cp) for p in parts))
            else:
                pad_to = (max(len(p) for p in parts), round_up(int(lens.max()), seq_multiple))
        micro_batches = [build_micro_batch(local, p, packed=packed, seq_multiple=seq_multiple, pad_to=pad_to,
                                           weights=weights, device=layout.device, cp_size=layout.cp,
                                           cp_rank=layout.cp_rank) for p in parts]
        self._data_time = time.perf_counter() - start
        shape_b = max(mb.input_ids.shape[0] for mb in micro_batches)
        # Megatron's fixed pipeline shapes divide the sequence by CP: give it the whole pack's length.
        shape_s = max(mb.input_ids.shape[1] for mb in micro_batches) * layout.cp
        iterators = [iter(micro_batches) for _ in self.model]
        outputs = get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, forward_only),
            data_iterator=iterators if len(self.model) > 1 else iterators[0],
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=shape_s,
            micro_batch_size=shape_b,
            forward_only=forward_only,
        )
        return parts, outputs

    def _forward_step(self, forward_only: bool, data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        # Rotary positions restart at 0 for each rollout (left-aligned rows, or position_ids when packed);
        # causal attention within a row or a packed rollout needs no attention mask.
        kwargs = {}
        if self._routers:
            self._set_moe_aux_coeff(mb)
            kwargs["padding_mask"] = self._padding_mask(mb, model)
        output = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None,
                       packed_seq_params=mb.packed, **kwargs)
        return output, partial(self._loss, mb, forward_only)

    def _padding_mask(self, mb: MicroBatch, model) -> torch.Tensor:
        """MoE routers leave padding out of their load-balancing statistics. GPTModel cuts the mask to this TP
        rank's sequence shard only on the first pipeline stage; later stages get their shard here."""
        mask = mb.padding_mask
        if self.layout.sequence_parallel and not getattr(model, "module", model).pre_process:
            shard = mask.shape[1] // self.layout.tp
            rank = mpu.get_tensor_model_parallel_rank()
            mask = mask[:, rank * shard:(rank + 1) * shard]
        return mask

    def _loss(self, mb: MicroBatch, forward_only: bool, output: torch.Tensor):
        vpreds = output.reshape(-1)[mb.value_index]  # [b, R] float32
        one = torch.ones((), dtype=torch.int, device=output.device)
        if forward_only:
            return vpreds.sum() * 0, one, {"values": (vpreds * mb.value_mask).detach()}
        loss, stats = value_loss_and_stats(vpreds, mb.values, mb.returns, mb.weights, mb.loss_mask,
                                           self.config.cliprange_value)
        return loss, one, stats

    # ---------------------------------------------------------------- communication

    def _receive(self, data, need_targets: bool) -> Rollouts:
        """Check the batch, then take the last pipeline rank's copy (so every stage sees the same data)."""
        rollouts = rollouts_from_batch(data, need_targets, vocab_size=self.config.model.vocab_size)
        limit = self.config.model.max_position_embeddings
        too_long = rollouts.seq_lens > limit
        if too_long.any():
            rows = too_long.nonzero().flatten().tolist()
            raise BatchError(f"attention_mask: rollouts {rows[:8]} have {int(rollouts.seq_lens.max())} real tokens, "
                             f"more than the model's {limit} positions (model.max_position_embeddings)")
        if self.layout.pp == 1:
            return rollouts
        group, device = mpu.get_pipeline_model_parallel_group(), self.layout.device
        shape = torch.tensor([*rollouts.input_ids.shape, rollouts.response_width, int(need_targets)], device=device)
        shapes = [torch.empty_like(shape) for _ in range(self.layout.pp)]
        dist.all_gather(shapes, shape, group=group)
        if any(not torch.equal(s, shape) for s in shapes):
            raise BatchError(f"pipeline ranks were given batches of different shapes: {[s.tolist() for s in shapes]}")
        for tensor in rollouts.tensors().values():
            on_device = tensor.to(device)
            dist.broadcast(on_device, src=mpu.get_pipeline_model_parallel_last_rank(), group=group)
            tensor.copy_(on_device)
        return rollouts

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> None:
        if self.layout.pp > 1:
            dist.broadcast(tensor, src=mpu.get_pipeline_model_parallel_last_rank(),
                           group=mpu.get_pipeline_model_parallel_group())

    def _reduce_stats(self, outputs: list[dict]) -> torch.Tensor:
        """Stat sums of the whole mini-batch on every rank: over micro-batches, DP and CP ranks (each CP
        rank counted only the tokens whose values it holds), then PP."""
        sums = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=self.layout.device)
        if self.layout.is_last_stage:
            sums = stack_stats(outputs, self.layout.device)
            dist.all_reduce(sums, group=mpu.get_data_parallel_group(with_context_parallel=True))
        self._broadcast_from_last_stage(sums)
        return sums

    def _grads_finite(self) -> bool:
        bad = torch.zeros((), dtype=torch.float32, device=self.layout.device)
        for chunk in self.model:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                bad += (~torch.isfinite(buffer.grad_data)).any()
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad.item() == 0

    def _max_over_dp(self, value: int) -> int:
        if self.layout.dp == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mpu.get_data_parallel_group_gloo())
        return int(t.item())


def _is_batch(data) -> bool:
    from tensordict import TensorDict
    return isinstance(data, TensorDict) or isinstance(getattr(data, "batch", None), TensorDict)
