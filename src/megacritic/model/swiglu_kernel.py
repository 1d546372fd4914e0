"""SwiGLU of a gated MLP's first projection, ``silu(a) * b`` for ``x = [a | b]`` (the two halves of the last
dimension, as Megatron's MLP lays out fc1), in one Triton kernel each way, with the arithmetic of Megatron's
compiled ``fused_bias_swiglu.swiglu`` / ``swiglu_back``: float32 inside, in their order of operations, one
rounding per output.

Why by hand: Megatron's compiled pair ran at ~2.4 TB/s on the H200 (a [16384, 2 x 8960] forward and backward
in 0.965 ms, bench/NOTES.md), about half of what the part's memory gives a plain copy; the activation moves
~140 KB per token and layer at 1.5B in an update, so its time is its bandwidth. A program here owns a
``BLOCK_M`` x ``BLOCK_N`` tile of the output and loads the matching tiles of both halves, coalesced.

Imported only where it runs (CUDA, or the CPU under ``TRITON_INTERPRET=1`` in the tests), so that a CPU
install needs no Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M, BLOCK_N, NUM_WARPS = 16, 256, 4  # rows and columns of a program's tile, warps: fixed


@triton.jit
def _sigmoid(x):
    # triton.language's sigmoid (and so the compiled Megatron kernels'), ours: Triton's interpreter (the tests)
    # cannot call triton.language's jit functions
    return 1 / (1 + tl.exp(-x))


@triton.jit
def _tile(t, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows[:, None], cols[None, :], (rows < t)[:, None] & (cols < n)[None, :]


@triton.jit
def _swiglu_forward(x, y, t, n, stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(t, n, BLOCK_M, BLOCK_N)
    a = tl.load(x + rows * stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x + rows * stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + rows * n + cols, (a * _sigmoid(a) * b).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward(g, x, dx, t, n, stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = _tile(t, n, BLOCK_M, BLOCK_N)
    grad = tl.load(g + rows * n + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(x + rows * stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x + rows * stride + n + cols, mask=mask, other=0.0).to(tl.float32)
    s = _sigmoid(a)
    # swiglu_back: (g * sigmoid(a) * (1 + a * (1 - sigmoid(a))) * b, g * silu(a)), left to right
    da = grad * s * (1.0 + a * (1.0 - s)) * b
    db = grad * (a * s)
    tl.store(dx + rows * (2 * n) + cols, da.to(dx.dtype.element_ty), mask=mask)
    tl.store(dx + rows * (2 * n) + n + cols, db.to(dx.dtype.element_ty), mask=mask)


def _grid(t: int, n: int) -> tuple[int, int]:
    return triton.cdiv(t, BLOCK_M), triton.cdiv(n, BLOCK_N)


class SwiGLUFunction(torch.autograd.Function):
    """x [..., 2n] -> silu(x[..., :n]) * x[..., n:] [..., n]; its gradient for x. Saves x for the backward
    (as Megatron's function does)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        if x.dim() < 1 or x.shape[-1] % 2:
            raise ValueError(f"SwiGLU kernel: the last dimension holds two halves, got shape {tuple(x.shape)}")
        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        t, n = rows.shape[0], rows.shape[1] // 2
        y = torch.empty(t, n, dtype=x.dtype, device=x.device)
        if t and n:
            _swiglu_forward[_grid(t, n)](rows, y, t, n, rows.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                         num_warps=NUM_WARPS)
        ctx.save_for_backward(rows)
        ctx.shape = x.shape
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (rows,) = ctx.saved_tensors
        t, n = rows.shape[0], rows.shape[1] // 2
        g = dy.reshape(t, n).contiguous()
        dx = torch.empty(t, 2 * n, dtype=rows.dtype, device=rows.device)
        if t and n:
            _swiglu_backward[_grid(t, n)](g, rows, dx, t, n, rows.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                          num_warps=NUM_WARPS)
        return dx.reshape(ctx.shape)


def swiglu(x: Tensor) -> Tensor:
    return SwiGLUFunction.apply(x)
