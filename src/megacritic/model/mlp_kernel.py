"""A gated MLP's SwiGLU inside its GEMMs (``model.fused_mlp``): quack's Hopper GEMMs with the activation in
fc1's epilogue and its derivative in the epilogue of fc2's input-gradient GEMM.

Megatron's MLP runs fc1 (a GEMM writing the pre-activation ``[t, 2f]``), the SwiGLU (a memory-bound kernel
reading it and writing ``[t, f]``) and fc2; the backward runs fc2's input gradient (writing ``[t, f]``), the
SwiGLU's backward (reading that and the pre-activation, writing ``[t, 2f]``) and fc1's GEMMs. At 1.5B the two
SwiGLU kernels took 0.103 s of a 1.38 s update on an H100 (bench/NOTES.md), at bandwidth. Here:

* forward: ``gemm_act`` computes fc1 and applies SwiGLU to the float32 accumulator in the epilogue, writing
  the activation and, when training, the pre-activation for the backward (without a gradient: not at all);
* backward: ``gemm_dact`` computes ``dout @ W2`` and in its epilogue the SwiGLU's derivative from the saved
  pre-activation, writing its gradient and the recomputed activation (fc2's weight gradient needs it, so the
  activation is not kept from the forward: ``[t, f]`` less memory per layer); with ``keep_activation``
  (``model.fused_mlp_keep_activation``, the default) the forward's activation is kept instead and the same
  GEMM writes the gradient alone (:func:`dswiglu_epilogue`: 8 instead of 10 bytes per intermediate element
  and token; the GEMM -21% at 1.5B on an H100, where its epilogue, not its mainloop, bounds it);
* fc2's forward and weight gradient stay cuBLAS (float32 accumulation into ``main_grad``, as
  ``megacritic.compat.kernels`` gives Megatron's layers), fc1's input and weight gradients are quack GEMMs that
  read the pre-activation's layout.

quack keeps a gated pre-activation interleaved (gate and up columns alternating) while Megatron's fc1 weight
holds ``[gate; up]`` as two halves: ``concat_layout`` makes quack read and write that weight (and its gradient
buffer) as it is, so parameters, checkpoints and Hugging Face names do not change.

Arithmetic: the activation is taken from fc1's float32 accumulator, not from its bf16 rounding as in
Megatron's kernel, and fc1's weight gradient is accumulated into float32 ``main_grad`` inside the GEMM.
Outputs agree with Megatron's MLP within bf16 rounding (GPU-tested). quack's heuristic tile configurations
(``tuned=False``): its autotuner keys on the token count, which changes with every pack.

Where it runs: a Hopper GPU with quack-kernels (the ``megacritic[hopper]`` extra) and use_fused_kernels, bf16
or fp16, tensor-parallel size 1, no bias, SwiGLU (``gated_linear_unit`` with silu), no
per-token scale; elsewhere Megatron's MLP (``megacritic.model.value_model`` decides per model, ``runs_fused``
per call).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from torch import Tensor

from megacritic.model.grad_buffer import accumulates_into_main_grad, added_to_main_grad


def _quack():
    from quack import gemm_interface  # imported only where it runs: CUDA with the hopper extra
    return gemm_interface


def quack_available() -> bool:
    try:
        _quack()
    except Exception:  # noqa: BLE001 - any import failure (no package, no CUDA DSL runtime) means "not here"
        return False
    return True


def gpu_problem() -> str | None:
    """Why the fused MLP cannot run on this process' GPU, or None: measured and tested on Hopper (9.x) only,
    and it needs quack-kernels."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}; tested on 9.x (Hopper)"
    if not quack_available():
        return "quack-kernels does not import (pip install 'megacritic[hopper]')"
    return None


@functools.cache
def dswiglu_epilogue():
    """``gemm_dact``'s SwiGLU epilogue without its second output (the recomputed activation), through quack's
    epilogue frontend: C is the interleaved pre-activation, D its gradient, both as gate / up pairs (quack's
    ``packed_cd_b16x2`` mode), with quack's own derivative, so D is ``gemm_dact``'s first output bit for
    bit."""
    from quack.activation import dgate_fn_map
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.math import pack, unpack

    dswiglu = dgate_fn_map["swiglu"]

    @gemm_epilogue(mode="packed_cd_b16x2")
    def dswiglu_of_preact(acc, c):
        gate, up = unpack(c)
        dgate, dup, _ = dswiglu(gate, up, acc)
        return {"D": pack(dgate, dup)}

    return dswiglu_of_preact


def _weight_grad(weight: Tensor, a: Tensor, b: Tensor, concat: bool) -> Tensor:
    """The gradient a^T @ b of ``weight``: added to its float32 ``main_grad`` where DDP gave it one (fc1's by
    quack, reading a gate / up interleaved ``a`` into the weight's halves; fc2's by cuBLAS), else returned."""
    q = _quack()
    if accumulates_into_main_grad(weight):
        if concat:
            q.gemm_add_inplace(a.t(), b, weight.main_grad, dynamic_scheduler=True, tuned=False,
                               concat_layout=("C", "out"))
        elif weight.main_grad.dtype == torch.float32 and a.dtype != torch.float32:
            torch.addmm(weight.main_grad, a.t(), b, out_dtype=torch.float32, out=weight.main_grad)
        else:
            weight.main_grad.addmm_(a.t(), b)
        return added_to_main_grad(weight)
    if concat:
        return q.gemm(a.t(), b, dynamic_scheduler=True, tuned=False, concat_layout=("out",))
    return a.t() @ b


class SwiGLUMLPFunction(torch.autograd.Function):
    """x [t, h], fc1 weight [2f, h] (gate; up), fc2 weight [h, f] -> silu(x W1g^T) * (x W1u^T) @ W2^T [t, h];
    ``keep_activation``: the activation saved for the backward instead of recomputed there."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, keep_activation: bool) -> Tensor:
        q = _quack()
        preact, act = q.gemm_act(x, w1.t(), activation="swiglu", tuned=False, concat_layout=("B",))
        ctx.save_for_backward(x, w1, w2, preact, *([act] if keep_activation else []))
        return act @ w2.t()

    @staticmethod
    def backward(ctx, dout: Tensor):
        q = _quack()
        x, w1, w2, preact, *kept = ctx.saved_tensors
        dout = dout.contiguous()
        # d(preact) from dout @ W2 and the saved pre-activation; the activation kept, or recomputed beside it
        if kept:
            act, = kept
            dpreact = dswiglu_epilogue()(dout, w2, preact, out={"D": torch.empty_like(preact)}, tuned=False,
                                          dynamic_scheduler=True)["D"]
        else:
            dpreact, act = q.gemm_dact(dout, w2, preact, activation="swiglu", tuned=False)
        dw2 = _weight_grad(w2, dout, act, concat=False)
        dx = q.gemm(dpreact, w1, dynamic_scheduler=True, tuned=False, concat_layout=("B",))
        dw1 = _weight_grad(w1, dpreact, x, concat=True)
        return dx, dw1, dw2, None


def swiglu_mlp(x: Tensor, w1: Tensor, w2: Tensor, *, keep_activation: bool) -> Tensor:
    """The MLP on ``x`` [..., h]; without autograd only the activation is written (no pre-activation)."""
    rows = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or w1.requires_grad or w2.requires_grad):
        out = SwiGLUMLPFunction.apply(rows, w1, w2, keep_activation)
    else:
        _, act = _quack().gemm_act(rows, w1.t(), activation="swiglu", tuned=False, concat_layout=("B",),
                                   store_preact=False)
        out = act @ w2.t()
    return out.reshape(*x.shape[:-1], out.shape[-1])


class FusedSwiGLUMLP(MLP):
    """Megatron's MLP (same submodules, parameters and names) whose forward is :func:`swiglu_mlp` where it
    can run (module docstring), else upstream's."""

    keep_activation: bool  # set per module by use_fused_mlp

    def runs_fused(self, hidden_states: Tensor, per_token_scale) -> bool:
        c = self.config
        return (hidden_states.is_cuda and hidden_states.dtype in (torch.bfloat16, torch.float16)
                and per_token_scale is None and c.gated_linear_unit and self.activation_func is F.silu
                and c.tensor_model_parallel_size == 1 and not c.sequence_parallel
                and self.linear_fc1.bias is None and self.linear_fc2.bias is None
                and getattr(c, "fp8", None) is None)

    def forward(self, hidden_states: Tensor, per_token_scale=None, **kwargs):
        if not self.runs_fused(hidden_states, per_token_scale):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        return swiglu_mlp(hidden_states, self.linear_fc1.weight, self.linear_fc2.weight,
                          keep_activation=self.keep_activation), None


def use_fused_mlp(model: torch.nn.Module, *, keep_activation: bool) -> int:
    """Give every dense MLP of ``model`` (exactly Megatron's ``MLP``: not experts, not shared experts)
    :class:`FusedSwiGLUMLP`'s forward, keeping the activation for the backward where ``keep_activation``
    (``model.fused_mlp_keep_activation``); the number changed. After the model is built, not through the
    layer spec: Megatron's TransformerLayer hands its tensor-parallel group only to a module that is exactly
    ``MLP`` (and warns for any other)."""
    mlps = [m for m in model.modules() if type(m) is MLP]
    for m in mlps:
        m.__class__ = FusedSwiGLUMLP
        m.keep_activation = keep_activation
    return len(mlps)
