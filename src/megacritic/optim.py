"""Walking Megatron's optimizer: the per-group optimizers inside it and their torch optimizers."""

from __future__ import annotations

import torch


def megatron_optimizers(optimizer) -> list:
    """The Megatron optimizers that hold parameters: a ``ChainedOptimizer``'s parts (one per parameter group
    kind, e.g. dense and expert parameters), or ``optimizer`` itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers (param groups and state) inside Megatron's ``optimizer``; a part without one (a
    rank that holds no parameters of its kind) has none."""
    return [inner.optimizer for inner in megatron_optimizers(optimizer)
            if getattr(inner, "optimizer", None) is not None]
