"""The QKV projection's output to the attention's inputs in one Triton kernel each way: bias added, split
into heads and, for a packed micro-batch, queries and keys rotated (RoPE with halves rotated, as Llama /
Qwen2 and Megatron's unfused path), float32 inside and rounded once.

Why by hand: the same function compiled by torch.compile (one fused kernel, launch configs tuned) moved its
~122 MB per 1.5B pack at ~0.56 TB/s on an H100 (bench/NOTES.md, "Round 2, fourth session"): its
generated kernel walks the outputs and gathers each element's rotation partner from the interleaved
projection. Here a program owns one head slot of a block of tokens and loads the slot's two halves as two
coalesced tiles, so every byte is read and written once. The backward's bias gradient is summed per token
block into a float32 buffer and then over blocks, in a fixed order: deterministic, no atomics.

Layout: mixed [t, groups * (per_group + 2) * d], each group's ``per_group`` query heads, its key, its
value; q [t, groups * per_group, d], k / v [t, groups, d]; per-token cos / sin [t, 1, d].

Imported only where it runs (CUDA, or the CPU under ``TRITON_INTERPRET=1`` in the tests), so that a CPU
install needs no Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Tokens per program and warps: fixed (not autotuned), so the bias gradient's summation order is too.
BLOCK_T, NUM_WARPS = 64, 8


@triton.jit
def _add(a, b):
    # tl.sum's combine function, ours: the tests run these kernels in Triton's interpreter, loaded after
    # triton itself was imported without it, where triton.language's own jit functions cannot be called.
    return a + b


@triton.jit
def _slot(q, k, v, rows, cols, g, j, groups, PER_GROUP: tl.constexpr, D: tl.constexpr):
    """Where head slot j of group g lands for these rows: a query head of q, the group's k, or its v."""
    if j == PER_GROUP + 1:
        out = v + rows[:, None] * (groups * D) + g * D + cols[None, :]
    elif j == PER_GROUP:
        out = k + rows[:, None] * (groups * D) + g * D + cols[None, :]
    else:
        out = q + rows[:, None] * (groups * PER_GROUP * D) + (g * PER_GROUP + j) * D + cols[None, :]
    return out


@triton.jit
def _cos_sin(cos, sin, rows, cols, mask, rot_stride, HALF: tl.constexpr):
    """Both halves of these rows' cos and sin, float32."""
    r = rows[:, None] * rot_stride + cols[None, :]
    c1 = tl.load(cos + r, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos + r + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin + r, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin + r + HALF, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _qkv_split_forward(mixed, bias, cos, sin, q, k, v, t, mixed_stride, rot_stride,
             PER_GROUP: tl.constexpr, D: tl.constexpr, HALF_P2: tl.constexpr, HAS_BIAS: tl.constexpr,
             ROTATE: tl.constexpr, BLOCK: tl.constexpr):
    block, slot = tl.program_id(0), tl.program_id(1)  # slot: group * (PER_GROUP + 2) + head in group
    groups = tl.num_programs(1) // (PER_GROUP + 2)
    g, j = slot // (PER_GROUP + 2), slot % (PER_GROUP + 2)
    HALF: tl.constexpr = D // 2
    rows = (block * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = tl.arange(0, HALF_P2)  # a power of two: tl.arange's; the columns past HALF are masked
    mask = (rows < t)[:, None] & (cols < HALF)[None, :]
    src = mixed + rows[:, None] * mixed_stride + slot * D + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x1 += tl.load(bias + slot * D + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
        x2 += tl.load(bias + slot * D + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    dst = _slot(q, k, v, rows, cols, g, j, groups, PER_GROUP, D)
    y1, y2 = x1, x2
    if ROTATE:
        if j != PER_GROUP + 1:  # queries and the key; the value is not rotated
            c1, c2, s1, s2 = _cos_sin(cos, sin, rows, cols, mask, rot_stride, HALF)
            y1 = x1 * c1 - x2 * s1  # x * cos + cat(-x2, x1) * sin
            y2 = x2 * c2 + x1 * s2
    tl.store(dst, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_split_backward(dq, dk, dv, cos, sin, dmixed, dbias_blocks, t, rot_stride,
              PER_GROUP: tl.constexpr, D: tl.constexpr, HALF_P2: tl.constexpr, HAS_BIAS: tl.constexpr,
              ROTATE: tl.constexpr, BLOCK: tl.constexpr):
    block, slot = tl.program_id(0), tl.program_id(1)
    slots = tl.num_programs(1)
    groups = slots // (PER_GROUP + 2)
    g, j = slot // (PER_GROUP + 2), slot % (PER_GROUP + 2)
    HALF: tl.constexpr = D // 2
    rows = (block * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = tl.arange(0, HALF_P2)  # a power of two: tl.arange's; the columns past HALF are masked
    mask = (rows < t)[:, None] & (cols < HALF)[None, :]
    src = _slot(dq, dk, dv, rows, cols, g, j, groups, PER_GROUP, D)
    dx1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    dx2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        if j != PER_GROUP + 1:  # the transpose of the rotation above
            c1, c2, s1, s2 = _cos_sin(cos, sin, rows, cols, mask, rot_stride, HALF)
            g1, g2 = dx1, dx2
            dx1 = g1 * c1 + g2 * s2
            dx2 = g2 * c2 - g1 * s1
    dst = dmixed + rows[:, None] * (slots * D) + slot * D + cols[None, :]
    tl.store(dst, dx1.to(dmixed.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, dx2.to(dmixed.dtype.element_ty), mask=mask)
    if HAS_BIAS:  # this block's share of the bias gradient, float32, before the rounding of dmixed
        part = dbias_blocks + block * (slots * D) + slot * D + cols
        tl.store(part, tl.reduce(dx1, 0, _add), mask=cols < HALF)
        tl.store(part + HALF, tl.reduce(dx2, 0, _add), mask=cols < HALF)


def _check(mixed: Tensor, groups: int, d: int, rotary) -> tuple[int, int]:
    width = mixed.shape[1]
    if width % (groups * d) or width // (groups * d) < 3 or d % 2:
        raise ValueError(f"QKV output of width {width} does not split into {groups} groups of heads of size {d}")
    if rotary is not None and any(x.shape != (mixed.shape[0], 1, d) for x in rotary):
        raise ValueError(f"cos / sin must be [{mixed.shape[0]}, 1, {d}], got {[tuple(x.shape) for x in rotary]}")
    return mixed.shape[0], width // (groups * d) - 2


class SplitQKV(torch.autograd.Function):
    """(mixed, bias or None, cos or None, sin or None, groups, d) -> (q, k, v); gradients for mixed and bias."""

    @staticmethod
    def forward(ctx, mixed, bias, cos, sin, groups, d):
        rotary = None if cos is None else (cos, sin)
        t, per_group = _check(mixed, groups, d, rotary)
        mixed = mixed if mixed.stride(-1) == 1 else mixed.contiguous()
        cos, sin = (None, None) if rotary is None else (x.contiguous() for x in rotary)
        q = mixed.new_empty(t, groups * per_group, d)
        k, v = mixed.new_empty(t, groups, d), mixed.new_empty(t, groups, d)
        if t:
            _qkv_split_forward[(triton.cdiv(t, BLOCK_T), groups * (per_group + 2))](
                mixed, bias, cos, sin, q, k, v, t, mixed.stride(0), d,
                PER_GROUP=per_group, D=d, HALF_P2=triton.next_power_of_2(d // 2), HAS_BIAS=bias is not None,
                ROTATE=cos is not None, BLOCK=BLOCK_T, num_warps=NUM_WARPS)
        ctx.save_for_backward(cos, sin)
        ctx.layout = (t, groups, per_group, d, None if bias is None else bias.dtype, mixed.dtype)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        t, groups, per_group, d, bias_dtype, dtype = ctx.layout
        slots = groups * (per_group + 2)
        dq, dk, dv = (x.contiguous() for x in (dq, dk, dv))
        dmixed = dq.new_empty(t, slots * d, dtype=dtype)
        blocks = triton.cdiv(t, BLOCK_T)
        dbias = None if bias_dtype is None else torch.empty(blocks, slots * d, dtype=torch.float32, device=dq.device)
        if t:
            _qkv_split_backward[(blocks, slots)](
                dq, dk, dv, cos, sin, dmixed, dbias, t, d,
                PER_GROUP=per_group, D=d, HALF_P2=triton.next_power_of_2(d // 2), HAS_BIAS=dbias is not None,
                ROTATE=cos is not None, BLOCK=BLOCK_T, num_warps=NUM_WARPS)
        if dbias is not None:
            dbias = dbias.sum(0).to(bias_dtype) if t else torch.zeros(slots * d, dtype=bias_dtype, device=dq.device)
        return dmixed, dbias, None, None, None, None


def split_qkv(mixed: Tensor, bias: Tensor | None, groups: int, d: int,
              rotary: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """mixed [t, groups * (per_group + 2) * d] -> contiguous q [t, groups * per_group, d], k / v [t, groups, d]."""
    cos, sin = rotary if rotary is not None else (None, None)
    return SplitQKV.apply(mixed, bias, cos, sin, groups, d)
