"""MegatronPPOCritic's step logic in a world of one: rows and mini-batches without response tokens, and
the timing_s/* metrics from Megatron's timers."""

import logging
import math

import pytest
import torch

from megacritic import CriticWorker, load_config
from megacritic.config import TINY_MODEL_OVERRIDES
from megacritic.data.sources import SyntheticRollouts

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
        before = [p.detach().clone() for chunk in worker.critic.model for p in chunk.parameters()]
        state = [v.clone() for s in worker.critic.optimizer.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v)]
        metrics = [worker.update_critic(batch) for _ in range(calls)]
        after = [p.detach().clone() for chunk in worker.critic.model for p in chunk.parameters()]
        state_after = [v.clone() for s in worker.critic.optimizer.optimizer.state.values() for v in s.values()
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


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
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
            # the schedule contains the gradient reduction; the step contains the schedule and the optimizer
            assert 0 < m["timing_s/grad_reduce"][i] <= m["timing_s/forward_backward"][i]
            assert m["timing_s/forward_backward"][i] + m["timing_s/optimizer"][i] <= m["timing_s/step"][i]
        if level >= 2:
            assert m["timing_s/forward"][i] + m["timing_s/backward"][i] <= m["timing_s/forward_backward"][i]
