"""megacritic as a verl engine: the ``BaseEngine`` that verl's own ``TrainingWorker`` runs for the critic
(``model_type="value_model"``, backend ``megacritic``, CUDA and CPU), in verl's V1 trainer (the default)
and V0 alike.

verl keeps the PPO loop: it splits each batch over the data-parallel ranks, makes mini-batches and epochs,
passes the loss (``partial(value_loss, config=critic)``, normalised over the global mini-batch) and steps
the LR schedule once per update call. The engine brings the rest of megacritic: its value model and
weights, packed micro-batches under a token budget, FlashAttention, Megatron's pipeline schedule, the
optimizer (a step with a non-finite loss or gradient is skipped and reported as a NaN grad norm, where
verl's engine raises), offload and atomic checkpoints that reshard over layouts.

The path of a batch (``forward_backward_batch``): verl's TensorDict (V0: ``left_right_2_no_padding``'s
nested tokens beside padded prompts / responses / masks; V1: every field nested, from TransferQueue) is
read once as megacritic's checked :class:`~megacritic.data.rollouts.Rollouts`; every rank's check is agreed
before any collective, so a malformed batch fails on every rank with the same message, naming the key,
and nothing changes. Then:

* values (``infer_batch`` without a loss): ``CriticWorker.compute_values``' own forward on this rank's
  rollouts (:meth:`~megacritic.CriticWorker.local_values`), laid out per token once at the end
  (``P_b - 1 + i`` holds response token i, as verl's ``no_padding_2_padding`` reads it).
* with a loss: the mini-batch's loss tokens over data-parallel ranks (verl's ``batch_num_tokens``,
  ``dp_size``) -> megacritic's micro-batches through Megatron's schedule, each calling verl's loss on its
  rows; megacritic sums gradients over data- and context-parallel ranks where verl's Megatron averages
  them, so the loss is divided by DP x CP. verl's own ``value_loss`` is computed as verl computes it, its
  metrics kept on the device (:class:`_ValueLoss`); any other loss gets its rows of verl's TensorDict and
  the values per token (:class:`_TrainerLoss`). The losses, metrics and the step's verdict reach the host in
  one read after the schedule, as in ``CriticWorker.update_critic``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import compute_value_loss
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.utils.py_functional import append_to_dict
from verl.utils.torch_functional import masked_mean
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
from verl.workers.utils.losses import value_loss

from megacritic.data.rollouts import BatchError, check_batch, nested_token_values
from megacritic.integrations.verl.checkpoints import load_latest, save_and_prune
from megacritic.integrations.verl.config import config_from_verl
from megacritic.integrations.verl.config_classes import BACKEND
from megacritic.packing.micro_batches import to_device


def _is_nested(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_nested


def padded_batch(data):
    """verl's TensorDict as megacritic's padded layout (left-padded prompts, right-padded responses).

    V0 (``left_right_2_no_padding``) keeps ``attention_mask``, ``prompts`` and ``responses`` padded: megacritic
    reads that layout as it is. V1 (TransferQueue) holds every field nested, one row per rollout of its real
    tokens: ``prompts`` and ``responses`` give each rollout's lengths, ``input_ids`` / ``position_ids`` its
    tokens, and ``response_mask`` / ``values`` / ``returns`` one entry per response token."""
    keys = set(data.keys())
    if "prompts" not in keys or not _is_nested(data["prompts"]):
        return data
    for key in ("responses", "input_ids", "position_ids"):
        if key not in keys:
            raise BatchError(f"batch is missing key {key!r}; it has {sorted(keys)}")
        if not _is_nested(data[key]):
            raise BatchError(f"{key}: with nested prompts (verl's V1 layout) it must be nested too, got a "
                             f"padded tensor of shape {tuple(data[key].shape)}")
    p_len, r_len = data["prompts"].offsets().diff(), data["responses"].offsets().diff()
    b, p, r = len(p_len), int(p_len.max()), int(r_len.max())
    cols_p, cols_r = torch.arange(p), torch.arange(r)
    prompt_real = cols_p[None, :] >= (p - p_len)[:, None]
    response_real = cols_r[None, :] < r_len[:, None]
    attention_mask = torch.cat([prompt_real, response_real], 1)
    lens = data["input_ids"].offsets().diff()
    bad = lens != p_len + r_len
    if bad.any():
        rows = bad.nonzero().flatten().tolist()[:8]
        raise BatchError(f"input_ids (nested) rows {rows} do not hold prompts + responses tokens "
                         f"({lens[bad].tolist()[:8]} vs {(p_len + r_len)[bad].tolist()[:8]})")
    out = {"attention_mask": attention_mask.long(), "input_ids": data["input_ids"],
           "position_ids": data["position_ids"],
           "prompts": torch.zeros((b, p), dtype=torch.long).masked_scatter(prompt_real, data["prompts"].values()),
           "responses": torch.zeros((b, r), dtype=torch.long).masked_scatter(response_real,
                                                                             data["responses"].values())}
    for key in ("response_mask", "values", "returns"):
        if key in keys:
            x = data[key]
            if not _is_nested(x) or len(x.offsets()) != b + 1 or not torch.equal(x.offsets().diff(), r_len):
                raise BatchError(f"{key}: with nested responses (verl's V1 layout) it must be nested with one "
                                 "entry per response token")
            out[key] = x.to_padded_tensor(0.0, output_size=(b, r))
    return TensorDict(out, batch_size=[b])


@EngineRegistry.register(model_type="value_model", backend=BACKEND, device=["cuda", "cpu"])
class MegacriticEngine(BaseEngine):
    """verl's engine contract over :class:`megacritic.CriticWorker` (module doc)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        from megacritic import CriticWorker, load_config

        super().__init__()
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        if not getattr(engine_config, "verl_settings", None):
            raise TypeError("the megacritic engine needs its settings from MegacriticCriticConfig: select it with "
                            "critic._target_=megacritic.integrations.verl.MegacriticCriticConfig")
        # The critic section as mapped in the driver, the optimizer section as the trainer set it since (verl
        # writes optim.total_training_steps once it knows the run's length), then the user's own settings.
        settings = [*engine_config.verl_settings, *config_from_verl({"optim": optimizer_config}),
                    *engine_config.megacritic_settings]
        self.worker = CriticWorker(load_config(settings))
        if dist.is_initialized():
            # verl's TrainingWorker created this process' world group without the critic's nccl_timeout (verl
            # issue 7815): megacritic's collectives on it (the batch and gradient checks, checkpoint barriers)
            # wait at most megatron.nccl_timeout, as on the groups megacritic creates. A colocated role's
            # collectives on the world group get it too.
            from megacritic.parallel import set_world_timeout
            set_world_timeout(self.worker.config.megatron.nccl_timeout)
        # verl plans its dispatch (data-parallel rank, output ranks) as soon as the engine exists
        self.ranks = self.worker.setup_parallel()
        self.mode = None
        self._loss_finite, self._grads_finite = True, None  # the last pass's verdicts, for optimizer_step
        self._saved: list[str] = []  # checkpoint folders written (max_ckpt_to_keep)
        self._built = False

    # ------------------------------------------------------------------ lifecycle and modes

    def initialize(self):
        """Build the model, optimizer and LR schedule (weights from model.path); a second call (verl's
        ``reset``) builds them afresh."""
        if self._built:
            config = self.worker.config
            self.worker.close()
            from megacritic import CriticWorker
            self.worker = CriticWorker(config)
        self.worker.init_model()
        self.ranks = self.worker.ranks
        self._built = True

    @property
    def is_param_offload_enabled(self) -> bool:
        return self.worker.config.megatron.param_offload

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return self.worker.config.megatron.optimizer_offload

    def train_mode(self, **kwargs):
        """verl's context: onload what megatron.*_offload keeps on the host, offload it again on exit."""
        return BaseEngineCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return BaseEngineCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """``cpu``: move the named parts to pinned host memory; the device name: bring them back."""
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        parts = [part for part, on in (("params", model), ("optimizer", optimizer), ("grads", grad)) if on]
        if device == "cpu":
            self.worker.offload(parts)
        else:
            self.worker.onload(parts)

    # ------------------------------------------------------------------ the step, on verl's cue

    def optimizer_zero_grad(self):
        self.worker.zero_grad()

    def optimizer_step(self):
        """The grad norm before clipping; NaN when the step was skipped (a non-finite loss or gradient:
        weights kept)."""
        _, grad_norm = self.worker.optimizer_step(loss_finite=self._loss_finite, grads_finite=self._grads_finite)
        return grad_norm

    def lr_scheduler_step(self):
        return self.worker.lr_scheduler_step()

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """This rank's share of a mini-batch (or of a forward-only batch) through megacritic (module doc).
        Returns, on the ranks that hold outputs, ``model_output`` (``values``, nested per token, from a
        forward-only call), ``loss`` (one float per micro-batch) and ``metrics`` (the loss's metrics, per
        micro-batch)."""
        rollouts = self._agreed_rollouts(data, need_targets=loss_function is not None)
        self._loss_finite, self._grads_finite = True, None
        if forward_only and loss_function is None:
            # verl's values: CriticWorker.compute_values' own forward on this rank's rollouts
            values = self.worker.local_values(rollouts)
            if values is None:
                return {}
            return {"model_output": {"values": nested_token_values(values.cpu(), rollouts)}, "loss": [],
                    "metrics": {}}
        return self._run_loss(data, rollouts, loss_function, forward_only)

    def _run_loss(self, data, rollouts, loss_function, forward_only: bool) -> dict:
        """The pass with verl's loss (module doc); the host reads the losses, metrics and the step's verdict
        once, after the schedule."""
        layout, groups, device = self.worker.layout, self.worker.groups, self.ranks.device
        # verl's value_loss normalises over the global mini-batch by these (as verl's Megatron engine); summed
        # on the host (gloo): no device round trip
        tokens = torch.stack([rollouts.response_mask.sum(dtype=torch.float64), rollouts.seq_lens.sum().double()])
        if layout.dp > 1:
            dist.all_reduce(tokens, group=groups.dp_gloo)
        batch_tokens, mini_batch_tokens = (int(x) for x in tokens.tolist())
        tu.assign_non_tensor(data, batch_num_tokens=batch_tokens, dp_size=layout.dp)
        # megacritic sums gradients over data- and context-parallel ranks where verl's Megatron averages them
        scale = 1.0 / (layout.dp * layout.cp)
        if _ValueLoss.applies(loss_function, data):
            loss = _ValueLoss(loss_function.keywords["config"], data, rollouts, scale, forward_only, device)
        else:
            loss = _TrainerLoss(loss_function, data, rollouts, scale, forward_only, groups.dp, device)
        run = self.worker.forward_backward_batch(rollouts, loss, forward_only, mini_batch_tokens=mini_batch_tokens)

        n = len(run.outputs)  # micro-batches (none off the last pipeline stage)
        losses = (torch.stack([o["loss"].reshape(()) for o in run.outputs]).to(device, torch.float64) if n
                  else torch.zeros(0, dtype=torch.float64, device=device))
        stats = loss.device_stats(run.outputs)
        parts = [losses, stats]
        if not forward_only:
            # the same verdict on every rank: the losses live on the last pipeline stage
            bad = (~torch.isfinite(losses)).any().to(torch.float64).reshape(1)
            if dist.get_world_size() > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # (NCCL reduces device tensors only)
            # the gradients are reduced now: their check for optimizer_step travels in the same read
            parts += [bad, self.worker.nonfinite_grads().to(torch.float64).reshape(1)]
        host = torch.cat(parts).cpu()  # the call's one host read: the device's queue drains here
        if not forward_only:
            self._loss_finite, self._grads_finite = bool(host[-2] == 0), bool(host[-1] == 0)
        if not self.ranks.is_last_stage:
            return {}
        output = {"model_output": {}, "loss": host[:n].tolist(),
                  "metrics": loss.metrics(run.outputs, host[:n], host[n:n + len(stats)])}
        if forward_only:
            output["model_output"]["values"] = nested_token_values(run.values().float().cpu(), rollouts)
        return output

    def _agreed_rollouts(self, data, need_targets: bool):
        """This rank's batch checked; every rank learns whether all ranks' batches passed before any other
        collective runs, so that a malformed batch on one rank fails all of them (instead of leaving the others
        in a collective) and the message names the key."""
        model = self.worker.config.model
        error = None
        try:
            rollouts = check_batch(padded_batch(data), need_targets, model.vocab_size, model.max_position_embeddings)
        except BatchError as exc:
            error = str(exc)
        errors = [error]
        if dist.get_world_size() > 1:
            # one small reduction when every check passed; the messages travel only when one failed
            failed = torch.tensor([float(error is not None)], device=self.ranks.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if failed.item():
                errors = [None] * dist.get_world_size()
                dist.all_gather_object(errors, error)
        for rank, message in enumerate(errors):
            if message is not None:
                raise BatchError(message if message == error else f"rank {rank}'s share of the batch: {message}")
        return rollouts

    # ------------------------------------------------------------------ layout

    def get_data_parallel_rank(self):
        return self.ranks.dp_rank

    def get_data_parallel_size(self):
        return self.worker.layout.dp

    def get_data_parallel_group(self):
        return self.worker.groups.dp

    def is_mp_src_rank_with_outputs(self):
        return self.ranks.tp_rank == 0 and self.ranks.is_last_stage and self.ranks.cp_rank == 0

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """megacritic's atomic checkpoint ``<local_path>/step_<global_step>`` (model, optimizer, LR schedule,
        RNG); the newest ``max_ckpt_to_keep`` are kept."""
        return save_and_prune(self.worker, local_path, hdfs_path, global_step, max_ckpt_to_keep, self._saved,
                              dist.get_rank())

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        """The newest intact checkpoint under ``local_path``, saved under any layout (megacritic keeps its
        checkpoints: ``del_local_after_load`` is not applied)."""
        load_latest(self.worker, local_path, hdfs_path)

    def get_per_tensor_param(self, **kwargs):
        raise NotImplementedError("the megacritic engine trains a critic: its weights are not synced to a rollout "
                                  "engine")


class _ValueLoss:
    """verl's ``value_loss`` (``partial(value_loss, config=critic)``, what verl's trainer passes) computed as
    verl computes it, without its three host reads per micro-batch: its ``compute_value_loss`` and
    ``masked_mean`` on the same tensors (the values [rows, R] that ``no_padding_2_padding`` would give back,
    the targets that ``data.select(...).to_padded_tensor()`` gives), with the metrics kept on the device
    until the pass has run and read with the losses in one go (:meth:`metrics`: the same keys and
    aggregation as verl's)."""

    def __init__(self, config, data, rollouts, scale: float, forward_only: bool, device):
        self.config, self.scale, self.forward_only, self.device = config, scale, forward_only, device
        self.dp_size, self.batch_num_tokens = data["dp_size"], data["batch_num_tokens"]
        self.global_batch_size = data["global_batch_size"]
        # the targets copied to the device once per call (asynchronously, from pinned memory)
        self.targets = [to_device(x, device) for x in (rollouts.values, rollouts.returns, rollouts.response_mask)]

    @staticmethod
    def applies(loss_function, data) -> bool:
        """Is ``loss_function`` verl's value_loss, on a batch where the padded width does not matter? (With
        nested targets verl pads each micro-batch to its own longest response, which
        ``seq-mean-token-sum-norm`` without a loss_scale_factor divides by.)"""
        if not (isinstance(loss_function, partial) and loss_function.func is value_loss and not loss_function.args
                and set(loss_function.keywords) == {"config"}):
            return False
        config = loss_function.keywords["config"]
        return not (config.loss_agg_mode == "seq-mean-token-sum-norm" and config.loss_scale_factor is None
                    and _is_nested(data.get("response_mask", None)))

    def __call__(self, rows, vpreds):
        index = to_device(torch.tensor(rows, dtype=torch.long), self.device)
        values, returns, mask = (x[index] for x in self.targets)
        mask = mask.to(bool)
        config = self.config
        vf_loss, clipfrac = compute_value_loss(
            vpreds=vpreds, values=values, returns=returns, response_mask=mask,
            cliprange_value=config.cliprange_value, loss_agg_mode=config.loss_agg_mode, dp_size=self.dp_size,
            batch_num_tokens=self.batch_num_tokens, global_batch_size=self.global_batch_size,
            loss_scale_factor=config.loss_scale_factor)
        report = {"loss": vf_loss.detach(),
                  "stats": torch.stack([clipfrac, masked_mean(vpreds, mask)]).detach().to(torch.float64)}
        if self.forward_only:
            report["values"] = vpreds.detach()
        return vf_loss * self.scale, report

    def device_stats(self, outputs) -> torch.Tensor:
        """The metrics the host reads after the pass, float64 on the device."""
        return torch.cat([o["stats"] for o in outputs]) if outputs else torch.zeros(0, dtype=torch.float64,
                                                                                      device=self.device)

    def metrics(self, outputs, losses: torch.Tensor, stats: torch.Tensor) -> dict:
        """verl's value_loss metrics per micro-batch, from the host copies of the losses and device_stats."""
        summed = (self.dp_size > 1 or self.batch_num_tokens is not None or self.global_batch_size is not None
                  or self.config.loss_scale_factor is not None)
        aggregation = AggregationType.SUM if summed else AggregationType.MEAN
        metrics: dict = {}
        for vf_loss, (clipfrac, vpred_mean) in zip(losses.tolist(), stats.view(-1, 2).tolist()):
            append_to_dict(metrics, {"critic/vf_loss": Metric(value=vf_loss, aggregation=aggregation),
                                     "critic/vf_clipfrac": clipfrac, "critic/vpred_mean": vpred_mean})
        return metrics


class _TrainerLoss:
    """Any other loss of verl's: called per micro-batch on its rows of verl's TensorDict (on the values'
    device) and the values laid out per token as verl reads them."""

    def __init__(self, loss_function, data, rollouts, scale: float, forward_only: bool, dp_group, device):
        self.loss_function, self.data, self.rollouts = loss_function, data, rollouts
        self.scale, self.forward_only, self.dp_group, self.device = scale, forward_only, dp_group, device

    def __call__(self, rows, vpreds):
        sub = tu.index_select_tensor_dict(self.data, torch.tensor(rows, dtype=torch.long)).to(vpreds.device)
        flat = _token_values(vpreds, self.rollouts, rows)
        value, metrics = self.loss_function(model_output={"values": flat}, data=sub, dp_group=self.dp_group)
        report = {"loss": value.detach(), "metrics": metrics}
        if self.forward_only:
            report["values"] = vpreds.detach()
        return value * self.scale, report

    def device_stats(self, outputs) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64, device=self.device)

    def metrics(self, outputs, losses: torch.Tensor, stats: torch.Tensor) -> dict:
        metrics: dict = {}
        for o in outputs:
            append_to_dict(metrics, o["metrics"])
        return metrics


def _token_values(vpreds, rollouts, rows):
    """Values [rows, R] of response tokens laid out per real token of the rows' rollouts, as verl's
    ``no_padding_2_padding`` reads them (token ``P_b - 1 + i`` holds response token i; the rest 0); a flat
    [total tokens] tensor, differentiable in ``vpreds``."""
    sel = torch.tensor(rows, dtype=torch.long)
    p, r, lens = rollouts.prompt_lens[sel], rollouts.response_lens[sel], rollouts.seq_lens[sel]
    starts = torch.cat([lens.new_zeros(1), lens.cumsum(0)[:-1]])
    cols = torch.arange(vpreds.shape[1])
    inside = cols[None, :] < r[:, None]
    index = (starts[:, None] + p[:, None] - 1 + cols[None, :])[inside].to(vpreds.device)
    flat = vpreds.new_zeros(int(lens.sum()))
    return flat.index_put((index,), vpreds[inside.to(vpreds.device)])
