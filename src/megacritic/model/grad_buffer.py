"""Weight gradients a backward adds to Megatron's gradient buffer (``main_grad``) itself, told to DDP the way
Megatron's linear layers tell it under ``gradient_accumulation_fusion``.

Megatron's DDP gives every trained parameter ``main_grad`` (a view into its float32 gradient buffer) and a
``grad_added_to_main_grad`` flag; its hook on the parameter's gradient accumulator adds ``param.grad`` to
``main_grad`` unless the flag is set, then drops ``param.grad``.
"""

from __future__ import annotations

import torch


def accumulates_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether a backward may add ``weight``'s gradient to its buffer itself: it trains, and Megatron's DDP
    gave it ``main_grad`` and the flag its hook reads."""
    return weight.requires_grad and hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad")


def added_to_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """Mark ``weight``'s gradient as added to ``main_grad`` and return what the backward hands autograd for it.
    Autograd still needs a gradient of the weight's shape, so that DDP's hook runs (on the backward's thread)
    and marks the gradient ready for an overlapped reduction; as in Megatron's linear layers it is
    uninitialised memory the hook drops unread (zeros where Megatron asks for them: ``zero_out_wgrad``)."""
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)
