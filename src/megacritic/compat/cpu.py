"""Run Megatron-Core on CPU (gloo) when CUDA is absent.

Megatron-Core has no CPU mode: a few dozen call sites allocate with ``device="cuda"`` or
``torch.cuda.current_device()``, seed and swap CUDA RNG states, or assert ``tensor.type() ==
"torch.cuda.FloatTensor"``. Rather than patching ``torch`` for the whole process, this layer
changes only what those Megatron modules see:

* each module in ``_CUDA_MODULES`` gets, as its global ``torch``, a proxy whose factory functions
  map a CUDA device to the CPU and whose ``torch.cuda`` reports the CPU as the current device and
  turns streams and synchronisation into no-ops;
* the model-parallel RNG tracker keeps CPU generator states instead of CUDA ones;
* the three optimizer functions that check ``tensor.type()`` run with CPU float tensors reported
  as their CUDA types (for the duration of those calls only);
* the MoE all-to-all token dispatcher gets its split sizes as the sequence of ints it gets on a GPU.

It is switched on by :func:`megacritic.compat.apply` with ``on_cpu=True`` (through
:func:`enable_cpu_backend`, which does nothing when CUDA is available), so a GPU run executes upstream
Megatron-Core untouched. ``tests/compat/test_cpu.py`` checks both.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch

# Megatron-Core modules that reach CUDA directly on the paths we use (model, TP/PP/DP, DDP,
# distributed optimizer, schedules, grad clipping, RNG, distributed checkpointing).
_CUDA_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.data",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.timers",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.utils",
    # MoE layers: the router moves its weight to the current device, the all-to-all dispatcher copies split
    # sizes to the host on a side stream, the aux-loss tracker allocates on CUDA.
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
)

_CPU = torch.device("cpu")
_active = False


def _to_cpu_device(device):
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs an accelerator
        return fn(*args, **kwargs)

    return wrapped


class _NullEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is already complete when recorded."""

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullEvent()

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuCuda(types.SimpleNamespace):
    """``torch.cuda`` as the patched modules see it: the CPU is the current device."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return _CPU

    @staticmethod
    def current_stream(*args, **kwargs):
        return _NullStream()

    Stream = _NullStream
    Event = _NullEvent

    @staticmethod
    def stream(*args, **kwargs):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(*args, **kwargs):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *args, **kwargs):
        torch.set_rng_state(state)

    @staticmethod
    def memory_allocated(*args, **kwargs):
        return 0

    @staticmethod
    def max_memory_allocated(*args, **kwargs):
        return 0


_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like",
)


class _CpuTorch(types.ModuleType):
    """``torch`` as the patched modules see it; everything not overridden is the real thing."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


# RNG tracker on CPU generator states (replaces the CUDA state accessors in tensor_parallel.random).
def _get_rng_state(device=None, clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cpu_tensors_typed_as_cuda():
    original = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return _CUDA_TYPE_NAMES.get(name, name)

    torch.Tensor.type = tensor_type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _typed_as_cuda(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _cpu_tensors_typed_as_cuda():
            return fn(*args, **kwargs)

    return wrapped


def _host_split_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
    """The MoE all-to-all dispatcher's device-to-host copy of its split sizes, for tensors already on the host.
    Upstream turns them into numpy only when it copies them off a GPU; ``all_to_all_single`` takes a
    sequence of ints, not a CPU tensor."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def enable_cpu_backend() -> bool:
    """Make Megatron-Core usable on CPU. Returns True when the CPU backend is (now) active.

    Does nothing, and returns False, when CUDA is available. Idempotent.
    """
    global _active
    if torch.cuda.is_available():
        return False
    if _active:
        return True
    cpu_torch = _CpuTorch()
    for name in _CUDA_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = cpu_torch

    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _get_rng_state
    random._set_cuda_rng_state = _set_rng_state

    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes

    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    optimizer.clip_grad_by_total_norm_fp32 = _typed_as_cuda(optimizer.clip_grad_by_total_norm_fp32)
    build = distrib.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    kind = type(build)  # classmethod or staticmethod upstream: keep it
    distrib.DistributedOptimizer._build_model_and_main_param_groups = kind(_typed_as_cuda(build.__func__))
    f16 = optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = _typed_as_cuda(f16.__init__)
    _active = True
    return True


def cpu_backend_active() -> bool:
    return _active
