"""MegatronPPOCritic: the PPO loop against a fake forward-backward runner with no Megatron world (mini-batches, epochs,
shuffle, loss weights, skipped and empty steps, metrics, LR schedule unit, operation names); then its step
logic in a real world of one (rows and mini-batches without response tokens, the timing_s/* metrics from
Megatron's timers, no model-sized temporary in an update)."""

import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megacritic import CriticWorker, load_config
from megacritic.config import TINY_MODEL_OVERRIDES
from megacritic.critic import MegatronPPOCritic
from megacritic.data.rollouts import mini_batch_indices, rollouts_from_batch
from megacritic.data.sources import SyntheticRollouts
from megacritic.losses import token_weights, value_loss_and_stats
from megacritic.model.weights import ExpertRanks
from megacritic.packing.micro_batches import MicroBatchPolicy
from megacritic.forward_backward import Pass, StepTimers
from megacritic.compat.kernels import use_fused_adamw
from megacritic import optim
from megacritic.parallel import ParallelLayout, ProcessGroups, Ranks
from megacritic.train_state import TrainState

# ---------------------------------------------------------------- the PPO loop with a fake forward-backward runner

FAKE = [*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4", "ppo_micro_batch_size_per_gpu=2", "ppo_epochs=2",
        "shuffle=true", "data.response_length=[2,10]"]


class FakeBuffer:
    def __init__(self):
        self.grad_data = torch.zeros(3)


class FakeChunk:
    """What the critic touches of a Megatron DDP chunk."""

    def __init__(self):
        self.training, self.buffers, self.expert_parallel_buffers = True, [FakeBuffer()], []
        self.zeroed = 0

    def train(self, mode=True):
        self.training = mode

    def eval(self):
        self.training = False

    def zero_grad_buffer(self):
        self.zeroed += 1
        for b in self.buffers:
            b.grad_data.zero_()


class FakeOptimizer:
    def __init__(self, lr=1e-3):
        self.param_groups, self.steps, self.zeroed = [{"lr": lr}], 0, 0

    def step(self):
        self.steps += 1
        return True, 0.5, None

    def zero_grad(self):
        self.zeroed += 1


class FakeScheduler:
    def __init__(self, optimizer):
        self.optimizer, self.increments = optimizer, 0

    def step(self, increment):
        self.increments += increment
        self.optimizer.param_groups[0]["lr"] /= 2  # so each step's reported lr shows when the schedule moved


class FakeForwardBackward:
    """Stands in for megacritic.forward_backward.ForwardBackward: records what the critic hands it; the value of a token is
    its row's id (carried in the batch's old values) plus 0.25; a training pass reports the real loss sums."""

    def __init__(self, policy, chunk, nan_loss=False, inf_grad=False, fail=False):
        self.policy, self.timers, self.calls, self.chunk = policy, StepTimers(None, 0), [], chunk
        self.prepared = []  # what the critic prepared (ForwardBackward.prepare) ahead of its runs
        self.ran_prepared = []
        self.nan_loss, self.inf_grad, self.fail = nan_loss, inf_grad, fail

    def prepare(self, local, weights=None, forward_only=None, build_first=False):
        self.prepared.append(local)
        return ("prepared", local)

    def run(self, local, weights=None, mini_batch_tokens=0, prepared=None):
        assert prepared is None or prepared[1] is local  # the step runs what was prepared for it
        self.ran_prepared.append(prepared is not None)
        if self.fail:
            raise RuntimeError("a peer died")
        parts = [list(range(len(local)))[::-1]]  # in an order of its own: the critic must restore input order
        rows = torch.tensor(parts[0])
        if weights is None:
            self.calls.append(("forward", local))
            return Pass(parts, [{"values": (local.response_mask[rows] * (local.prompt_lens[rows, None] + 0.25))}], 0.0)
        self.calls.append(("train", local, weights, mini_batch_tokens))
        vpreds = local.values + 0.25
        if self.nan_loss:
            vpreds = vpreds * float("nan")
        _, stats = value_loss_and_stats(vpreds, local.values, local.returns, weights, local.response_mask, 0.5)
        if self.inf_grad:
            self.chunk.buffers[0].grad_data[0] = float("inf")
        return Pass(parts, [stats], 0.01)


def _critic(overrides=(), **runner):
    config = load_config(FAKE + list(overrides))
    layout = ParallelLayout.from_config(config.megatron, 1)
    ranks = Ranks(rank=0, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0, is_last_stage=True, experts=ExpertRanks(),
                  device=torch.device("cpu"))
    chunk, optimizer = FakeChunk(), FakeOptimizer()
    runner = FakeForwardBackward(MicroBatchPolicy.from_config(config, layout), chunk, **runner)
    state = TrainState([chunk], optimizer, FakeScheduler(optimizer))
    critic = MegatronPPOCritic(config, layout, ranks, ProcessGroups(), state, runner)
    return critic, config


def _batch(config):
    batch = SyntheticRollouts(config).batch(0)
    r = batch["responses"].shape[1]
    ids = torch.arange(len(batch), dtype=torch.float32)[:, None].expand(-1, r)
    batch["values"] = ids * batch["attention_mask"][:, -r:]  # row i's old values: i on its response tokens
    batch["returns"] = batch["values"].clone()
    return batch


def _row_ids(rollouts):
    return rollouts.values[:, 0].long().tolist()  # every response has at least 2 tokens


def test_the_loop_runs_without_a_distributed_world():
    assert not dist.is_initialized()
    critic, config = _critic()
    metrics = critic.update_critic(_batch(config))
    assert not dist.is_initialized()
    assert len(metrics["critic/vf_loss"]) == 4  # 2 epochs x 2 mini-batches


def test_each_step_runs_what_was_prepared_for_it_while_the_previous_one_ran():
    critic, config = _critic()
    order = []
    fake = critic.forward_backward
    prepare, run = fake.prepare, fake.run
    fake.prepare = lambda *a, **k: (order.append("prepare"), prepare(*a, **k))[1]
    fake.run = lambda *a, **k: (order.append("run"), run(*a, **k))[1]
    optimizer = critic.state.optimizer
    step = optimizer.step
    optimizer.step = lambda: (order.append("step"), step())[1]
    finish = critic._finish_step
    critic._finish_step = lambda *a, **k: (order.append("read"), finish(*a, **k))[1]
    critic.update_critic(_batch(config))
    assert fake.ran_prepared == [True] * 4
    # step k + 1 is prepared after step k's forward-backward was queued, before step k's optimizer step;
    # step k's results are read after step k + 1's forward-backward was queued, before its optimizer step
    assert order == ["prepare", "run", "prepare", "step", "run", "prepare", "read", "step", "run", "prepare",
                     "read", "step", "run", "read", "step", "read"]


def test_mini_batches_epochs_and_shuffle():
    critic, config = _critic()
    batch = _batch(config)
    for call in range(2):
        critic.forward_backward.calls.clear()
        critic.update_critic(batch)
        expected = mini_batch_indices(8, 4, 2, True, config.data_loader_seed, call_index=call)
        got = [_row_ids(local) for _, local, _, _ in critic.forward_backward.calls]
        assert got == [rows.tolist() for rows in expected]
    first = mini_batch_indices(8, 4, 2, True, config.data_loader_seed, call_index=0)
    assert [r.tolist() for r in first] != [r.tolist() for r in expected]  # a new shuffle per call
    assert all(sorted(sum((r.tolist() for r in expected[e * 2:e * 2 + 2]), [])) == list(range(8)) for e in (0, 1))


@pytest.mark.parametrize("overrides", [[], ["loss_agg_mode=token-sum"], ["loss_agg_mode=seq-mean-token-mean"],
                                       ["loss_agg_mode=seq-mean-token-sum-norm"],
                                       ["loss_agg_mode=seq-mean-token-sum-norm", "loss_scale_factor=3.5"]])
def test_weights_are_those_of_the_whole_mini_batch(overrides):
    critic, config = _critic(["shuffle=false", *overrides])
    batch = _batch(config)
    critic.update_critic(batch)
    rollouts = rollouts_from_batch(batch, need_targets=True)
    for (_, local, weights, tokens), rows in zip(critic.forward_backward.calls, mini_batch_indices(8, 4, 2, False, 1)):
        mini = rollouts.select(rows)
        expected = token_weights(mini.response_mask, config.loss_agg_mode, horizon=config.loss_scale_factor)
        assert torch.equal(weights, expected)
        assert tokens == int(mini.seq_lens.sum())
    if config.loss_scale_factor:  # the horizon is loss_scale_factor, not the response width
        assert float(weights.sum()) == pytest.approx(float(mini.response_mask.sum()) / (3.5 * 4))


def test_metrics_of_every_step():
    critic, config = _critic()
    metrics = critic.update_critic(_batch(config))
    assert set(metrics) == {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var",
                            "critic/response_tokens", "critic/grad_norm", "critic/lr", "critic/skipped_steps",
                            "critic/empty_steps", "perf/real_tokens", "perf/tokens_per_s", "timing_s/step",
                            "timing_s/data"}
    assert all(len(v) == 4 for v in metrics.values())
    assert metrics["critic/grad_norm"] == [0.5] * 4 and metrics["critic/skipped_steps"] == [0.0] * 4
    assert all(t > 0.01 for t in metrics["timing_s/data"])  # the schedule's data time and a share of the check
    # predictions are the old values (= the returns) + 0.25, inside the clip range: 0.5 x 0.25^2 per token
    assert metrics["critic/vf_loss"] == pytest.approx([0.5 * 0.25 ** 2] * 4)
    assert critic.state.optimizer.steps == 4


def test_empty_mini_batch_is_skipped_with_the_same_metric_keys(caplog):
    critic, config = _critic(["shuffle=false", "ppo_epochs=1"])
    batch = _batch(config)
    r = batch["responses"].shape[1]
    batch["response_mask"] = batch["attention_mask"][:, -r:].float()
    batch["response_mask"][:4] = 0  # the first mini-batch has no response token
    with caplog.at_level(logging.WARNING, logger="megacritic.critic"):
        metrics = critic.update_critic(batch)
    assert "no response tokens" in caplog.text
    assert metrics["critic/empty_steps"] == [1.0, 0.0]
    assert [c[0] for c in critic.forward_backward.calls] == ["train"]  # the empty one never reached the schedule
    assert critic.state.optimizer.steps == 1 and critic.state.lr_scheduler.increments == 1
    assert metrics["critic/vf_explained_var"][0] == 0.0 and metrics["perf/tokens_per_s"][0] == 0.0
    assert all(math.isfinite(v[0]) for v in metrics.values())


@pytest.mark.parametrize("fault", ["nan_loss", "inf_grad"])
def test_non_finite_step_is_skipped(fault):
    critic, config = _critic(["ppo_epochs=1"], **{fault: True})
    zeroed = critic.state.model[0].zeroed
    metrics = critic.update_critic(_batch(config))
    assert metrics["critic/skipped_steps"] == [1.0, 1.0]
    assert all(math.isnan(g) for g in metrics["critic/grad_norm"])
    assert critic.state.optimizer.steps == 0 and critic.state.lr_scheduler.increments == 0
    assert critic.state.model[0].zeroed - zeroed == 4  # before each step, and again to drop the bad gradients
    assert critic.state.model[0].buffers[0].grad_data.isfinite().all()


@pytest.mark.parametrize("unit, increments", [("step", 4), ("call", 1)])
def test_lr_schedule_unit(unit, increments):
    critic, config = _critic([f"optim.schedule_unit={unit}"])
    metrics = critic.update_critic(_batch(config))
    assert critic.state.lr_scheduler.increments == increments
    if unit == "step":
        assert metrics["critic/lr"] == [1e-3, 5e-4, 2.5e-4, 1.25e-4]
    else:  # every step of a call runs at the call's LR; the schedule advances at its end
        assert metrics["critic/lr"] == [1e-3] * 4 and critic.state.optimizer.param_groups[0]["lr"] == 5e-4


def test_values_come_back_in_input_order_and_modes_are_restored():
    critic, config = _critic()
    batch = _batch(config)
    values = critic.compute_values(batch)
    rollouts = rollouts_from_batch(batch, need_targets=False)
    assert torch.equal(values, rollouts.response_mask * (rollouts.prompt_lens[:, None] + 0.25))
    assert critic.state.model[0].training


def test_operation_names_what_failed():
    critic, config = _critic(fail=True)
    assert critic.operation == "idle"
    with pytest.raises(RuntimeError, match="peer"):
        critic.update_critic(_batch(config))
    assert critic.operation.startswith("update_critic: forward/backward")
    critic.forward_backward.fail = False
    critic.update_critic(_batch(config))
    assert critic.operation == "idle"


# ---------------------------------------------------------------- in a real world of one

BASE = [*TINY_MODEL_OVERRIDES,
        "data.rollouts_per_step=8", "model.num_hidden_layers=2", "data.response_length=[2,10]", "shuffle=false",
        "use_dynamic_bsz=true", "ppo_max_token_len_per_gpu=64"]


def _run(overrides, edit=None, calls=2):
    """A fresh critic (same seeded weights every time): per call, the batch's values then update_critic."""
    worker = CriticWorker(load_config(BASE + overrides))
    worker.init_model()
    try:
        batch = SyntheticRollouts(load_config(BASE + ["ppo_mini_batch_size=8"])).batch(0)  # same 8 rollouts always
        batch["values"] = worker.compute_values(batch)
        if edit is not None:
            batch = edit(batch)
        before = [p.detach().clone() for chunk in worker.state.model for p in chunk.parameters()]
        state = [v.clone() for s in worker.state.optimizer.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v)]
        metrics = [worker.update_critic(batch) for _ in range(calls)]
        after = [p.detach().clone() for chunk in worker.state.model for p in chunk.parameters()]
        state_after = [v.clone() for s in worker.state.optimizer.optimizer.state.values() for v in s.values()
                       if torch.is_tensor(v)]
        return metrics, (before, after), (state, state_after)
    finally:
        worker.close()


def _with_masked_rows(batch, n=4):
    """``n`` extra rows (copies of the first ones) whose response mask is all zero and whose values and
    returns are huge: they must contribute nothing."""
    extra = batch[:n].clone()
    r = extra["responses"].shape[1]
    extra["response_mask"] = torch.zeros(n, r)
    extra["returns"] = torch.full((n, r), 1e6)
    extra["values"] = torch.full((n, r), -1e6)
    batch = batch.clone()
    batch["response_mask"] = batch["attention_mask"][:, -r:].float()
    return torch.cat([batch, extra])


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_masked_rows_contribute_nothing(mode):
    plain, _, _ = _run([f"loss_agg_mode={mode}", "ppo_mini_batch_size=8"])
    masked, _, _ = _run([f"loss_agg_mode={mode}", "ppo_mini_batch_size=12", "data.rollouts_per_step=12"],
                        edit=_with_masked_rows)
    keys = ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean",
            "critic/vf_explained_var", "critic/response_tokens")
    for call, (a, b) in enumerate(zip(plain, masked)):
        # one mini-batch per call: the first step sees identical weights (only summation order differs);
        # the second follows one Adam step, the parity suite's multi-step bound
        tol = 1e-5 if call == 0 else 1e-3
        for key in keys:
            assert math.isfinite(b[key][0]) and b[key][0] == pytest.approx(a[key][0], rel=tol, abs=1e-9), key


def test_mini_batch_without_response_tokens_skips_its_step_and_says_so(caplog):
    def all_masked(batch):
        batch["response_mask"] = torch.zeros_like(batch["responses"], dtype=torch.float32)
        return batch

    with caplog.at_level(logging.WARNING, logger="megacritic.critic"):
        metrics, (before, after), (state, state_after) = _run(["ppo_mini_batch_size=4"], edit=all_masked, calls=1)
    assert metrics[0]["critic/empty_steps"] == [1.0, 1.0]
    assert metrics[0]["critic/skipped_steps"] == [0.0, 0.0]
    assert all(math.isfinite(v) for values in metrics[0].values() for v in values)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.equal(a, b) for a, b in zip(state, state_after))
    assert caplog.text.count("no response tokens") == 2


def test_one_empty_mini_batch_among_others():
    def first_masked(batch):
        batch["response_mask"] = batch["attention_mask"][:, -batch["responses"].shape[1]:].float()
        batch["response_mask"][:4] = 0
        return batch

    metrics, (before, after), _ = _run(["ppo_mini_batch_size=4"], edit=first_masked, calls=1)
    assert metrics[0]["critic/empty_steps"] == [1.0, 0.0]
    assert metrics[0]["critic/response_tokens"][1] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("level", [0, 1, 2])
def test_timing_metrics(level):
    metrics, _, _ = _run([f"megatron.timing_level={level}", "ppo_mini_batch_size=4"], calls=1)
    m = metrics[0]
    expected = {"timing_s/step", "timing_s/data"}
    if level >= 1:
        expected |= {"timing_s/forward_backward", "timing_s/grad_reduce", "timing_s/optimizer"}
    if level >= 2:
        expected |= {"timing_s/forward", "timing_s/backward", "timing_s/pipeline_wait"}
    assert {k for k in m if k.startswith("timing_s/")} == expected
    for i in range(2):
        assert all(m[k][i] >= 0 for k in expected)
        assert m["timing_s/data"][i] > 0
        if level >= 1:
            # the schedule contains the gradient reduction
            assert 0 < m["timing_s/grad_reduce"][i] <= m["timing_s/forward_backward"][i]
            assert m["timing_s/optimizer"][i] > 0
        if level >= 2:
            assert m["timing_s/forward"][i] + m["timing_s/backward"][i] <= m["timing_s/forward_backward"][i]
    if level >= 1:
        # the steps' times add up to the call's (one step's host work overlaps the next one's): together
        # they contain every schedule and optimizer step
        assert sum(m["timing_s/forward_backward"]) + sum(m["timing_s/optimizer"]) <= sum(m["timing_s/step"])


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage any op creates (views and in-place results share an input's storage and
    are not counted). Ops are seen after decomposition, so a composite op's hidden temporaries show."""

    def __init__(self):
        super().__init__()
        self.nbytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in tree_leaves(out):
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs:
                if t.untyped_storage().nbytes() > self.nbytes:
                    self.nbytes, self.op = t.untyped_storage().nbytes(), f"{func} -> {t.dtype}{list(t.shape)}"
        return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_makes_no_temporary_the_size_of_the_model(dtype):
    # A 7B update once ran out of memory on a float32 copy of the whole gradient buffer, then on a 1-byte
    # mask over it (torch.isfinite(buffer) in the gradient check). Bound: that mask, 1 byte per buffer
    # entry. Legitimate temporaries (a gradient, Adam's moments and foreach outputs, activations) are at
    # most one parameter in float32; 8 layers keep the largest parameter (fc1, 64 x 256) at 1/18 of the
    # buffer, so those stay over 4x under the bound (checked first). bfloat16 is the 7B case: bf16
    # weights, float32 gradient buffer.
    # a tiny clip threshold so every step also scales its gradients
    config = load_config(BASE + ["model.num_hidden_layers=8", f"model.dtype={dtype}", "ppo_mini_batch_size=4",
                                 "optim.clip_grad=1e-6"])
    worker = CriticWorker(config)
    worker.init_model()
    try:
        model = worker.state.model
        bound = max(b.grad_data.numel() for chunk in model for b in chunk.buffers + chunk.expert_parallel_buffers)
        assert 4 * max(p.numel() for chunk in model for p in chunk.parameters()) < bound / 4
        batch = SyntheticRollouts(config).batch(0)
        batch["values"] = worker.compute_values(batch)
        with LargestAllocation() as largest:
            metrics = worker.update_critic(batch)  # forward, backward, gradient check, norm, clipping, Adam
        assert metrics["critic/skipped_steps"] == [0.0, 0.0]  # the steps (and their checks) ran
        assert largest.nbytes < bound, f"{largest.nbytes} bytes by {largest.op}; bound {bound}"
    finally:
        worker.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_decided_on_the_device_equal_steps_decided_on_the_host(dtype, monkeypatch):
    # torch's fused AdamW (on the CPU here, as on a GPU) takes the step on the device: grad norm, clipping and
    # the skip of a non-finite step (the 2nd of 4, an inf planted in a gradient) without a host read.
    # The same steps with the decision taken on the host must give the same weights, Adam state and metrics,
    # to the bit: the arithmetic is the same.
    config = load_config(BASE + [f"model.dtype={dtype}", "ppo_mini_batch_size=4", "optim.clip_grad=0.05"])
    batch = SyntheticRollouts(config).batch(0)

    def run(on_device: bool):
        monkeypatch.setattr("megacritic.critic.steps_on_device",
                            optim.steps_on_device if on_device else (lambda optimizer: False))
        worker = CriticWorker(config)
        worker.init_model()
        try:
            assert not optim.steps_on_device(worker.state.optimizer)  # torch's foreach AdamW, the CPU default
            use_fused_adamw(worker.state.optimizer)
            assert optim.steps_on_device(worker.state.optimizer)
            batch["values"] = worker.compute_values(batch)
            critic, runs = worker._require_model(), []
            plain = critic.forward_backward.run

            def run_and_plant(*args, **kwargs):
                out = plain(*args, **kwargs)
                runs.append(None)
                if len(runs) == 2:  # a parameter's gradient (the buffer also holds alignment padding)
                    next(critic.state.model[0].parameters()).main_grad.view(-1)[0] = float("inf")
                return out

            critic.forward_backward.run = run_and_plant
            metrics = [worker.update_critic(batch) for _ in range(2)]
            params = [p.detach().clone() for chunk in worker.state.model for p in chunk.parameters()]
            state = [v.clone() for s in worker.state.optimizer.optimizer.state.values() for v in s.values()]
            return metrics, params, state, worker.state.lr_scheduler.num_steps
        finally:
            worker.close()

    device, host = run(True), run(False)
    assert device[0][0]["critic/skipped_steps"] == [0.0, 1.0] and device[0][1]["critic/skipped_steps"] == [0.0, 0.0]
    assert math.isnan(device[0][0]["critic/grad_norm"][1])
    assert all(g > 0.05 for call in device[0] for g in call["critic/grad_norm"] if not math.isnan(g))  # clipped
    for call_d, call_h in zip(device[0], host[0]):
        for key in call_d:
            if not key.startswith(("timing_s/", "perf/tokens_per_s")):
                assert call_d[key] == pytest.approx(call_h[key], rel=0, abs=0, nan_ok=True), key
    assert all(torch.equal(a, b) for a, b in zip(device[1], host[1]))
    assert all(torch.equal(a, b) for a, b in zip(device[2], host[2]))
    assert device[3] == host[3]


@pytest.mark.parametrize("planted", [float("nan"), 1e30])
def test_a_step_on_the_device_is_skipped_when_the_grad_norm_is_not_finite(planted):
    # The device step finds a bad gradient through the grad norm's own pass: a NaN, or a finite entry whose
    # square overflows float32 (where Megatron's clipping would scale every gradient by 0 and still step).
    config = load_config(BASE + ["ppo_mini_batch_size=4"])
    batch = SyntheticRollouts(config).batch(0)
    worker = CriticWorker(config)
    worker.init_model()
    try:
        use_fused_adamw(worker.state.optimizer)
        assert optim.steps_on_device(worker.state.optimizer)
        batch["values"] = worker.compute_values(batch)
        critic = worker._require_model()
        plain, params = critic.forward_backward.run, []

        def run_and_plant(*args, **kwargs):
            out = plain(*args, **kwargs)
            params.append([p.detach().clone() for p in critic.state.model[0].parameters()])
            if len(params) == 2:
                next(critic.state.model[0].parameters()).main_grad.view(-1)[0] = planted
            return out

        critic.forward_backward.run = run_and_plant
        metrics = worker.update_critic(batch)
        after = [p.detach().clone() for p in critic.state.model[0].parameters()]
    finally:
        worker.close()
    assert metrics["critic/skipped_steps"] == [0.0, 1.0]
    assert math.isnan(metrics["critic/grad_norm"][1]) and math.isfinite(metrics["critic/grad_norm"][0])
    assert all(torch.equal(a, b) for a, b in zip(params[1], after))  # the second step kept the weights
    assert not all(torch.equal(a, b) for a, b in zip(params[0], params[1]))  # the first one moved them
