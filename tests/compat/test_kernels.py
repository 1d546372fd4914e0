"""megacritic.compat.kernels and megacritic.compat.adam_step, on their own (no Megatron world)."""

from __future__ import annotations

import pytest
import torch

from megacritic.compat.adam_step import PATCHED_METHODS, adam_step_kept_per_parameter
from megacritic.compat.kernels import _foreach_l2_norm, _foreach_scale, use_fused_adamw


def test_foreach_multi_tensor_ops_compute_what_megatron_asks():
    """The grad-norm and grad-scale kernels given to Megatron in place of its host-synchronising loops."""
    torch.manual_seed(0)
    grads = [torch.randn(7), torch.randn(3, 5), torch.randn(1)]
    norm, _ = _foreach_l2_norm(0, None, [grads], False)
    assert norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.allclose(norm, torch.cat([g.flatten() for g in grads]).double().norm().float(), rtol=1e-6)
    scaled = [g.clone() for g in grads]
    _foreach_scale(0, None, [scaled, scaled], 0.5)  # in place, as clip_grad_by_total_norm_fp32 calls it
    assert all(torch.equal(s, g * 0.5) for s, g in zip(scaled, grads))
    low = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    _foreach_scale(0, None, [grads, low], 1.0)  # main params -> model params
    assert all(torch.equal(lo, g.bfloat16()) for lo, g in zip(low, grads))


class _Part:
    """A Megatron optimizer as megacritic walks it: a torch optimizer under ``.optimizer``."""

    def __init__(self, params):
        self.optimizer = torch.optim.AdamW(params, lr=0.1)
        self.loaded_steps = None

    def load_parameter_state_from_fully_reshardable(self, param_state):
        # what upstream does: copy the checkpoint into every state entry the parameters have
        self.loaded_steps = [dict(s) for s in self.optimizer.state.values()]
        for state, saved in zip(self.optimizer.state.values(), param_state):
            for key, value in saved.items():
                state[key].copy_(value)

    def load_parameter_state_from_dp_reshardable(self, param_state):
        # upstream (no torch.no_grad of its own): the main parameters too, which are leaves requiring grad
        self.loaded_steps = [dict(s) for s in self.optimizer.state.values()]
        params = self.optimizer.param_groups[0]["params"]
        for param, saved in zip(params, param_state):
            for key, value in saved.items():
                (param if key == "param" else self.optimizer.state[param][key]).copy_(value)


class _Chained:
    def __init__(self, *parts):
        self.chained_optimizers = list(parts)


def _stepped_part(n: int) -> _Part:
    part = _Part([torch.nn.Parameter(torch.ones(2)) for _ in range(n)])
    for p in part.optimizer.param_groups[0]["params"]:
        p.grad = torch.ones(2)
    part.optimizer.step()
    return part


def test_use_fused_adamw_switches_every_group():
    parts = [_stepped_part(1), _stepped_part(2)]
    use_fused_adamw(_Chained(*parts))
    assert all(g["fused"] and not g["foreach"] for p in parts for g in p.optimizer.param_groups)


@pytest.mark.parametrize("layout", ["fully_reshardable", "dp_reshardable"])
def test_adam_step_set_aside_and_given_back_per_parameter(layout):
    part = _stepped_part(3)
    shared = torch.tensor(7.0)
    for state in part.optimizer.state.values():
        state["step"] = shared  # as upstream restores it: one tensor for all parameters
    saved = [{"exp_avg": torch.full((2,), 5.0), "exp_avg_sq": torch.full((2,), 6.0)}] * 3
    if layout == "dp_reshardable":
        saved = [{**s, "param": torch.full((2,), 4.0)} for s in saved]
    with adam_step_kept_per_parameter(_Chained(part)):
        assert set(PATCHED_METHODS) <= set(vars(part))  # on the instance only
        getattr(part, f"load_parameter_state_from_{layout}")(saved)
    assert not set(PATCHED_METHODS) & set(vars(part))
    if layout == "dp_reshardable":  # copied into leaves that require grad: no autograd error
        assert all(torch.equal(p, torch.full((2,), 4.0)) for p in part.optimizer.param_groups[0]["params"])
    assert all("step" not in s for s in part.loaded_steps)  # not in the copy
    steps = [s["step"] for s in part.optimizer.state.values()]
    assert all(torch.equal(s, shared) and s is not shared for s in steps)
    assert len({id(s) for s in steps}) == 3  # each parameter its own
    assert all(torch.equal(s["exp_avg"], torch.full((2,), 5.0)) for s in part.optimizer.state.values())


def test_adam_step_patch_removed_when_the_load_raises():
    part = _stepped_part(1)
    with pytest.raises(ValueError):
        with adam_step_kept_per_parameter(part):
            raise ValueError("load failed")
    assert not set(PATCHED_METHODS) & set(vars(part)) and "step" in next(iter(part.optimizer.state.values()))
