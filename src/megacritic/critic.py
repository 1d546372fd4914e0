"""MegatronPPOCritic: values of rollout tokens, and PPO value-function updates.

The path of a batch: checked (:mod:`megacritic.data.rollouts`) and broadcast from the last pipeline rank ->
split into mini-batches (epochs, seeded shuffle) -> loss weights computed over the whole mini-batch
(:mod:`megacritic.losses`) -> this data-parallel rank's shard, balanced by tokens -> the pipeline schedule
(:mod:`megacritic.forward_backward`: micro-batches, forward, loss, backward, gradient reduction) -> optimizer step ->
metrics reduced once per step (:func:`megacritic.losses.step_metrics`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megacritic.config import CriticConfig
from megacritic.data.rollouts import (
    BatchError,
    Rollouts,
    check_batch,
    dp_shards,
    mini_batch_indices,
    to_tensordict,
)
from megacritic.forward_backward import MicroBatches, Pass
from megacritic.losses import STAT_KEYS, stack_stats, step_metrics, token_weights
from megacritic.optim import step_on_device, steps_on_device
from megacritic.packing.micro_batches import to_device
from megacritic.packing.partition import reverse_index
from megacritic.parallel import ParallelLayout, ProcessGroups, Ranks
from megacritic.train_state import TrainState

log = logging.getLogger(__name__)


class MegatronPPOCritic:
    """The PPO critic's algorithm over a Megatron model: ``compute_values`` and ``update_critic``.

    ``state`` is what it trains (model chunks, optimizer, LR scheduler, call count: :class:`TrainState`);
    ``forward_backward`` runs a rank's rollouts through the pipeline
    (:class:`megacritic.forward_backward.ForwardBackward`); ``groups``: the process groups of its collectives.
    """

    def __init__(self, config: CriticConfig, layout: ParallelLayout, ranks: Ranks, groups: ProcessGroups,
                 state: TrainState, forward_backward):
        self.config = config
        self.layout, self.ranks, self.groups = layout, ranks, groups
        self.state = state
        self.forward_backward = forward_backward
        self._operation = "idle"
        # Training rollouts are dealt to data-parallel ranks in whole fixed-size micro-batches (dp_shards).
        self._dp_unit = forward_backward.policy.train.size or 1

    # ---------------------------------------------------------------- what the critic is doing

    @property
    def operation(self) -> str:
        """What the critic is doing, or was doing when a call failed (e.g. a collective whose peer died)."""
        return self._operation

    @contextlib.contextmanager
    def doing(self, operation: str):
        """Name what runs inside for error messages (back to idle when it returns; a failure keeps the name)
        and, as a range, for the torch profiler's traces."""
        self._operation = operation
        with torch.profiler.record_function(operation):
            yield
        self._operation = "idle"

    # ---------------------------------------------------------------- public calls

    @torch.no_grad()
    def compute_values(self, data) -> torch.Tensor:
        """Values of the response tokens, float32 [B, R], zero outside the response; on every rank."""
        with self.doing("compute_values: batch check and broadcast"):
            rollouts = self._receive(data, need_targets=False)
        with self.doing("compute_values: forward (Megatron schedule)"):
            shards = dp_shards(rollouts.seq_lens, self.layout.dp)
            local = self.local_values(self._share(rollouts, shards[self.ranks.dp_rank]))
        with self.doing("compute_values: gathering values over data-parallel and pipeline ranks"):
            values = torch.empty((len(rollouts), rollouts.response_width), dtype=torch.float32,
                                 device=self.ranks.device)
            if local is not None:
                if self.layout.dp > 1:
                    gathered = torch.empty_like(values)
                    dist.all_gather_into_tensor(gathered, local.contiguous(), group=self.groups.dp)
                    local = gathered[to_device(reverse_index(shards), gathered.device)]  # shards -> input order
                values.copy_(local)
            self._broadcast_from_last_stage(values)
        return values.cpu()

    @torch.no_grad()
    def local_values(self, local: Rollouts) -> torch.Tensor | None:
        """Values of this rank's rollouts ``local`` (forward only, eval mode): float32 [len(local), R] on the
        device, in their order, zero outside the response; on the last pipeline stage (None on the others).
        Collective over the pipeline and context-parallel ranks."""
        model = self.state.model
        modes = [chunk.training for chunk in model]
        for chunk in model:
            chunk.eval()
        try:
            run = self.forward_backward.run(local)
        finally:
            for chunk, mode in zip(model, modes):
                chunk.train(mode)
        if not self.ranks.is_last_stage:
            return None
        values = run.values()
        if self.layout.cp > 1:
            # Each context-parallel rank filled the values at the positions it holds and zeros elsewhere:
            # their sum is exact.
            dist.all_reduce(values, group=self.groups.cp)
        return values

    def update_critic(self, data) -> dict[str, list[float]]:
        """PPO value updates over ``ppo_epochs`` x mini-batches of ``data``; one optimizer step each.

        ``data`` is one batch or an iterable of batches. Returns verl's metric names, one value per step.
        With ``optim.schedule_unit=call`` the LR schedule advances once at the end of the call.
        """
        batches = [data] if _is_batch(data) else list(data)
        start = time.perf_counter()
        with self.doing("update_critic: batch check and broadcast"):
            checked = [self._receive(b, need_targets=True) for b in batches]  # all refused before any step
        receive_time = time.perf_counter() - start
        metrics: dict[str, list[float]] = defaultdict(list)
        cfg = self.config

        last = time.perf_counter()  # when the last step's results were read

        def record(step: dict[str, float], steps_in_batch: int) -> None:
            # the check and broadcast of the batches, shared out over their steps
            step["timing_s/data"] += receive_time / (steps_in_batch * len(checked))
            for k, v in step.items():
                metrics[k].append(v)

        def finish(step: _Step, steps_in_batch: int) -> None:
            nonlocal last
            record(self._finish_step(step, since=last), steps_in_batch)
            last = time.perf_counter()

        for rollouts in checked:
            steps = mini_batch_indices(len(rollouts), cfg.ppo_mini_batch_size, cfg.ppo_epochs, cfg.shuffle,
                                       cfg.data_loader_seed, call_index=self.state.update_calls)
            inputs = [None] * (len(steps) + 1)

            def prepare(i: int) -> None:
                if i < len(steps):
                    inputs[i] = self._step_inputs(rollouts.select(steps[i]))

            prepare(0)
            # Step k's results are read while the GPU runs step k + 1's forward-backward, queued before the
            # read; its optimizer step is queued after it (the read says whether the LR schedule moves).
            pending = None
            for index in range(len(steps)):
                if inputs[index] is None:  # no response token in the mini-batch
                    if pending is not None:
                        finish(pending, len(steps))
                        pending = None
                    record(self._empty_step(index), len(steps))
                    prepare(index + 1)
                else:
                    # the next step's rollouts and first micro-batch are prepared while the GPU runs this one
                    queued = self._queue_forward_backward(*inputs[index], meanwhile=partial(prepare, index + 1))
                    if pending is not None:
                        finish(pending, len(steps))
                    self._queue_optimizer_step(queued)
                    pending = queued
                inputs[index] = None
            if pending is not None:
                finish(pending, len(steps))
            self.state.update_calls += 1
        if cfg.optim.schedule_unit == "call":
            self.state.lr_scheduler.step(increment=1)
        return dict(metrics)

    def _step_inputs(self, mini: Rollouts) -> tuple | None:
        """train_step's arguments for a mini-batch: this rank's share, its loss weights (over the whole
        mini-batch), the mini-batch's real tokens, and the share's micro-batches planned with the first one
        built (collective over data-parallel ranks); None for a mini-batch without a response token."""
        if not mini.response_mask.any():
            return None
        cfg = self.config
        tokens = int(mini.seq_lens.sum())
        weights = token_weights(mini.response_mask, cfg.loss_agg_mode, horizon=cfg.loss_scale_factor)
        local = dp_shards(mini.seq_lens, self.layout.dp, unit=self._dp_unit)[self.ranks.dp_rank]
        mini, weights = self._share(mini, local), self._share(weights, local)
        return mini, weights, tokens, self.forward_backward.prepare(mini, weights, build_first=True)

    def _share(self, x, rows: torch.Tensor):
        """This data-parallel rank's ``rows`` of ``x`` (Rollouts or a tensor); at DP = 1 they are all of them, in
        order, and ``x`` is used as it is (no copy)."""
        if self.layout.dp == 1:
            return x
        return x.select(rows) if isinstance(x, Rollouts) else x[rows]

    def _empty_step(self, index: int) -> dict[str, float]:
        """A mini-batch without a single response token has no loss to minimise: no step is taken (an Adam
        step on zero gradients would still move the weights through momentum and weight decay)."""
        if self.ranks.rank == 0:
            log.warning("update_critic: mini-batch %d has no response tokens (response_mask is all zero); "
                        "optimizer step skipped", index)
        return step_metrics(torch.zeros(len(STAT_KEYS), dtype=torch.float64), grad_norm=0.0, lr=self._lr(),
                            skipped=False, empty=True, tokens=0, seconds=0.0, data_seconds=0.0,
                            timers={key: 0.0 for key in self.forward_backward.timers.take()})

    # ---------------------------------------------------------------- one optimizer step

    def train_step(self, local: Rollouts, weights: torch.Tensor, global_tokens: int,
                   prepared: MicroBatches | None = None, meanwhile: Callable[[], None] | None = None
                   ) -> dict[str, float]:
        """One optimizer step on this rank's share ``local`` of a mini-batch of ``global_tokens`` real tokens;
        ``weights``: the share's loss weights, computed over the whole mini-batch; ``prepared``: its
        micro-batches (:meth:`ForwardBackward.prepare`; planned here when None). ``meanwhile``: host work run
        once the step's forward-backward is queued (e.g. preparing the next step). Returns its metrics.
        (update_critic runs the same three parts, overlapping each step's end with the next one's start.)"""
        queued = self._queue_forward_backward(local, weights, global_tokens, prepared, meanwhile)
        self._queue_optimizer_step(queued)
        return self._finish_step(queued)

    def _queue_forward_backward(self, local: Rollouts, weights: torch.Tensor, global_tokens: int,
                                prepared: MicroBatches | None = None,
                                meanwhile: Callable[[], None] | None = None) -> _Step:
        """A step's first part: gradients zeroed, forward-backward and loss statistics queued on the device."""
        start = time.perf_counter()
        self.forward_backward.timers.take()  # drop what earlier forward-only calls left on the timers
        self._zero_grad()
        with self.doing("update_critic: forward/backward and gradient reduction (Megatron schedule)"):
            run = self.forward_backward.run(local, weights, mini_batch_tokens=global_tokens, prepared=prepared)
        with self.doing("update_critic: reducing loss statistics"):
            sums = self._reduce_stats(run.outputs)
        step = _Step(run, sums, global_tokens, start, self.forward_backward.timers.take())
        if meanwhile is not None:
            with self.doing("update_critic: preparing the next step"):
                meanwhile()
        return step

    def _queue_optimizer_step(self, step: _Step) -> None:
        """A step's second part: the gradient check and the optimizer step. On the device where the optimizer
        allows it (:func:`megacritic.optim.steps_on_device`): a non-finite loss or grad norm (any gradient inf
        or NaN) makes the step keep the weights there, and the results start their way to the host without
        the host waiting. Otherwise the host reads the check first and decides (:meth:`optimizer_step`)."""
        with self.doing("update_critic: optimizer step"):
            step.lr = self._lr()
            # The loss is checked too: a loss that overflowed can still leave finite (huge) gradients, whose
            # norm then overflows and Megatron's clipping would zero them instead of reporting the fault.
            loss_finite = torch.isfinite(step.sums[STAT_KEYS.index("loss")])
            if steps_on_device(self.state.optimizer):
                grad_norm, skip = step_on_device(self.state.optimizer, (~loss_finite).to(torch.float32))
                step.results = _HostCopy(torch.cat([step.sums, skip.to(torch.float64).reshape(1),
                                                    grad_norm.reshape(1)]))
            else:
                # one host read for the statistics and the check: each read waits for the GPU's queue to drain
                host = torch.cat([step.sums, self.nonfinite_grads().to(step.sums.dtype).reshape(1),
                                  loss_finite.to(step.sums.dtype).reshape(1)]).cpu()
                applied, grad_norm = self.optimizer_step(bool(host[-1]), grads_finite=bool(host[-2] == 0))
                step.results = _HostCopy(torch.cat([host[:-2], torch.tensor([float(not applied), grad_norm],
                                                                            dtype=host.dtype)]))
        for key, seconds in self.forward_backward.timers.take().items():  # the optimizer's timers
            step.timers[key] = step.timers.get(key, 0.0) + seconds

    def _finish_step(self, step: _Step, since: float | None = None) -> dict[str, float]:
        """A step's last part: its results read on the host (waiting for its own GPU work, not for what was
        queued after it), the LR schedule advanced if it was applied, its metrics. ``since``: when the step
        before it finished, if later than this one's start (its time is counted from there, so that steps
        whose work overlaps add up to the call's time)."""
        with self.doing("update_critic: reading the step's results"):
            results = step.results.wait()
        sums, skipped, grad_norm = results[:-2], bool(results[-2]), float(results[-1])
        if not skipped and self.config.optim.schedule_unit == "step":
            self.state.lr_scheduler.step(increment=1)
        return step_metrics(sums, grad_norm=float("nan") if skipped else grad_norm, lr=step.lr, skipped=skipped,
                            empty=False, tokens=step.tokens,
                            seconds=time.perf_counter() - max(step.start, since or step.start),
                            data_seconds=step.run.data_seconds, timers=step.timers,
                            moe_aux_loss=step.run.moe_aux_loss)

    def optimizer_step(self, loss_finite: bool = True, grads_finite: bool | None = None) -> tuple[bool, float]:
        """Apply the gradients in the model's buffers, unless the loss (``loss_finite``, the same on every
        rank) or a gradient is not finite: then the weights are kept, the gradients dropped and the grad
        norm is NaN. ``grads_finite``: the gradient check when the caller already read it (None: checked
        here). Returns (applied, grad norm before clipping). Collective."""
        if grads_finite is None and loss_finite:
            grads_finite = bool(self.nonfinite_grads().item() == 0)
        if loss_finite and grads_finite:
            _, grad_norm, _ = self.state.optimizer.step()
            return True, grad_norm
        # A non-finite loss or gradient would poison the weights: keep them, report the step.
        self._zero_grad()
        return False, float("nan")

    def forward_backward_batch(self, local: Rollouts, loss, forward_only: bool, mini_batch_tokens: int = 0):
        """This rank's rollouts ``local`` through the pipeline schedule with a trainer's own ``loss``
        (:meth:`megacritic.forward_backward.ForwardBackward.run`): forward only, or forward and backward with
        the gradients reduced into the model's buffers (no optimizer step). Returns the runner's
        :class:`~megacritic.forward_backward.Pass`."""
        model = self.state.model
        modes = [chunk.training for chunk in model]
        for chunk in model:
            chunk.train(not forward_only)
        try:
            with self.doing(f"{'forward' if forward_only else 'forward/backward'} of a trainer's batch "
                            "(Megatron schedule)"):
                return self.forward_backward.run(local, mini_batch_tokens=mini_batch_tokens, loss=loss,
                                                 forward_only=forward_only)
        finally:
            for chunk, mode in zip(model, modes):
                chunk.train(mode)

    def zero_grad(self) -> None:
        """Zero the model's gradient buffers and the optimizer's gradients."""
        self._zero_grad()

    def _zero_grad(self) -> None:
        for chunk in self.state.model:
            chunk.zero_grad_buffer()
        self.state.optimizer.zero_grad()

    def _lr(self) -> float:
        return float(self.state.optimizer.param_groups[0]["lr"])

    # ---------------------------------------------------------------- the critic's collectives

    def _receive(self, data, need_targets: bool) -> Rollouts:
        """Check the batch, then take the last pipeline rank's copy (so every stage sees the same data)."""
        model = self.config.model
        rollouts = check_batch(data, need_targets, model.vocab_size, model.max_position_embeddings)
        if self.layout.pp == 1:
            return rollouts
        device, group = self.ranks.device, self.groups.pp
        shape = torch.tensor([*rollouts.input_ids.shape, rollouts.response_width, int(need_targets)], device=device)
        shapes = [torch.empty_like(shape) for _ in range(self.layout.pp)]
        dist.all_gather(shapes, shape, group=group)
        if any(not torch.equal(s, shape) for s in shapes):
            raise BatchError(f"pipeline ranks were given batches of different shapes: {[s.tolist() for s in shapes]}")
        for tensor in rollouts.tensors().values():
            on_device = tensor.to(device)
            dist.broadcast(on_device, src=self.groups.pp_last_rank, group=group)
            tensor.copy_(on_device)
        return rollouts

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> None:
        if self.layout.pp > 1:
            dist.broadcast(tensor, src=self.groups.pp_last_rank, group=self.groups.pp)

    def _reduce_stats(self, outputs: list[dict]) -> torch.Tensor:
        """Stat sums of the whole mini-batch on every rank: over micro-batches, DP and CP ranks (each CP
        rank counted only the tokens whose values it holds), then PP."""
        sums = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=self.ranks.device)
        if self.ranks.is_last_stage:
            sums = stack_stats(outputs, self.ranks.device)
            if self.layout.dp * self.layout.cp > 1:
                dist.all_reduce(sums, group=self.groups.dp_cp)
        self._broadcast_from_last_stage(sums)
        return sums

    def nonfinite_grads(self) -> torch.Tensor:
        """A device scalar, non-zero when some rank's gradient buffer holds a non-finite value."""
        bad = torch.zeros((), dtype=torch.float32, device=self.ranks.device)
        for chunk in self.state.model:
            for buffer in (b for b in chunk.buffers + chunk.expert_parallel_buffers if b.grad_data.numel()):
                # The largest magnitude is inf or NaN exactly when some entry is; as one reduction it needs
                # no buffer-sized temporary (isfinite's mask is 1 byte per parameter: 6.6 GiB at 7B).
                bad += ~torch.isfinite(torch.linalg.vector_norm(buffer.grad_data, float("inf")))
        if self.layout.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad


def _is_batch(data) -> bool:
    try:
        to_tensordict(data)
    except BatchError:
        return False
    return True


@dataclass
class _Step:
    """An optimizer step on its way: queued on the device, its results read by ``_finish_step``."""
    run: Pass
    sums: torch.Tensor  # the loss statistics (STAT_KEYS), on the device
    tokens: int  # the mini-batch's real tokens
    start: float  # when its first part began (time.perf_counter)
    timers: dict[str, float]
    lr: float = 0.0
    results: _HostCopy | None = None  # STAT_KEYS sums, skipped (1.0 / 0.0), grad norm


class _HostCopy:
    """A device tensor's copy to the host, started now and read later: reading waits for the GPU work queued
    before the copy, not for what was queued after it (a pinned buffer and an event on a GPU). The caller
    hands over ``tensor`` (a host tensor is kept as it is)."""

    def __init__(self, tensor: torch.Tensor):
        self._host, self._event = tensor, None  # on the host already: nothing to wait for
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host
