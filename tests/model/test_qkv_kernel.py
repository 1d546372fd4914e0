"""megacritic.model.qkv_kernel, the Triton kernels of FusedQKVSelfAttention's fused split, run on the CPU by
Triton's interpreter (``TRITON_INTERPRET=1``) against the eager split (Megatron's arithmetic) in float64:
the same programs, block shapes and index arithmetic as on the GPU, in float32. The interpreter's casts to
bf16 truncate instead of rounding, so bf16 (one rounding of the float32 result) is checked on the GPU, where
tests/test_gpu.py runs the compiled kernels."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import megacritic.model
from megacritic.model import layers

pytest.importorskip("triton")


@pytest.fixture
def kernel(monkeypatch):
    """The kernel module as the interpreter runs it (``triton.jit`` reads TRITON_INTERPRET when it wraps a
    function), loaded apart and put where ``split_qkv(fused=True)`` imports it from."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = megacritic.model.__path__[0] + "/qkv_kernel.py"
    spec = importlib.util.spec_from_file_location("megacritic.model.qkv_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(__import__("sys").modules, "megacritic.model.qkv_kernel", module)
    monkeypatch.setattr(megacritic.model, "qkv_kernel", module, raising=False)
    return module


def _rotary(lens, d, dtype):
    inv = 1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    pos = torch.cat([torch.arange(n, dtype=torch.float64) for n in lens])
    freqs = torch.outer(pos, inv).repeat(1, 2)[:, None, :]  # [t, 1, d]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(lens, groups, per_group, d, dtype, bias, rotate, seed=0):
    """Fused (interpreted kernels) and float64 eager outputs and gradients for one random problem."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    mixed = torch.randn(t, groups * (per_group + 2) * d, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(mixed.shape[1], generator=gen).to(dtype).requires_grad_() if bias else None
    rotary = _rotary(lens, d, dtype) if rotate else None
    outs = layers.split_qkv(mixed, b, groups, d, rotary, fused=True)
    md = mixed.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_() if bias else None
    refs = layers.split_qkv(md, bd, groups, d, tuple(x.double() for x in rotary) if rotate else None)
    grads = [torch.randn(x.shape, generator=gen).to(dtype) for x in outs]
    torch.autograd.backward(list(outs), grads)
    torch.autograd.backward(list(refs), [g.double() for g in grads])
    got = [x.detach() for x in outs] + [mixed.grad] + ([b.grad] if bias else [])
    want = [x.detach() for x in refs] + [md.grad] + ([bd.grad] if bias else [])
    return got, want


@pytest.mark.parametrize("rotate,bias", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("groups,per_group,d", [(2, 3, 16), (1, 1, 8), (3, 2, 12)])
def test_split_kernels_match_megatrons_split_in_float64(kernel, rotate, bias, groups, per_group, d):
    """Outputs, the projection's gradient and the bias gradient in float32, within float32 rounding of the
    float64 split. Token counts that do not fill the last block of tokens; a head dim whose half is not a
    power of two (12)."""
    lens = [70, 1, 3 * kernel.BLOCK_T + 5]
    got, want = _run(lens, groups, per_group, d, torch.float32, bias, rotate)
    shapes = [(sum(lens), groups * per_group, d), (sum(lens), groups, d), (sum(lens), groups, d)]
    assert [tuple(x.shape) for x in got[:3]] == shapes and all(x.is_contiguous() for x in got[:3])
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert _rel(g, w) < 1e-6


def test_head_slots_land_in_their_outputs(kernel):
    """Without bias or rotation the kernel is a pure relayout: each group's query heads, key and value are
    exactly the projection's columns in Megatron's interleaved order."""
    t, groups, per_group, d = 9, 2, 3, 8
    mixed = torch.arange(t * groups * (per_group + 2) * d, dtype=torch.float32).view(t, -1)
    q, k, v = layers.split_qkv(mixed, None, groups, d, None, fused=True)
    x = mixed.view(t, groups, per_group + 2, d)
    assert torch.equal(q, x[:, :, :per_group].reshape(t, groups * per_group, d))
    assert torch.equal(k, x[:, :, per_group]) and torch.equal(v, x[:, :, per_group + 1])


def test_no_tokens(kernel):
    mixed = torch.zeros(0, 2 * 4 * 8, requires_grad=True)
    bias = torch.zeros(2 * 4 * 8, requires_grad=True)
    q, k, v = layers.split_qkv(mixed, bias, 2, 8, (torch.ones(0, 1, 8), torch.zeros(0, 1, 8)), fused=True)
    assert q.shape == (0, 4, 8) and k.shape == v.shape == (0, 2, 8)
    (q.sum() + k.sum() + v.sum()).backward()
    assert torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize("width,rotary_len", [(2 * 4 * 8 + 1, 5), (2 * 4 * 8, 4)])
def test_mismatched_layout_is_refused(kernel, width, rotary_len):
    mixed = torch.zeros(5, width)
    with pytest.raises(ValueError, match="does not split|cos / sin"):
        layers.split_qkv(mixed, None, 2, 8, _rotary([rotary_len], 8, torch.float32), fused=True)


def test_bias_gradient_is_summed_in_a_fixed_order(kernel):
    """Two backward passes over the same problem give the same bits (no atomics): what
    megatron.full_determinism and the CUDA graphs' replay-equals-eager test rely on on the GPU."""
    a, _ = _run([300], 2, 2, 16, torch.float32, bias=True, rotate=True, seed=5)
    b, _ = _run([300], 2, 2, 16, torch.float32, bias=True, rotate=True, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert math.isfinite(a[-1].sum().item())
