"""Kernels megatron-core 0.16 takes from Transformer Engine or apex, given here without them.

megacritic runs without Transformer Engine and apex (its attention, norm, experts and optimizer paths are
chosen for that). Where Megatron-Core then has no path, or only a slow one, these functions give it one
built on torch. Each says what it replaces; :func:`megacritic.compat.apply` is the only caller of the
process-global ones.
"""

from __future__ import annotations

import torch
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.transformer import mlp
from megatron.core.transformer.moe import moe_utils, shared_experts
from megatron.core.utils import local_multi_tensor_applier

from megacritic.optim import l2_norm, torch_optimizers


def router_gemm_without_te() -> None:
    """megatron-core 0.16.1 bug: the router's gating matmul tests ``te_general_gemm is not None``, but
    ``moe_utils`` defines that name only when Transformer Engine imports, so without TE every router raises
    NameError. Defining it as absent selects the plain ``torch.mm`` path the code already has. With TE the
    name exists and stays as it is."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _WeightGradAccumulation:
    """The two calls Megatron's linear layers make of apex's ``fused_weight_gradient_mlp_cuda`` under
    ``gradient_accumulation_fusion``: main_grad += grad_output^T @ input as one GEMM that accumulates into
    the float32 gradient buffer (cuBLAS, bf16 inputs, float32 C with beta = 1), instead of a bf16 weight
    gradient that DDP's hook then adds to main_grad in a second pass (bench/NOTES.md: 11.3 -> 10.1 ms per
    1.5B layer). PyTorch >= 2.9 exposes that GEMM as ``addmm(..., out_dtype=float32)`` on CUDA."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
        if total_input.dtype == torch.float32:
            main_grad.addmm_(grad_output.t(), total_input)
        else:
            torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
        main_grad.addmm_(grad_output.t(), total_input)


def weight_grad_accumulation_in_gemm() -> None:
    """Upstream, ``gradient_accumulation_fusion`` needs apex's ``fused_weight_gradient_mlp_cuda`` (Megatron's
    linear layers refuse the setting without it). Without apex, PyTorch's mixed-precision ``addmm`` stands in
    for it (:class:`_WeightGradAccumulation`; CUDA only). With apex, or without CUDA or that ``addmm``,
    nothing changes."""
    if torch.cuda.is_available() and not tp_layers._grad_accum_fusion_available \
            and hasattr(torch.ops.aten.addmm, "dtype_out"):
        tp_layers.fused_weight_gradient_mlp_cuda = _WeightGradAccumulation
        tp_layers._grad_accum_fusion_available = True


def _bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """Megatron's ``bias_swiglu_impl`` as its MLPs call it under ``bias_activation_fusion``: without a bias,
    an FP8 copy or an offloaded input, on CUDA, megacritic.model.swiglu_kernel (the same float32 arithmetic,
    rounded once, each input read once: the module says why); otherwise upstream's compiled one."""
    if bias is None and not fp8_input_store and not cpu_offload_input and input.is_cuda:
        from megacritic.model.swiglu_kernel import swiglu  # Triton: imported only where it runs
        return swiglu(input)
    return fused_bias_swiglu.bias_swiglu_impl(input, bias, fp8_input_store, cpu_offload_input)


def triton_swiglu() -> None:
    """The dense MLPs' and shared experts' SwiGLU (``mlp.bias_swiglu_impl``, ``shared_experts.bias_swiglu_impl``:
    module globals, so every Megatron MLP in the process) through :func:`_bias_swiglu_impl`. CUDA only."""
    if torch.cuda.is_available():
        mlp.bias_swiglu_impl = _bias_swiglu_impl
        shared_experts.bias_swiglu_impl = _bias_swiglu_impl


def triton_swiglu_installed() -> bool:
    """Whether Megatron's MLPs run their SwiGLU through megacritic's kernel now (:func:`triton_swiglu`)."""
    return mlp.bias_swiglu_impl is _bias_swiglu_impl


def weight_grad_accumulation_available() -> bool:
    """Whether Megatron's linear layers can accumulate weight gradients inside the GEMM now (apex's kernel,
    or the stand-in :func:`weight_grad_accumulation_in_gemm` installed): the condition under which
    ``TransformerConfig.gradient_accumulation_fusion`` may be set. Reads; changes nothing."""
    return torch.cuda.is_available() and tp_layers._grad_accum_fusion_available


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """apex's multi_tensor_l2norm as Megatron calls it: the L2 norm of all tensors, as a [1] tensor."""
    return l2_norm(tensor_lists[0]).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """apex's multi_tensor_scale as Megatron calls it: dst = src * scale for every pair (dtypes may differ)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


def foreach_grad_norm_and_scale() -> None:
    """Without Transformer Engine or apex, Megatron's grad-norm and grad-clip fall back to Python loops over
    the tensors (``clip_grads.l2_norm_impl`` / ``multi_tensor_scale_impl`` and the optimizer's
    ``multi_tensor_scale_impl``), and the norm reads every tensor's norm on the host: one device
    synchronisation per parameter, ~800 per update_critic at 1.5B (``bench/profile_phase.py --sync-sites``),
    each draining the GPU's queue. torch's foreach kernels do the same arithmetic in a few launches and no
    synchronisation. This replaces those module globals for the whole process (every Megatron optimizer in
    it, megacritic's or not); with apex or Transformer Engine kernels present nothing changes."""
    if clip_grads.multi_tensor_applier is not local_multi_tensor_applier:
        return  # apex or Transformer Engine kernels are there
    clip_grads.l2_norm_impl = _foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = _foreach_scale
    megatron_optimizer.multi_tensor_scale_impl = _foreach_scale


def use_fused_adamw(optimizer) -> None:
    """Without Transformer Engine or apex, Megatron builds torch's AdamW with its multi-tensor (foreach)
    kernels; switch this optimizer's groups to the fused CUDA kernel (one pass per update; bench/NOTES.md).
    torch reads these flags at every step, and keeps ``step`` on the parameter's device for fused groups.
    Per optimizer (its param groups), not process-global."""
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)


def precision_aware_without_te(optimizer_config):
    """Turn on use_precision_aware_optimizer, which the hybrid device optimizer needs, after construction:
    megatron-core 0.16.1's OptimizerConfig.__post_init__ reads Transformer Engine's version whenever it is
    set and fails without TE (``None >= Version``), only to decide store_param_remainders (a TE FusedAdam
    feature, off here). The derived flag is what __post_init__ sets with CPU offload."""
    if optimizer_config.optimizer_cpu_offload:
        optimizer_config.use_precision_aware_optimizer = True
        optimizer_config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    return optimizer_config
