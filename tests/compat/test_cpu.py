"""megacritic.compat.cpu: Megatron-Core sees a CPU "CUDA", the real ``torch`` stays untouched.

Enabling the backend mutates module globals of Megatron-Core, so every check runs in a fresh
interpreter. To keep the runtime low, one interpreter runs all CUDA-absent checks (each recorded
separately) and a second one the CUDA-pretended check; both start together at module setup.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

_MARK = "@@RESULTS@@"

# Runs each check, records None (passed) or the traceback, and prints the results as JSON on a marked
# line; the script itself exits 0 whenever it gets to the end.
_HARNESS = textwrap.dedent(
    f"""
    import json, traceback, warnings
    warnings.simplefilter("ignore")
    RESULTS = {{}}

    def check(fn):
        try:
            fn()
            RESULTS[fn.__name__] = None
        except BaseException:
            RESULTS[fn.__name__] = traceback.format_exc()
        return fn

    def report():
        print({_MARK!r} + json.dumps(RESULTS), flush=True)
    """
)

_CPU_CHECKS = textwrap.dedent(
    """
    import importlib
    import torch

    ORIGINAL_TYPE = torch.Tensor.type
    ORIGINAL_CURRENT_DEVICE = torch.cuda.current_device
    ORIGINAL_ZEROS = torch.zeros
    assert not torch.cuda.is_available(), "these checks need a machine without CUDA"

    import megacritic.compat.cpu as cpu

    def _real_cuda_alloc_raises():
        try:
            torch.zeros(1, device="cuda")
        except (AssertionError, RuntimeError):
            return True
        return False

    @check
    def enable_and_scope():
        assert not cpu.cpu_backend_active()
        assert cpu.enable_cpu_backend() is True
        assert cpu.cpu_backend_active()
        schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
        layers = importlib.import_module("megatron.core.tensor_parallel.layers")
        optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
        distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
        proxy = schedules.torch
        wrapped = (optimizer.clip_grad_by_total_norm_fp32,
                   optimizer.Float16OptimizerWithFloat16Params.__init__,
                   distrib.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"].__func__)
        # Idempotent: a second call changes nothing (no second proxy, no double wrapping).
        assert cpu.enable_cpu_backend() is True
        assert schedules.torch is proxy and layers.torch is proxy
        assert (optimizer.clip_grad_by_total_norm_fp32,
                optimizer.Float16OptimizerWithFloat16Params.__init__,
                distrib.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"].__func__) == wrapped
        assert not hasattr(wrapped[0].__wrapped__, "__wrapped__"), "wrapped twice"
        # The wrapped classmethod is still callable through the class, and leaves .type() as it was.
        assert distrib.DistributedOptimizer._build_model_and_main_param_groups([], {}, [], None) == ([],) * 5
        assert torch.Tensor.type is ORIGINAL_TYPE
        # What Megatron sees.
        assert proxy is not torch
        t = schedules.torch.zeros(1, device="cuda")
        assert t.device.type == "cpu", t.device
        assert schedules.torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert schedules.torch.ones(2, device=0).device.type == "cpu"
        assert layers.torch.cuda.current_device() == torch.device("cpu"), layers.torch.cuda.current_device()
        assert layers.torch.cuda.current_device().type == "cpu"
        assert layers.torch.Tensor is torch.Tensor  # everything else is the real thing
        # The real torch is untouched.
        assert _real_cuda_alloc_raises(), "real torch.zeros(device='cuda') did not raise"
        assert torch.zeros is ORIGINAL_ZEROS
        assert torch.Tensor.type is ORIGINAL_TYPE
        assert torch.cuda.current_device is ORIGINAL_CURRENT_DEVICE
        assert not isinstance(torch.cuda, type(layers.torch.cuda))

    @check
    def type_patch_is_narrow():
        assert cpu.enable_cpu_backend() is True
        x, h, b = torch.ones(1), torch.ones(1, dtype=torch.half), torch.ones(1, dtype=torch.bfloat16)
        assert x.type() == "torch.FloatTensor", x.type()
        assert torch.Tensor.type is ORIGINAL_TYPE
        with cpu._cpu_tensors_typed_as_cuda():
            assert x.type() == "torch.cuda.FloatTensor", x.type()
            assert h.type() == "torch.cuda.HalfTensor", h.type()
            assert b.type() == "torch.cuda.BFloat16Tensor", b.type()
            assert torch.ones(1, dtype=torch.float64).type() == "torch.DoubleTensor"
            assert x.type(torch.float64).dtype == torch.float64  # conversion still works
        assert x.type() == "torch.FloatTensor", x.type()
        assert torch.Tensor.type is ORIGINAL_TYPE
        try:
            with cpu._cpu_tensors_typed_as_cuda():
                assert x.type() == "torch.cuda.FloatTensor"
                raise ValueError("boom")
        except ValueError as e:
            assert str(e) == "boom"
        else:
            raise AssertionError("exception swallowed")
        assert x.type() == "torch.FloatTensor", x.type()
        assert torch.Tensor.type is ORIGINAL_TYPE
        # The wrapper used for the optimizer functions: cuda type names inside, originals after.
        seen = cpu._typed_as_cuda(lambda t: t.type())(x)
        assert seen == "torch.cuda.FloatTensor", seen
        assert x.type() == "torch.FloatTensor"

    @check
    def rng_tracker_fork_on_cpu():
        import socket
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        assert cpu.enable_cpu_backend() is True
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel(1, 1)
            try:
                model_parallel_cuda_manual_seed(123)
                tracker = get_cuda_rng_tracker()
                # Reference streams: the outer one, and the model-parallel one (seed + 2718 + tp_rank).
                torch.manual_seed(0)
                ref_outer = torch.rand(8)
                gen = torch.Generator().manual_seed(123 + 2718)
                ref_inner = torch.rand(6, generator=gen)

                torch.manual_seed(0)
                a = torch.rand(3)
                with tracker.fork():
                    inner1 = torch.rand(3)
                    assert inner1.device.type == "cpu"
                b = torch.rand(2)
                with tracker.fork():
                    inner2 = torch.rand(3)
                c = torch.rand(3)
                outer = torch.cat([a, b, c])
                assert torch.equal(outer, ref_outer), (outer, ref_outer)
                inner = torch.cat([inner1, inner2])
                # The fork keeps its own stream, continuing from one fork to the next.
                assert torch.equal(inner, ref_inner), (inner, ref_inner)
                # A body that raises still restores the outer state.
                torch.manual_seed(1)
                d = torch.rand(2)
                try:
                    with tracker.fork():
                        torch.rand(5)
                        raise ValueError("boom")
                except ValueError:
                    pass
                e = torch.rand(2)
                torch.manual_seed(1)
                assert torch.equal(torch.cat([d, e]), torch.rand(4))
            finally:
                parallel_state.destroy_model_parallel()
        finally:
            dist.destroy_process_group()

    report()
    """
)

_PRETEND_CUDA = textwrap.dedent(
    """
    import torch
    torch.cuda.is_available = lambda: True
    ORIGINAL_TYPE = torch.Tensor.type
    ORIGINAL_CURRENT_DEVICE = torch.cuda.current_device

    import megacritic.compat.cpu as cpu

    @check
    def noop_with_cuda():
        import importlib
        assert cpu.enable_cpu_backend() is False
        assert cpu.enable_cpu_backend() is False
        assert not cpu.cpu_backend_active()
        for name in ("megatron.core.pipeline_parallel.schedules", "megatron.core.tensor_parallel.layers",
                     "megatron.core.parallel_state"):
            module = importlib.import_module(name)
            assert module.torch is torch, name
        random = importlib.import_module("megatron.core.tensor_parallel.random")
        assert random._get_cuda_rng_state is not cpu._get_rng_state
        assert random._set_cuda_rng_state is not cpu._set_rng_state
        optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
        assert not hasattr(optimizer.clip_grad_by_total_norm_fp32, "__wrapped__")
        assert torch.Tensor.type is ORIGINAL_TYPE
        assert torch.cuda.current_device is ORIGINAL_CURRENT_DEVICE

    report()
    """
)


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _HARNESS + body], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def runs():
    with ThreadPoolExecutor(2) as pool:
        cpu, cuda = pool.submit(_run, _CPU_CHECKS), pool.submit(_run, _PRETEND_CUDA)
        return {"cpu": cpu.result(), "cuda": cuda.result()}


def _assert_passed(proc: subprocess.CompletedProcess, check: str) -> None:
    diagnostics = f"\n--- returncode {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, "subprocess failed" + diagnostics
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    assert lines, "subprocess reported no results" + diagnostics
    results = json.loads(lines[-1][len(_MARK):])
    assert check in results, f"check {check!r} did not run" + diagnostics
    assert results[check] is None, f"check {check!r} failed:\n{results[check]}" + diagnostics


def test_enable_returns_true_idempotent_and_scoped_to_megatron(runs):
    _assert_passed(runs["cpu"], "enable_and_scope")


def test_type_patch_only_inside_wrapped_calls(runs):
    _assert_passed(runs["cpu"], "type_patch_is_narrow")


def test_rng_tracker_fork_restores_outer_state(runs):
    _assert_passed(runs["cpu"], "rng_tracker_fork_on_cpu")


def test_noop_when_cuda_available(runs):
    _assert_passed(runs["cuda"], "noop_with_cuda")
