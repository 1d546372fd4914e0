"""Every place megacritic departs from upstream megatron-core 0.16, and why.

Process-global, applied by :func:`apply` (once, at the start of ``CriticWorker.init_model``; never at import
or as the side effect of building a config), for the rest of the process:

1. ``moe_utils.te_general_gemm``: the MoE router's GEMM without Transformer Engine (an upstream NameError
   otherwise; :func:`megacritic.compat.kernels.router_gemm_without_te`).
2. ``clip_grads.l2_norm_impl``, ``clip_grads.multi_tensor_scale_impl``, ``optimizer.multi_tensor_scale_impl``:
   torch foreach kernels for the grad norm and grad scaling instead of per-tensor loops with a host sync each
   (:func:`~megacritic.compat.kernels.foreach_grad_norm_and_scale`). These are module globals of Megatron,
   so every Megatron optimizer in the process uses them, not only the critic's.
3. With ``fused`` on CUDA: ``tensor_parallel.layers.fused_weight_gradient_mlp_cuda`` and
   ``_grad_accum_fusion_available``: weight gradients accumulated inside the GEMM without apex
   (:func:`~megacritic.compat.kernels.weight_grad_accumulation_in_gemm`); and ``mlp.bias_swiglu_impl``,
   ``shared_experts.bias_swiglu_impl``: the MLPs' SwiGLU as megacritic's Triton kernel (the compiled pair's
   arithmetic, each input read once; :func:`~megacritic.compat.kernels.triton_swiglu`).
4. With ``on_cpu``: Megatron-Core on CPU (gloo): each CUDA-reaching Megatron module's ``torch`` global, the RNG
   tracker's state accessors, the MoE dispatcher's host copy, and three optimizer functions
   (:mod:`megacritic.compat.cpu`).

Per object, applied where the object exists:

5. Fused AdamW: the optimizer's param groups switched to torch's fused kernel
   (:func:`~megacritic.compat.kernels.use_fused_adamw`, after the optimizer is built, when ``fused``).
6. Adam's ``step`` kept per parameter, and no autograd, while a checkpoint's or a snapshot's distributed
   optimizer state loads: instance attributes of the optimizer for the duration of the load
   (:mod:`megacritic.compat.adam_step`).
7. With ``megatron.optimizer_cpu_offload``: ``OptimizerConfig.use_precision_aware_optimizer`` set after the
   config's own checks, which read Transformer Engine's version and fail without it
   (:func:`~megacritic.compat.kernels.precision_aware_without_te`).
8. The optimizer step of ``update_critic`` with torch's fused AdamW: Megatron's ``step()`` taken apart
   (``prepare_grads``, ``get_main_grads_for_grad_norm``, ``step_with_ready_grads``) so that the grad norm,
   the clipping and the skip of a non-finite step stay on the device, where upstream reads the norm on the
   host (:func:`megacritic.optim.step_on_device`; the same weights to the bit in
   ``tests/test_critic.py::test_steps_decided_on_the_device_equal_steps_decided_on_the_host``).
9. The word embedding (Megatron's ``VocabParallelEmbedding``, which takes no module spec) given
   :class:`megacritic.model.embedding.MainGradEmbedding`'s forward when the value model is built: its weight
   gradient goes straight into DDP's ``main_grad`` instead of a dense [vocab, hidden] gradient per
   micro-batch that DDP's hook then adds (:func:`~megacritic.model.embedding.lookup_into_main_grad`).
10. With ``model.fused_mlp`` where it runs: every dense ``MLP`` of the value model given
    :class:`megacritic.model.mlp_kernel.FusedSwiGLUMLP`'s forward when the model is built (the SwiGLU inside
    quack's GEMMs; :func:`~megacritic.model.mlp_kernel.use_fused_mlp`). After construction rather than through
    the layer spec, because Megatron's TransformerLayer passes its tensor-parallel group only to a module that
    is exactly ``MLP``.

``tests/compat/test_compat.py`` lists every attribute :func:`apply` changes; a change to the list shows there.
"""

from __future__ import annotations

# The megatron-core releases these departures were written against (and checked on): each replaces a
# specific upstream name or behaviour of that release, and on another one could silently miss or half-apply.
SUPPORTED_MEGATRON_CORE = "0.16"


class UnsupportedVersion(RuntimeError):
    """The installed megatron-core is not the release :mod:`megacritic.compat` was written for."""


def megatron_core_version() -> str:
    from megatron.core import package_info
    return package_info.__version__


def require_supported_megatron() -> None:
    """Raise :class:`UnsupportedVersion`, naming the installed version, unless it is 0.16.x."""
    installed = megatron_core_version()
    if installed.split(".")[:2] != SUPPORTED_MEGATRON_CORE.split("."):
        raise UnsupportedVersion(
            f"megatron-core {installed} is installed, but megacritic's changes to megatron-core "
            f"(megacritic.compat) were written for megatron-core {SUPPORTED_MEGATRON_CORE}.x; install "
            f"megatron-core>={SUPPORTED_MEGATRON_CORE}.1,<0.17 (pyproject.toml pins it)")


def apply(*, on_cpu: bool, fused: bool) -> None:
    """Make the process-global departures from upstream (the module docstring lists them) that this run needs:
    ``on_cpu``: Megatron-Core on CPU (no CUDA device); ``fused``: the fused GPU kernels
    (model.use_fused_kernels on a GPU). Checks the megatron-core version first, so nothing changes on an
    unsupported one. Idempotent: a second call (a second CriticWorker in the process) changes nothing more."""
    require_supported_megatron()
    from megacritic.compat import cpu, kernels

    kernels.router_gemm_without_te()
    kernels.foreach_grad_norm_and_scale()
    if fused:
        kernels.weight_grad_accumulation_in_gemm()
        kernels.triton_swiglu()
    if on_cpu:
        cpu.enable_cpu_backend()
