"""Loading torch Adam's ``step`` from a fully-reshardable megatron-core 0.16 checkpoint.

Upstream, ``DistributedOptimizer.load_parameter_state_from_fully_reshardable`` copies the checkpoint into
*every* per-parameter state entry, but the checkpoint's per-parameter state has no ``step`` (upstream
restores it separately, from the common state, as one tensor shared by all parameters). Here ``step`` is set
aside while the per-parameter state is copied, and each parameter gets its own copy back: torch's
multi-tensor Adam increments ``step`` in place, so a shared tensor would advance once per parameter.

The change is scoped: an attribute of the optimizer instances, only for the duration of one load.
"""

from __future__ import annotations

import contextlib

from megacritic.optim import megatron_optimizers, torch_optimizers

PATCHED_METHOD = "load_parameter_state_from_fully_reshardable"


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
    """For the duration of the block, each Megatron optimizer inside ``optimizer`` that loads
    fully-reshardable state does so with torch Adam's ``step`` set aside (this module's docstring says why);
    the instances are as before afterwards, also when the load raises."""
    patched = []
    for inner in megatron_optimizers(optimizer):
        original = getattr(inner, PATCHED_METHOD, None)
        if original is None:
            continue

        def load_param_state(param_state, _inner=inner, _original=original):
            with _adam_step_set_aside(_inner):
                _original(param_state)

        setattr(inner, PATCHED_METHOD, load_param_state)  # an instance attribute, shadowing the class's method
        patched.append(inner)
    try:
        yield
    finally:
        for inner in patched:
            inner.__dict__.pop(PATCHED_METHOD, None)
