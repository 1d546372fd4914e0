"""model.fused_mlp (megacritic.model.mlp_kernel): which models take it, and that where quack's fused GEMMs do
not run (here: the CPU) the MLP is Megatron's, bit for bit. Its GPU arithmetic is tests/test_gpu.py's
(test_fused_mlp_*)."""

from types import SimpleNamespace

import pytest
import torch

from megacritic import CriticWorker, load_config
from megacritic.config import TINY_MODEL_OVERRIDES
from megacritic.data.sources import SyntheticRollouts
from megacritic.model import mlp_kernel
from megacritic.model.mlp_kernel import FusedSwiGLUMLP
from megacritic.model.value_model import fused_mlp_runs

BASE = [*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4", "use_dynamic_bsz=true",
        "ppo_max_token_len_per_gpu=64", "model.num_hidden_layers=2", "data.response_length=[2,20]",
        "shuffle=false", "model.dtype=float32"]


def _run(extra):
    worker = CriticWorker(load_config(BASE + extra))
    worker.init_model()
    try:
        fused = [m for chunk in worker.state.model for m in chunk.modules() if isinstance(m, FusedSwiGLUMLP)]
        batch = SyntheticRollouts(worker.config).batch(0)
        batch["values"] = worker.compute_values(batch)
        metrics = worker.update_critic(batch)
        weights = [p.detach().clone() for chunk in worker.state.model for p in chunk.parameters()]
        return fused, batch["values"], metrics, weights
    finally:
        worker.close()


def test_on_the_cpu_the_mlp_is_megatrons():
    assert load_config(BASE).model.fused_mlp  # on by default
    fused, values, metrics, weights = _run([])
    assert not fused
    _, ref_values, ref_metrics, ref_weights = _run(["model.fused_mlp=false"])
    assert torch.equal(values, ref_values)
    assert metrics["critic/vf_loss"] == ref_metrics["critic/vf_loss"]
    assert all(torch.equal(w, r) for w, r in zip(weights, ref_weights))


def _config(**over):
    model = SimpleNamespace(fused_mlp=True, cuda_graphs=False)
    config = SimpleNamespace(bias_activation_fusion=True, tensor_model_parallel_size=1, sequence_parallel=False)
    for key, value in over.items():
        setattr(model if hasattr(model, key) else config, key, value)
    return model, config


@pytest.mark.parametrize("over,runs", [
    ({}, True),
    ({"fused_mlp": False}, False),
    ({"bias_activation_fusion": False}, False),  # use_fused_kernels off, or the CPU
    ({"tensor_model_parallel_size": 2}, False),
    ({"sequence_parallel": True}, False),
    ({"cuda_graphs": True}, True),  # captured like any other kernel
])
def test_which_models_take_the_fused_mlp(monkeypatch, over, runs):
    monkeypatch.setattr(mlp_kernel, "gpu_problem", lambda: None)  # a Hopper GPU with quack
    assert fused_mlp_runs(*_config(**over)) is runs


def test_without_its_gpu_the_mlp_is_megatrons_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(mlp_kernel, "gpu_problem", lambda: "quack-kernels does not import")
    with caplog.at_level("INFO", logger="megacritic.model.value_model"):
        assert not fused_mlp_runs(*_config())
    assert "quack-kernels does not import" in caplog.text


def test_use_fused_mlp_changes_only_the_dense_mlps_and_keeps_megatrons_arithmetic_on_the_cpu():
    """Installed on a CPU model (runs_fused then declines every call): the dense MLPs become FusedSwiGLUMLP,
    parameters and their names stay, and the critic computes what it computed before, bit for bit."""
    worker = CriticWorker(load_config(BASE))
    worker.init_model()
    try:
        batch = SyntheticRollouts(worker.config).batch(0)
        before = worker.compute_values(batch)
        chunk = worker.state.model[0].module
        names = [n for n, _ in chunk.named_parameters()]
        assert mlp_kernel.use_fused_mlp(chunk, keep_activation=True) == 2  # model.num_hidden_layers=2
        assert [n for n, _ in chunk.named_parameters()] == names
        assert all(type(layer.mlp) is FusedSwiGLUMLP for layer in chunk.decoder.layers)
        assert torch.equal(worker.compute_values(batch), before)
    finally:
        worker.close()


def test_keep_activation_reaches_every_fused_mlp_and_changes_nothing_on_the_cpu(monkeypatch):
    """model.fused_mlp_keep_activation (on by default) is handed to every fused MLP when the model is built
    (here with the fused MLP forced in: on the CPU each call declines and runs Megatron's MLP, bit for bit)."""
    from megacritic.model import value_model

    assert load_config(BASE).model.fused_mlp_keep_activation
    monkeypatch.setattr(value_model, "fused_mlp_runs", lambda model, config: True)
    runs = {}
    for keep in (False, True):
        fused, values, metrics, weights = _run([f"model.fused_mlp_keep_activation={str(keep).lower()}"])
        assert len(fused) == 2 and all(m.keep_activation is keep for m in fused)
        runs[keep] = values, metrics["critic/vf_loss"], weights
    (v0, l0, w0), (v1, l1, w1) = runs[False], runs[True]
    assert torch.equal(v0, v1) and l0 == l1 and all(torch.equal(a, b) for a, b in zip(w0, w1))
