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
read as megacritic's checked :class:`~megacritic.data.rollouts.Rollouts`; every rank's check is agreed
before any collective, so a malformed batch fails on every rank with the same message, naming the key,
and nothing changes -> the mini-batch's loss tokens over data-parallel ranks (verl's ``batch_num_tokens``,
``dp_size``) -> megacritic's micro-batches through Megatron's schedule, where each micro-batch calls verl's
loss on its rows of verl's TensorDict and values laid out per token as verl reads them; megacritic sums
gradients over data- and context-parallel ranks where verl's Megatron averages them, so the loss is
divided by DP x CP -> values back in verl's order, per token (``P_b - 1 + i`` holds response token i).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry

from megacritic.data.rollouts import BatchError, check_batch, nested_token_values
from megacritic.integrations.verl.checkpoints import load_latest, save_and_prune
from megacritic.integrations.verl.config import config_from_verl
from megacritic.integrations.verl.config_classes import BACKEND


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
        _, grad_norm = self.worker.optimizer_step(loss_finite=self._loss_finite)
        return grad_norm

    def lr_scheduler_step(self):
        return self.worker.lr_scheduler_step()

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """This rank's share of a mini-batch (or of a forward-only batch) through megacritic (module doc).
        Returns, on the ranks that hold outputs, ``model_output`` (``values``, nested per token),
        ``loss`` (one float per micro-batch) and ``metrics`` (verl's loss metrics, per micro-batch)."""
        rollouts = self._agreed_rollouts(data, need_targets=loss_function is not None)
        layout = self.worker.layout
        tokens = torch.tensor([float(rollouts.response_mask.sum()), float(rollouts.seq_lens.sum())],
                              dtype=torch.float64, device=self.ranks.device)
        if layout.dp > 1:
            dist.all_reduce(tokens, group=self.worker.groups.dp)
        self._loss_finite = True
        if loss_function is not None:
            # verl's value_loss normalises over the global mini-batch from these (as verl's Megatron engine)
            tu.assign_non_tensor(data, batch_num_tokens=int(tokens[0]), dp_size=layout.dp)
        rows_of = _RowSelector(data)
        scale = 1.0 / (layout.dp * layout.cp)
        dp_group = self.worker.groups.dp

        def loss(rows, vpreds):
            report = {"values": vpreds.detach()}
            if loss_function is None:
                return vpreds.sum() * 0, report
            sub = rows_of(rows).to(vpreds.device)  # verl's loss reads the targets beside the values
            flat = _token_values(vpreds, rollouts, rows)
            value, metrics = loss_function(model_output={"values": flat}, data=sub, dp_group=dp_group)
            report.update(loss=value.detach().item(), metrics=metrics)
            return value * scale, report

        run = self.worker.forward_backward_batch(rollouts, loss, forward_only, mini_batch_tokens=int(tokens[1]))
        if not forward_only:
            # the same verdict on every rank: the losses live on the last pipeline stage
            bad = torch.tensor([0.0 if all(torch.isfinite(torch.tensor(o.get("loss", 0.0)))
                                           for o in run.outputs) else 1.0], device=self.ranks.device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # (NCCL reduces device tensors only)
            self._loss_finite = bad.item() == 0
        if not self.ranks.is_last_stage:
            return {}
        from megacritic.packing.partition import reverse_index
        values = torch.cat([o["values"] for o in run.outputs])[reverse_index(run.parts).to(run.outputs[0]["values"].device)]
        output = {"model_output": {"values": nested_token_values(values.float().cpu(), rollouts)},
                  "loss": [o["loss"] for o in run.outputs if "loss" in o], "metrics": {}}
        for o in run.outputs:
            if "metrics" in o:
                append_to_dict(output["metrics"], o["metrics"])
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


class _RowSelector:
    """Rows of verl's TensorDict (nested fields included) for one micro-batch; non-tensor entries kept."""

    def __init__(self, data):
        self.data = data

    def __call__(self, rows):
        return tu.index_select_tensor_dict(self.data, torch.tensor(rows, dtype=torch.long))


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
