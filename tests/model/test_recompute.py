"""Megatron's activation recompute (megatron.recompute_*) changes what is kept for backward, not the
arithmetic: the recomputed forward runs the same float32 CPU kernels on the same inputs, so values,
losses, gradients and updated weights equal the run without recompute bit for bit."""

import pytest
import torch

from megacritic import CriticWorker, load_config
from megacritic.config import TINY_MODEL_OVERRIDES
from megacritic.config import ConfigError, MegatronConfig
from megacritic.data.sources import SyntheticRollouts
from megacritic.model.value_model import recompute_options

BASE = [*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4", "use_dynamic_bsz=true", "ppo_max_token_len_per_gpu=64",
        "model.num_hidden_layers=3", "data.response_length=[2,20]", "shuffle=false", "model.dtype=float32"]


def _run(extra):
    worker = CriticWorker(load_config(BASE + extra))
    worker.init_model()
    try:
        batch = SyntheticRollouts(worker.config).batch(0)
        values = worker.compute_values(batch)
        batch["values"] = values
        metrics = worker.update_critic(batch)
        # After the call the gradient buffers still hold the last mini-batch's gradients.
        params = [p for chunk in worker.state.model for p in chunk.parameters()]
        grads = [p.main_grad.clone() for p in params]
        weights = [p.detach().clone() for p in params]
        config = worker.state.model[0].config
        recompute = (config.recompute_granularity, config.recompute_method, list(config.recompute_modules))
        return values, metrics, grads, weights, recompute
    finally:
        worker.close()


@pytest.fixture(scope="module")
def plain():
    return _run([])


@pytest.mark.parametrize("extra,expected", [
    (["megatron.recompute_granularity=selective"], ("selective", None, ["core_attn"])),
    (["megatron.recompute_granularity=selective", "megatron.recompute_modules=[core_attn,mlp]"],
     ("selective", None, ["core_attn", "mlp"])),
    (["megatron.recompute_granularity=full", "megatron.recompute_method=uniform", "megatron.recompute_num_layers=1"],
     ("full", "uniform", None)),
    (["megatron.recompute_granularity=full", "megatron.recompute_method=block", "megatron.recompute_num_layers=2"],
     ("full", "block", None)),
])
def test_recompute_equals_no_recompute(plain, extra, expected):
    values, metrics, grads, weights, recompute = _run(extra)
    assert recompute[:2] == expected[:2]
    if expected[2] is not None:
        assert recompute[2] == expected[2]
    assert plain[4][0] is None  # the reference really runs without recompute
    assert torch.equal(values, plain[0])
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert metrics[key] == plain[1][key], key
    assert all(torch.equal(g, ref) for g, ref in zip(grads, plain[2]))
    assert any(g.abs().max() > 0 for g in grads)  # gradients were compared, not zeros
    assert all(torch.equal(w, ref) for w, ref in zip(weights, plain[3]))


MOE = ["model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32",
       "model.shared_expert_intermediate_size=32"]


def test_moe_layer_recompute_equals_no_recompute():
    plain, again = _run(MOE), _run(MOE + ["megatron.recompute_granularity=selective",
                                          "megatron.recompute_modules=[moe,core_attn]"])
    assert again[4][0] == "selective"
    assert torch.equal(plain[0], again[0])
    assert all(torch.equal(g, ref) for g, ref in zip(again[2], plain[2]))
    assert all(torch.equal(w, ref) for w, ref in zip(again[3], plain[3]))


def test_shared_expert_recompute_matches_to_float32_rounding():
    """Recomputing the shared expert alone reorders autograd's sum of the gradient reaching the MoE layer's
    input from its branches (routed experts, router, shared expert, gate): float32 rounding, measured
    2e-6 of the largest element at most, so the gradients agree to 1e-5 relative (not bit for bit)."""
    plain, again = _run(MOE), _run(MOE + ["megatron.recompute_granularity=selective",
                                          "megatron.recompute_modules=[shared_experts]"])
    assert torch.equal(plain[0], again[0])  # the forward is the same to the bit
    for g, ref in zip(again[2], plain[2]):
        assert float((g - ref).norm()) <= 1e-5 * float(ref.norm()) + 1e-12


@pytest.mark.parametrize("modules", ["[moe_act]", "[layernorm]", "[]"])
def test_recompute_refuses_modules_our_layers_lack(modules):
    with pytest.raises(ConfigError, match="megatron.recompute_modules"):
        load_config(BASE + ["megatron.recompute_granularity=selective", f"megatron.recompute_modules={modules}"])


def test_recompute_options_off():
    assert recompute_options(MegatronConfig()) == {}


def test_cpu_optimizer_offload_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("the GPU test covers the hybrid device optimizer")
    worker = CriticWorker(load_config(BASE + ["megatron.optimizer_cpu_offload=true"]))
    with pytest.raises(ConfigError, match="megatron.optimizer_cpu_offload"):
        worker.init_model()
