"""The pack: the contract between micro-batching (:mod:`megacritic.packing.micro_batches`) and our attention
(:class:`megacritic.model.layers.CoreAttention`), and the geometry of a pack's length."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor


@dataclass
class Pack(PackedSeqParams):
    """A packed micro-batch: Megatron's boundaries (cu_seqlens, max_seqlen) and, set by
    :class:`megacritic.model.value_model.ValueModel` for its layers, each token's rotary cos / sin, which
    :class:`~megacritic.model.layers.FusedQKVSelfAttention` applies to queries and keys (positions restart at every rollout)."""

    rotary: tuple[Tensor, Tensor] | None = None  # cos, sin: [t, 1, d] in the activations' dtype


@dataclass
class ContextParallelPack(Pack):
    """A pack split over context-parallel ranks (:func:`megacritic.packing.micro_batches.context_parallel_split`).

    The inherited fields describe the whole pack (every rollout padded to a multiple of 2 x CP; RoPE reads
    ``max_seqlen_q``). This rank holds two chunks of every rollout, and each chunk attends to its rollout's
    keys up to the chunk's end. The fields below lay that out for one varlen call: query chunks in this
    rank's local pack, and each chunk's key prefix gathered into one key tensor.
    """

    chunk_cu_q: Tensor = None   # [c + 1] int32 boundaries of this rank's query chunks in its local pack
    chunk_cu_kv: Tensor = None  # [c + 1] int32 boundaries of each chunk's key prefix in kv_index
    kv_index: Tensor = None     # [sum of prefix lengths] long, rows of the rank-major gathered keys
    max_chunk_q: int = 0
    max_chunk_kv: int = 0


def round_up(n: int | Tensor, multiple: int) -> int | Tensor:
    return -(-n // multiple) * multiple


def rollout_spans(seq_lens: Tensor, cp_size: int) -> Tensor:
    """Each rollout's length in the pack: with context parallelism, padded by fillers after its real
    tokens to a multiple of 2 x CP (module doc)."""
    return round_up(seq_lens, 2 * cp_size) if cp_size > 1 else seq_lens


def pack_multiple(seq_multiple: int, cp_size: int) -> int:
    """A whole pack's length must be a multiple of this: 2 x CP equal chunks per rollout (the trailing
    dummy rollout included), and ``seq_multiple`` dividing each context-parallel rank's share."""
    if cp_size == 1:
        return seq_multiple
    return math.lcm(2 * cp_size, cp_size * seq_multiple)


def pack_length(seq_lens: Tensor, seq_multiple: int = 1, cp_size: int = 1) -> int:
    """Length of the whole pack of rollouts with these lengths (before a context-parallel split)."""
    return round_up(int(rollout_spans(seq_lens, cp_size).sum()), pack_multiple(seq_multiple, cp_size))
