"""The glue between the critic and Megatron-Core's pipeline schedule (``get_forward_backward_func``).

:class:`ForwardBackward` runs one rank's rollouts through Megatron's forward-backward function: it plans and builds the
micro-batches (:class:`~megacritic.packing.micro_batches.MicroBatchPolicy`), gives Megatron its
``forward_step`` and loss function (Megatron's contract: ``forward_step(data_iterator, model) -> (output,
loss_func)``, ``loss_func(output) -> (loss, num_tokens, report)``) and the pipeline's shape arguments.
:class:`StepTimers` reads Megatron's timers; :class:`MoEAuxLoss` owns the routers' load-balancing loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)
from megatron.core.transformer.moe.router import TopKRouter

from megacritic.config import ModelConfig, moe_layer_pattern
from megacritic.data.rollouts import Rollouts
from megacritic.losses import value_loss_and_stats
from megacritic.packing.micro_batches import MicroBatch, MicroBatchPolicy, to_device
from megacritic.packing.partition import reverse_index
from megacritic.parallel import ParallelLayout, ProcessGroups, Ranks

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


def max_over_dp(value: int, layout: ParallelLayout, groups: ProcessGroups) -> int:
    """The largest ``value`` over the data-parallel ranks (on the host, through the gloo group)."""
    if layout.dp == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups.dp_gloo)
    return int(t.item())


class MoEAuxLoss:
    """The MoE routers' load-balancing loss: coeff x (token-weighted mean over the mini-batch's micro-batches
    of each MoE layer's loss), normalised once for the whole mini-batch, like the value loss.

    Megatron's router (with calculate_per_token_loss) attaches coeff x aux x its local token count and leaves
    the division by the global count to grad finalisation, which our normalisation skips; under sequence
    parallelism each TP rank holds only its share of aux and of the tokens. So the routers attach their share
    unscaled (``calculate_per_token_loss`` is switched off on the routers alone, once, here), and
    :meth:`before` each micro-batch's forward sets the coefficient to coeff x its real tokens / the
    mini-batch's. The router reads the coefficient from its config at every forward, and that config is the
    one ``TransformerConfig`` shared by every layer of the model: :meth:`before` writes
    ``moe_aux_loss_coeff`` of that shared object.
    """

    def __init__(self, model: list, model_config: ModelConfig, layout: ParallelLayout, groups: ProcessGroups,
                 device: torch.device):
        self.coeff = model_config.moe_aux_loss_coeff
        self.num_layers = model_config.num_hidden_layers
        self.moe_layers = sum(moe_layer_pattern(model_config))
        self.layout, self.groups, self.device = layout, groups, device
        self.routers = [m for chunk in model for m in chunk.modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            router.calculate_per_token_loss = False
        self._tokens = 1  # real tokens of the current training mini-batch

    @property
    def active(self) -> bool:
        return bool(self.coeff) and self.moe_layers > 0

    def start(self, mini_batch_tokens: int) -> None:
        """A training mini-batch of this many real tokens (over all data-parallel ranks) begins."""
        self._tokens = max(mini_batch_tokens, 1)

    def before(self, mb: MicroBatch) -> None:
        """Set the coefficient for ``mb``'s forward (writes the shared TransformerConfig, class doc)."""
        if self.coeff and self.routers:
            # Positive even for a micro-batch of padding only: every TP rank must take part in the router's
            # token-count all-reduce, and padding contributes nothing to the loss.
            scale = self.coeff * max(mb.tokens, 1) / self._tokens
            for router in self.routers:
                router.config.moe_aux_loss_coeff = scale

    def value(self, num_micro_batches: int) -> float | None:
        """The step's load-balancing loss (without its coefficient): mean over MoE layers and micro-batches,
        averaged over data-parallel ranks. None when it is off. Collective (every rank)."""
        if not self.active:
            return None
        # Every rank takes part in the reductions, also a pipeline stage without MoE layers.
        values = torch.zeros(self.num_layers, dtype=torch.float64, device=self.device)
        tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        if tracked is not None:
            values += tracked["values"].to(values)
        clear_aux_losses_tracker()
        dist.all_reduce(values, group=self.groups.pp)  # layers live on their stage
        dist.all_reduce(values, group=self.groups.tp)  # each TP rank holds its share
        dist.all_reduce(values, group=self.groups.dp)
        return float(values.sum()) / (self.moe_layers * num_micro_batches * self.layout.dp)


# A caller's own loss (ForwardBackward.run): (rows of the micro-batch, their values [rows, R]) -> (loss, report)
ExternalLoss = Callable[[list, torch.Tensor], tuple[torch.Tensor, dict]]


@dataclass
class Pass:
    """One run of the schedule over a rank's rollouts."""

    parts: list[list[int]]  # the micro-batches' rollout indices (into the rank's rollouts)
    outputs: list[dict]     # per micro-batch: the loss function's report (empty off the last stage)
    data_seconds: float     # micro-batch planning, packing and copies to the device
    moe_aux_loss: float | None = None  # training passes of MoE models (MoEAuxLoss.value)

    def values(self) -> torch.Tensor:
        """The values the outputs report (``"values"``, [rows, R] per micro-batch, padding rows after them), of
        the rank's rollouts in their input order, on the last pipeline stage."""
        values = torch.cat([o["values"][: len(p)] for o, p in zip(self.outputs, self.parts)])
        return values[to_device(reverse_index(self.parts), values.device)]  # micro-batches -> input order


class MicroBatches:
    """A rank's micro-batches of one pass (:meth:`ForwardBackward.prepare`): the plan ``parts``, each micro-batch
    built at its first use (``build(parts) -> micro-batches``) and kept for the other model chunks' iterators
    (virtual pipeline stages walk the same micro-batches)."""

    def __init__(self, build, parts: list[list[int]], local: Rollouts, forward_only: bool, seconds: float):
        self.build, self.parts, self.local, self.forward_only = build, parts, local, forward_only
        self.built: list[MicroBatch | None] = [None] * len(parts)
        self.seconds = seconds  # spent planning and building

    def __getitem__(self, i: int) -> MicroBatch:
        if self.built[i] is None:
            start = time.perf_counter()
            (self.built[i],) = self.build([self.parts[i]])
            self.seconds += time.perf_counter() - start
        return self.built[i]

    def all(self) -> list[MicroBatch]:
        """Every micro-batch, built together (a pipeline's fixed shape is the largest of them)."""
        if any(mb is None for mb in self.built):
            assert not any(self.built), "all() must come before single micro-batches are built"
            start = time.perf_counter()
            self.built = self.build(self.parts)
            self.seconds += time.perf_counter() - start
        return self.built

    def iterate(self):
        return ((self[i], part) for i, part in enumerate(self.parts))


class ForwardBackward:
    """Runs a rank's rollouts through Megatron's pipeline schedule: forward only (values) or forward and
    backward with gradient reduction (a training mini-batch, loss weights given)."""

    def __init__(self, model: list, policy: MicroBatchPolicy, layout: ParallelLayout, ranks: Ranks,
                 groups: ProcessGroups, model_config: ModelConfig, cliprange_value: float,
                 timers: StepTimers | None = None):
        self.model, self.policy, self.layout, self.ranks, self.groups = model, policy, layout, ranks, groups
        self.cliprange_value = cliprange_value
        self.timers = timers or StepTimers(None, 0)
        self.moe = MoEAuxLoss(model, model_config, layout, groups, ranks.device)

    def run(self, local: Rollouts, weights: torch.Tensor | None = None, mini_batch_tokens: int = 0,
            loss: "ExternalLoss | None" = None, forward_only: bool | None = None,
            prepared: MicroBatches | None = None) -> Pass:
        """Forward only without ``weights``; else forward and backward of the weighted value loss, the
        gradients reduced into the model's buffers (``mini_batch_tokens``: the whole mini-batch's real tokens,
        for the MoE loss's normalisation).

        ``loss``: a loss of the caller's instead of megacritic's (a trainer's own, e.g. verl's value_loss):
        called per micro-batch as ``loss(rows, vpreds)`` with the micro-batch's rows of ``local`` and their
        values [rows, R] (whole: summed over context-parallel ranks, differentiably), it returns the tensor
        to backpropagate and the report that the pass collects; with it, ``forward_only`` says whether to
        run backward. ``prepared``: :meth:`prepare`'s micro-batches of ``local`` (made here when None)."""
        if forward_only is None:
            forward_only = weights is None
        if prepared is None:
            prepared = self.prepare(local, weights, forward_only)
        elif prepared.local is not local or prepared.forward_only != forward_only:
            raise ValueError("ForwardBackward.run: the prepared micro-batches are of other rollouts or another mode")
        micro_batches, parts = prepared, prepared.parts
        shape_b = shape_s = 0
        if self.layout.pp > 1:  # Megatron's pipeline shapes, before the schedule (prepare built them all)
            shape_b = max(mb.input_ids.shape[0] for mb in micro_batches.all())
            # Megatron's fixed pipeline shapes divide the sequence by CP: give it the whole pack's length.
            shape_s = max(mb.input_ids.shape[1] for mb in micro_batches.all()) * self.layout.cp
        if not forward_only:
            self.moe.start(mini_batch_tokens)
        # each micro-batch travels with its rows of ``local`` (an external loss reads the caller's data by them)
        iterators = [micro_batches.iterate() for _ in self.model]
        outputs = get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, forward_only, loss),
            data_iterator=iterators if len(self.model) > 1 else iterators[0],
            model=self.model,
            num_microbatches=len(parts),
            seq_length=shape_s,
            micro_batch_size=shape_b,
            forward_only=forward_only,
        )
        aux = None if forward_only else self.moe.value(len(parts))
        return Pass(parts, outputs, micro_batches.seconds, aux)

    def prepare(self, local: Rollouts, weights: torch.Tensor | None = None, forward_only: bool | None = None,
                build_first: bool = False) -> MicroBatches:
        """The plan of ``local``'s micro-batches for :meth:`run` (collective over data-parallel ranks: every rank
        runs as many), each built when the schedule asks for it (the GPU runs the previous one meanwhile). With
        a pipeline, all are built now (its shapes need them); ``build_first``: the first one too (so that a
        caller can prepare the next pass while the GPU finishes this one)."""
        if forward_only is None:
            forward_only = weights is None
        start = time.perf_counter()
        parts = self.policy.plan(local.seq_lens, forward_only, partial(max_over_dp, layout=self.layout, groups=self.groups))
        build = partial(self.policy.build, local, weights=weights, device=self.ranks.device, cp_rank=self.ranks.cp_rank,
                        forward_only=forward_only)
        micro_batches = MicroBatches(build, parts, local, forward_only, time.perf_counter() - start)
        if self.layout.pp > 1:
            micro_batches.all()
        elif build_first and parts:
            micro_batches[0]
        return micro_batches

    def _forward_step(self, forward_only: bool, loss: "ExternalLoss | None", data_iterator, model):
        mb, rows = next(data_iterator)
        # Rotary positions restart at 0 for each rollout (left-aligned rows, or position_ids when packed);
        # causal attention within a row or a packed rollout needs no attention mask.
        kwargs = {}
        if self.moe.routers:
            self.moe.before(mb)
            kwargs["padding_mask"] = self._padding_mask(mb, model)
        output = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None,
                       packed_seq_params=mb.packed, **kwargs)
        return output, partial(self._loss, mb, rows, forward_only, loss)

    def _padding_mask(self, mb: MicroBatch, model) -> torch.Tensor:
        """MoE routers leave padding out of their load-balancing statistics. GPTModel cuts the mask to this TP
        rank's sequence shard only on the first pipeline stage; later stages get their shard here."""
        mask = mb.padding_mask
        if self.layout.sequence_parallel and not getattr(model, "module", model).pre_process:
            shard = mask.shape[1] // self.layout.tp
            rank = self.ranks.tp_rank
            mask = mask[:, rank * shard:(rank + 1) * shard]
        return mask

    def _loss(self, mb: MicroBatch, rows: list[int], forward_only: bool, external: "ExternalLoss | None",
              output: torch.Tensor):
        vpreds = output.reshape(-1)[mb.value_index]  # [b, R] float32
        one = torch.ones((), dtype=torch.int, device=output.device)
        if external is not None:
            vpreds = vpreds[: len(rows)] * mb.value_mask[: len(rows)]
            if self.layout.cp > 1:
                # each context-parallel rank holds the values of its own chunks (zeros elsewhere): their sum
                # is the whole. Its backward sums the ranks' gradients too, so every CP rank computing the same
                # loss gives each value CP x its gradient: the caller scales its loss by 1 / CP.
                vpreds = dist_nn.all_reduce(vpreds, group=self.groups.cp)
            loss, report = external(rows, vpreds)
            return loss, one, report
        if forward_only:
            return vpreds.sum() * 0, one, {"values": (vpreds * mb.value_mask).detach()}
        loss, stats = value_loss_and_stats(vpreds, mb.values, mb.returns, mb.weights, mb.loss_mask,
                                           self.cliprange_value)
        return loss, one, stats
