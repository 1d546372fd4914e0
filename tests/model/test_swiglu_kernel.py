"""megacritic.model.swiglu_kernel, the Triton SwiGLU, run on the CPU by Triton's interpreter
(``TRITON_INTERPRET=1``) against Megatron's SwiGLU and its backward (``fused_bias_swiglu.swiglu`` /
``swiglu_back``, their eager formulas) in float64: the same programs, tiles and index arithmetic as on the
GPU, in float32. bf16 (one rounding per output, as Megatron's compiled pair) is checked on the GPU
(tests/test_gpu.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import megacritic.model

pytest.importorskip("triton")


@pytest.fixture
def kernel(monkeypatch):
    """The kernel module as the interpreter runs it (``triton.jit`` reads TRITON_INTERPRET when it wraps a
    function), loaded apart, with small tiles: several programs each way and partly filled last ones."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = megacritic.model.__path__[0] + "/swiglu_kernel.py"
    spec = importlib.util.spec_from_file_location("megacritic.model.swiglu_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.BLOCK_M, module.BLOCK_N = 4, 16
    return module


def _megatron_swiglu(y):  # fused_bias_swiglu.swiglu without its compilation
    y_1, y_2 = torch.chunk(y, 2, -1)
    return F.silu(y_1) * y_2


def _megatron_swiglu_back(g, y):  # fused_bias_swiglu.swiglu_back without its compilation
    y_1, y_2 = torch.chunk(y, 2, -1)
    return torch.cat((g * torch.sigmoid(y_1) * (1 + y_1 * (1 - torch.sigmoid(y_1))) * y_2, g * F.silu(y_1)), -1)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(9, 2 * 40), (3, 5, 2 * 24)])
def test_kernels_match_megatrons_swiglu_in_float64(kernel, shape):
    """Output and input gradient in float32 within float32 rounding of float64: rows and columns that do not
    fill the last tiles, and a [s, b, 2n] input as Megatron's MLP passes it."""
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(*shape, generator=gen)).requires_grad_()
    y = kernel.swiglu(x)
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    x64 = x.detach().double()
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == torch.float32
    assert _rel(y.detach(), _megatron_swiglu(x64)) < 1e-6
    assert x.grad.shape == x.shape and _rel(x.grad, _megatron_swiglu_back(g.double(), x64)) < 1e-6


def test_a_strided_input(kernel):
    """Rows whose stride is not twice the half width (a view of a wider buffer) are read where they are."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(7, 50, generator=gen)
    x = wide[:, :32].requires_grad_()
    assert x.stride(0) == 50
    y = kernel.swiglu(x)
    y.backward(torch.ones_like(y))
    assert _rel(y.detach(), _megatron_swiglu(x.detach().double())) < 1e-6
    assert _rel(x.grad, _megatron_swiglu_back(torch.ones(7, 16, dtype=torch.float64), x.detach().double())) < 1e-6


def test_no_tokens(kernel):
    x = torch.zeros(0, 8, requires_grad=True)
    y = kernel.swiglu(x)
    assert y.shape == (0, 4)
    y.sum().backward()
    assert x.grad.shape == (0, 8)


def test_an_odd_width_is_refused(kernel):
    with pytest.raises(ValueError, match="SwiGLU kernel"):
        kernel.swiglu(torch.zeros(4, 7))
