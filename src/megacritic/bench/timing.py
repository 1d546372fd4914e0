"""Timing and memory of one call, and what else varies between processes (clock, host speed)."""

from __future__ import annotations

import gc
import time

import torch


class Timer:
    """Wall time of ``fn()``, the device synchronised before and after."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()

    def __call__(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - start


def reset_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def probe_host() -> dict:
    """What else varies between processes: the GPU's SM clock (MHz, read by NVML right after the timed
    calls), and the host's speed at the work it does in a step (Python and kernel launches)."""
    out = {}
    if torch.cuda.is_available():
        try:
            out["sm_clock_mhz"] = torch.cuda.clock_rate()
            out["power_w"] = torch.cuda.power_draw() / 1000
            out["temperature_c"] = torch.cuda.temperature()
        except Exception as e:  # noqa: BLE001 - NVML missing: reported, not fatal
            out["nvml"] = str(e)
        stats = torch.cuda.memory_stats()  # cumulative over the process: cudaMalloc retries, i.e. allocator churn
        out["alloc_retries"] = stats.get("num_alloc_retries", 0)
        out["device_mallocs"] = stats.get("segment.all.allocated", 0)
        x = torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20000):
            x.add_(1)  # launch-bound: ~the host's cost per kernel
        torch.cuda.synchronize()
        out["launch_us"] = (time.perf_counter() - start) / 20000 * 1e6
    start = time.perf_counter()
    sum(i * i for i in range(2_000_000))
    out["python_ms"] = (time.perf_counter() - start) * 1e3
    return out
