"""model.fused_mlp (megacritic.model.mlp_kernel): where quack's fused GEMMs cannot run (here: the CPU) the
MLP is Megatron's, bit for bit; the settings it cannot serve are refused before anything is built. Its GPU
arithmetic is tests/test_gpu.py's (test_fused_mlp_*)."""

import pytest
import torch

from megacritic import CriticWorker, load_config
from megacritic.config import TINY_MODEL_OVERRIDES, ConfigError
from megacritic.data.sources import SyntheticRollouts
from megacritic.model.mlp_kernel import FusedSwiGLUMLP

BASE = [*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4", "use_dynamic_bsz=true",
        "ppo_max_token_len_per_gpu=64", "model.num_hidden_layers=2", "data.response_length=[2,20]",
        "shuffle=false", "model.dtype=float32"]


def _run(extra):
    worker = CriticWorker(load_config(BASE + extra))
    worker.init_model()
    try:
        mlps = [m for chunk in worker.state.model for m in chunk.modules() if type(m).__name__.endswith("MLP")]
        batch = SyntheticRollouts(worker.config).batch(0)
        batch["values"] = worker.compute_values(batch)
        metrics = worker.update_critic(batch)
        weights = [p.detach().clone() for chunk in worker.state.model for p in chunk.parameters()]
        return mlps, batch["values"], metrics, weights
    finally:
        worker.close()


def test_fused_mlp_on_the_cpu_is_megatrons_mlp():
    mlps, values, metrics, weights = _run(["model.fused_mlp=true"])
    assert mlps and all(isinstance(m, FusedSwiGLUMLP) for m in mlps)
    ref_mlps, ref_values, ref_metrics, ref_weights = _run([])
    assert not any(isinstance(m, FusedSwiGLUMLP) for m in ref_mlps)
    assert torch.equal(values, ref_values)
    assert metrics["critic/vf_loss"] == ref_metrics["critic/vf_loss"]
    assert all(torch.equal(w, r) for w, r in zip(weights, ref_weights))


@pytest.mark.parametrize("extra,match", [
    (["megatron.tensor_model_parallel_size=2"], "tensor_model_parallel_size=1"),
    (["model.cuda_graphs=true"], "cuda_graphs"),
])
def test_fused_mlp_refuses_what_it_cannot_serve(extra, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(BASE + ["model.fused_mlp=true", *extra])
    assert "model.fused_mlp" in str(e.value)
