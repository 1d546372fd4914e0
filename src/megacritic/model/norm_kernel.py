"""RMSNorm of rows [tokens, hidden] in one Triton kernel each way, with the eager norm's arithmetic
(:func:`megacritic.model.layers._rms_norm`, as Llama / Qwen2): float32 statistics, the normalised value
rounded to the activations' dtype, then scaled by the weight and rounded once; the backward rounds where
eager's autograd does (the upstream gradient times the weight, each token's share of the weight gradient).

Why by hand: liger-kernel's RMSNorm backward, which ran here before, gives each of the GPU's SMs one program
that walks its ~120 rows of a 16k-token pack one row at a time, so few loads are in flight; at 0.5B it took
25.4 ms of an update against 4.5 ms for the forward (torch profiler on an H100, bench/NOTES.md, "Round 2,
seventh session"). Here a program owns a tile of ``TILE`` elements (whole rows: ``_blocks``), and a backward
program walks ``ROW_BLOCKS`` such tiles: every byte
is read and written once, and the weight gradient is summed per program into a float32 buffer and then over
programs, in an order fixed by the shape alone (no atomics: deterministic, whatever the GPU).

Imported only where it runs (CUDA, or the CPU under ``TRITON_INTERPRET=1`` in the tests), so that a CPU
install needs no Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# elements of a tile, tiles per backward program, warps: the fastest of eleven configurations at 1.5B and 3B
# (bench/kernel_probe.py --only norm, H100, bench/NOTES.md "ninth session"; software-pipelining the backward's
# loop did not help): a forward and backward over an update's packs 0.725 / 0.932 ms against 0.814 / 1.014
# at 8,192 elements and 8 warps
TILE, ROW_BLOCKS, NUM_WARPS = 4096, 4, 4


@triton.jit
def _add(a, b):
    # tl.sum's combine function, ours: Triton's interpreter (the tests) cannot call triton.language's own; not
    # qkv_kernel's, which the interpreted tests load as a module of its own
    return a + b


@triton.jit
def _rms_norm_forward(x, w, y, rstd, t, n, stride, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < t)[:, None] & (cols < n)[None, :]
    xs = tl.load(x + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.reduce(xs * xs, 1, _add) / n + eps)
    normed = (xs * r[:, None]).to(y.dtype.element_ty).to(tl.float32)
    ws = tl.load(w + cols, mask=cols < n, other=0.0).to(tl.float32)
    tl.store(y + rows[:, None] * n + cols[None, :], (normed * ws[None, :]).to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows, r, mask=rows < t)


@triton.jit
def _rms_norm_backward(dy, x, w, rstd, dx, dw_parts, t, n, stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       ROW_BLOCKS: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    ws = tl.load(w + cols, mask=cols < n, other=0.0).to(tl.float32)
    dw = tl.full([BLOCK_N], 0.0, tl.float32)
    for i in range(ROW_BLOCKS):
        rows = ((tl.program_id(0) * ROW_BLOCKS + i) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows < t)[:, None] & (cols < n)[None, :]
        g = tl.load(dy + rows[:, None] * n + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xs = tl.load(x + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd + rows, mask=rows < t, other=0.0)[:, None]
        # eager's autograd: the normalised value's gradient dy * w and each token's dy * normed are rounded
        m = (g * ws[None, :]).to(dx.dtype.element_ty).to(tl.float32)
        normed = (xs * r).to(dx.dtype.element_ty).to(tl.float32)
        dw += tl.reduce((g * normed).to(dx.dtype.element_ty).to(tl.float32), 0, _add)
        dot = tl.reduce(m * xs, 1, _add)[:, None]
        grad = r * m - r * (r * r) * (dot / n) * xs
        tl.store(dx + rows[:, None] * n + cols[None, :], grad.to(dx.dtype.element_ty), mask=mask)
    tl.store(dw_parts + tl.program_id(0) * n + cols, dw, mask=cols < n)


def _blocks(n: int) -> tuple[int, int]:
    block_n = triton.next_power_of_2(n)
    return max(1, TILE // block_n), block_n


class RMSNormFunction(torch.autograd.Function):
    """(x [t, n], weight [n] of x's dtype, eps) -> y [t, n]; gradients for x and weight."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dim() != 2 or weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
            raise ValueError(f"RMSNorm kernel: rows [t, n] and a weight [n] of their dtype, got {tuple(x.shape)} "
                             f"{x.dtype} and {tuple(weight.shape)} {weight.dtype}")
        x = x if x.stride(1) == 1 else x.contiguous()
        t, n = x.shape
        y = torch.empty(t, n, dtype=x.dtype, device=x.device)
        rstd = torch.empty(t, dtype=torch.float32, device=x.device)
        block_m, block_n = _blocks(n)
        if t:
            _rms_norm_forward[(triton.cdiv(t, block_m),)](x, weight, y, rstd, t, n, x.stride(0), eps,
                                                          BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        t, n = x.shape
        dy = dy.contiguous()
        dx = torch.empty(t, n, dtype=x.dtype, device=x.device)
        block_m, block_n = _blocks(n)
        programs = triton.cdiv(t, block_m * ROW_BLOCKS)
        parts = torch.empty(programs, n, dtype=torch.float32, device=x.device)
        if t:
            _rms_norm_backward[(programs,)](dy, x, weight, rstd, dx, parts, t, n, x.stride(0), BLOCK_M=block_m,
                                            BLOCK_N=block_n, ROW_BLOCKS=ROW_BLOCKS, num_warps=NUM_WARPS)
        return dx, parts.sum(0).to(weight.dtype), None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return RMSNormFunction.apply(x, weight, eps)
