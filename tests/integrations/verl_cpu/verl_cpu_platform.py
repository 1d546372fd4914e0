"""A CPU platform for verl 0.9.1, for the tests only: verl knows CUDA, NPU and ROCm, and without an accelerator
falls back to CUDA (NCCL), so its TrainingWorker cannot start on a CPU machine. Loaded into every Ray worker
through verl's own hooks (``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform``, ``VERL_PLATFORM=cpu``)."""

import contextlib
import types

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

# what verl's code asks of torch.<device> on its CPU path (memory statistics: nothing to report)
_DEVICE = types.SimpleNamespace(
    is_available=lambda: True, current_device=lambda: 0, device_count=lambda: 1, set_device=lambda i: None,
    synchronize=lambda *a: None, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    empty_cache=lambda: None, max_memory_allocated=lambda *a: 0, max_memory_reserved=lambda *a: 0,
    memory_allocated=lambda *a: 0, memory_reserved=lambda *a: 0, reset_peak_memory_stats=lambda *a: None,
    mem_get_info=lambda *a: (0, 0), get_device_name=lambda *a: "cpu")


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _DEVICE

    def is_available(self):
        return True

    def current_device(self):
        return 0

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "GPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def _gloo_only(initialize):
    """verl builds its process group's backend as "cpu:gloo,<device>:<backend>", which names the CPU twice on
    this platform (torch refuses it): gloo alone is the whole of it."""

    def initialize_cpu(timeout_second=None, backend=None):
        return initialize(timeout_second=timeout_second, backend=backend or "gloo")
    return initialize_cpu


import verl.utils.distributed as _distributed  # noqa: E402  (before verl's workers import the function)

_distributed.initialize_global_process_group_ray = _gloo_only(_distributed.initialize_global_process_group_ray)
