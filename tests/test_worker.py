"""CriticWorker in a plain Python process (a world of one): the public calls and their contracts."""

import math
import os

import pytest
import torch
from tensordict import TensorDict

from megacritic import BatchError, CriticWorker, load_config
from megacritic.config import TINY_MODEL_OVERRIDES, ConfigError
from megacritic.data.sources import SyntheticRollouts

OVERRIDES = [*TINY_MODEL_OVERRIDES,
             "data.rollouts_per_step=8", "ppo_mini_batch_size=4", "ppo_micro_batch_size_per_gpu=2",
             "ppo_epochs=2", "model.num_hidden_layers=2", "data.response_length=[2,10]"]


@pytest.fixture(scope="module")
def worker():
    w = CriticWorker(load_config(OVERRIDES))
    w.init_model()
    yield w
    w.close()


@pytest.fixture
def batch(worker):
    return SyntheticRollouts(worker.config).batch(0)


def _params(worker):
    return [p.detach().clone() for chunk in worker.state.model for p in chunk.parameters()]


def _optimizer_state(worker):
    return [v.clone() for s in worker.state.optimizer.optimizer.state.values() for v in s.values()
            if torch.is_tensor(v)]


def test_compute_values_contract(worker, batch):
    for chunk in worker.state.model:
        chunk.train()
    values = worker.compute_values(batch)
    r = batch["responses"].shape[1]
    assert values.shape == (len(batch), r) and values.dtype == torch.float32
    response_mask = batch["attention_mask"][:, -r:]
    assert torch.all(values[response_mask == 0] == 0)
    assert torch.all(values[response_mask == 1] != 0)
    assert all(chunk.training for chunk in worker.state.model)  # previous mode restored
    assert torch.equal(values, worker.compute_values(batch))  # deterministic


class DataProtoLike:
    def __init__(self, batch):
        self.batch, self.meta_info = batch, {}


def test_update_critic_metrics(worker, batch):
    batch["values"] = worker.compute_values(batch)
    before = _params(worker)
    metrics = worker.update_critic(DataProtoLike(batch))
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
                "critic/vf_explained_var"):
        assert len(metrics[key]) == 4  # 2 epochs x 2 mini-batches, one optimizer step each
    assert metrics["critic/skipped_steps"] == [0.0] * 4
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(worker)))


def test_refused_batch_changes_nothing(worker, batch):
    batch["values"] = worker.compute_values(batch)
    params, state, calls = _params(worker), _optimizer_state(worker), worker.state.update_calls
    bad = batch.clone()
    bad["returns"][0, 0] = float("nan")
    with pytest.raises(BatchError, match="returns"):
        worker.update_critic(bad)
    missing = TensorDict({k: v for k, v in batch.items() if k != "values"}, batch_size=batch.batch_size)
    with pytest.raises(BatchError, match="values"):
        worker.update_critic([batch, missing])  # the good first batch must not be applied either
    assert all(torch.equal(a, b) for a, b in zip(params, _params(worker)))
    assert all(torch.equal(a, b) for a, b in zip(state, _optimizer_state(worker)))
    assert worker.state.update_calls == calls


def test_non_finite_gradient_skips_the_step(worker, batch, monkeypatch):
    import megacritic.critic as critic_module
    batch["values"] = worker.compute_values(batch)
    params, state = _params(worker), _optimizer_state(worker)
    weights = critic_module.token_weights
    # Loss weights that are not finite (from outside: the critic's own weight function, patched) poison the
    # loss and the gradients of every step.
    monkeypatch.setattr(critic_module, "token_weights",
                        lambda *args, **kwargs: torch.full_like(weights(*args, **kwargs), float("nan")))
    metrics = worker.update_critic(batch)
    assert metrics["critic/skipped_steps"] == [1.0] * 4
    assert all(torch.equal(a, b) for a, b in zip(params, _params(worker)))
    assert all(torch.equal(a, b) for a, b in zip(state, _optimizer_state(worker)))
    # and the next healthy steps work
    monkeypatch.setattr(critic_module, "token_weights", weights)
    ok = worker.update_critic(batch)
    assert ok["critic/skipped_steps"] == [0.0] * 4 and all(g > 0 for g in ok["critic/grad_norm"])


def test_calls_before_init_model_are_errors():
    w = CriticWorker(load_config(OVERRIDES))
    with pytest.raises(RuntimeError, match="init_model"):
        w.compute_values(None)


def test_offload_by_hand_names_its_parts(worker, batch):
    with pytest.raises(ValueError, match="offload parts \\['weights'\\]"):
        worker.offload(["weights"])
    worker.offload(["params", "grads", "optimizer"])  # on CPU nothing moves, and the critic still works
    worker.onload(["params", "grads", "optimizer"])
    assert worker.compute_values(batch).shape == batch["responses"].shape


def test_rollout_longer_than_the_model_positions_is_refused(worker):
    limit = worker.config.model.max_position_embeddings
    ids = torch.ones(2, limit + 4, dtype=torch.long)
    mask = torch.ones_like(ids)
    batch = TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(1) - 1,
                        "responses": ids[:, -4:]}, batch_size=[2])
    with pytest.raises(BatchError, match="max_position_embeddings"):
        worker.compute_values(batch)


def test_alternating_calls_do_not_leak(worker, batch):
    """100 alternating compute_values / update_critic calls: no tensor outlives its call (Python-level
    references, exact) and the process' resident memory stays flat (allocator-level, coarse)."""
    import gc

    import psutil

    def live_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o))

    def pair():
        batch["values"] = worker.compute_values(batch)
        worker.update_critic(batch)

    for _ in range(10):  # warm-up: optimizer state, allocator pools, caches
        pair()
    tensors, rss = live_tensors(), psutil.Process().memory_info().rss
    for _ in range(50):
        pair()
    assert live_tensors() == tensors
    grown = psutil.Process().memory_info().rss - rss
    print(f"resident memory after 100 more calls: {grown / 2**20:+.1f} MiB")
    assert grown < 32 << 20


@pytest.mark.parametrize("unit, after_each_call", [
    # warm-up of 1 then linear decay to 0 at 4: lr = lr_max x (4 - n) / 3 after n schedule steps
    ("call", [1.0, 2 / 3, 1 / 3, 0.0]),  # one schedule step per update_critic call (verl's unit)
    ("step", [2 / 3, 0.0, 0.0, 0.0]),    # two optimizer steps per call: the schedule ends after 2 of 4 calls
])
def test_lr_schedule_unit(unit, after_each_call):
    config = load_config([*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4", "ppo_micro_batch_size_per_gpu=2",
                          "model.num_hidden_layers=2", "data.response_length=[2,10]", "optim.lr=1e-3",
                          "optim.min_lr=0", "optim.lr_decay_style=linear", "optim.total_training_steps=4",
                          "optim.lr_warmup_steps=1", f"optim.schedule_unit={unit}"])
    worker = CriticWorker(config)
    worker.init_model()
    try:
        batch = SyntheticRollouts(config).batch(0)
        batch["values"] = worker.compute_values(batch)
        lrs = []
        for _ in range(4):
            metrics = worker.update_critic(batch)
            assert len(metrics["critic/lr"]) == 2 and metrics["critic/skipped_steps"] == [0.0, 0.0]
            lrs.append(worker.state.optimizer.param_groups[0]["lr"])
        assert lrs == pytest.approx([1e-3 * f for f in after_each_call], abs=1e-12)
    finally:
        worker.close()


def test_warm_up_longer_than_the_schedule_names_its_unit():
    with pytest.raises(ConfigError, match="3 update_critic calls"):
        load_config(OVERRIDES + ["optim.total_training_steps=3", "optim.lr_warmup_steps=3", "optim.schedule_unit=call"])


def test_full_determinism_switches_the_process_and_megatron(monkeypatch):
    for key in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # a user's own choice stays
    worker = CriticWorker(load_config(OVERRIDES + ["megatron.full_determinism=true"]))
    try:
        worker.init_model()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # an op without one is an error
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["NCCL_ALGO"] == "Tree"
        embedding = worker.state.model[0].module.embedding.word_embeddings
        assert embedding.deterministic_mode  # Megatron's lookup by indexing
        batch = SyntheticRollouts(worker.config).batch(0)
        batch["values"] = worker.compute_values(batch)
        assert math.isfinite(worker.update_critic(batch)["critic/vf_loss"][0])
    finally:
        worker.close()
        torch.use_deterministic_algorithms(False)  # process-global: leave the other tests as they were
