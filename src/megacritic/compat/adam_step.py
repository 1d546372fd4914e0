"""Loading torch Adam's ``step`` (and the state's tensors) from a megatron-core 0.16 distributed-optimizer
checkpoint, in either of the two layouts megacritic writes: fully reshardable (checkpoints) and DP-reshardable
(the snapshots of :class:`megacritic.ray.CriticGroup`).

Upstream, ``DistributedOptimizer.load_state_dict`` first gives every parameter one shared ``step`` tensor (the
checkpoint's common step), then the layout's loader copies the checkpoint into *every* per-parameter state
entry. The checkpoint's per-parameter state has no ``step`` (fully reshardable) or holds the live one
(DP-reshardable: a local object, not saved), so the copy would fail or write the live step into the shared
tensor. Here ``step`` is set aside while the per-parameter state is copied, and each parameter gets its own
copy of the common step back: torch's multi-tensor Adam increments ``step`` in place, so a shared tensor would
advance once per parameter. The copy runs under ``torch.no_grad``: the DP-reshardable loader copies into the
float32 main parameters, leaves that require grad, and lacks the decorator its fully-reshardable sibling has.

The change is scoped: an attribute of the optimizer instances, only for the duration of one load.
"""

from __future__ import annotations

import contextlib

import torch

from megacritic.optim import megatron_optimizers, torch_optimizers

PATCHED_METHODS = ("load_parameter_state_from_fully_reshardable", "load_parameter_state_from_dp_reshardable")


@contextlib.contextmanager
def _adam_step_set_aside(optimizer):
    aside = [(state, state.pop("step")) for inner in torch_optimizers(optimizer)
             for state in inner.state.values() if "step" in state]
    try:
        yield
    finally:
        for state, step in aside:
            state["step"] = step.clone()


@contextlib.contextmanager
def adam_step_kept_per_parameter(optimizer):
    """For the duration of the block, each Megatron optimizer inside ``optimizer`` that loads distributed
    parameter state (either layout) does so with torch Adam's ``step`` set aside and without autograd (this
    module's docstring says why); the instances are as before afterwards, also when the load raises."""
    patched = []
    for inner in megatron_optimizers(optimizer):
        for name in PATCHED_METHODS:
            original = getattr(inner, name, None)
            if original is None:
                continue

            def load_param_state(param_state, _inner=inner, _original=original):
                with _adam_step_set_aside(_inner), torch.no_grad():
                    _original(param_state)

            setattr(inner, name, load_param_state)  # an instance attribute, shadowing the class's method
            patched.append((inner, name))
    try:
        yield
    finally:
        for inner, name in patched:
            inner.__dict__.pop(name, None)
