"""megacritic.model.norm_kernel, the Triton RMSNorm of layers.RMSNorm's fused path, run on the CPU by Triton's
interpreter (``TRITON_INTERPRET=1``) against the eager norm (layers._rms_norm) in float64: the same programs,
tiles and index arithmetic as on the GPU, in float32. The interpreter's casts to bf16 truncate instead of
rounding, so bf16 (eager's roundings) is checked on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import megacritic.model
from megacritic.model import layers

pytest.importorskip("triton")


@pytest.fixture
def kernel(monkeypatch):
    """The kernel module as the interpreter runs it (``triton.jit`` reads TRITON_INTERPRET when it wraps a
    function), loaded apart and put where ``layers.fused_rms_norm`` finds it. Its tiles are made smaller
    (fewer rows each) than on the GPU: the interpreter sums a tile one element at a time in Python, and
    small tiles reach several programs and a partly filled last one with few rows."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = megacritic.model.__path__[0] + "/norm_kernel.py"
    spec = importlib.util.spec_from_file_location("megacritic.model.norm_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.TILE = 1024
    monkeypatch.setattr(layers, "_norm_kernel", lambda: module)
    return module


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(t, n, seed=0):
    """The fused norm (interpreted kernels) and the float64 eager norm: outputs and both gradients."""
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(t, n, generator=gen)).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, generator=gen)).requires_grad_()
    dy = torch.randn(t, n, generator=gen)
    y = layers.fused_rms_norm(x, w, 1e-6)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = layers._rms_norm(x64, w64, 1e-6)
    y64.backward(dy.double())
    return [y.detach(), x.grad, w.grad], [y64.detach(), x64.grad, w64.grad]


@pytest.mark.parametrize("n", [200, 896])
def test_kernels_match_the_eager_norm_in_float64(kernel, n):
    """Outputs and both gradients in float32 within float32 rounding of float64: a hidden size that is not
    a power of two, several backward programs, and a last tile that the rows do not fill."""
    block_m, _ = kernel._blocks(n)
    t = 2 * block_m * kernel.ROW_BLOCKS + block_m // 2 + 3
    got, want = _run(t, n)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert _rel(g, w) < 1e-6


def test_weight_gradient_is_summed_in_a_fixed_order(kernel):
    """Two runs give the same bits (per-program partial sums, no atomics): what megatron.full_determinism
    and the CUDA graphs' replay-equals-eager test rely on on the GPU."""
    a, _ = _run(100, 64, seed=3)
    b, _ = _run(100, 64, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_no_tokens(kernel):
    x = torch.zeros(0, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y = layers.fused_rms_norm(x, w, 1e-6)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("x,w", [(torch.zeros(4, 8), torch.ones(7)), (torch.zeros(2, 4, 8), torch.ones(8)),
                                 (torch.zeros(4, 8), torch.ones(8, dtype=torch.float64))])
def test_mismatched_inputs_are_refused(kernel, x, w):
    with pytest.raises(ValueError, match="RMSNorm kernel"):
        kernel.rms_norm(x, w, 1e-6)
