"""Context parallelism's split of a pack over CP ranks (Megatron's load-balanced layout for causal attention:
rank r holds chunks r and 2 x CP - 1 - r of every rollout; see :mod:`megacritic.packing.micro_batches`)."""

from __future__ import annotations

import torch
from torch import Tensor


def context_parallel_split(cu: Tensor, cp_size: int, cp_rank: int) -> tuple[Tensor, dict]:
    """Split a pack of rollouts (boundaries ``cu``, every length a multiple of 2 x CP) over CP ranks.

    Returns ``take``, the pack positions this rank holds in its local order (per rollout: chunk r, then
    chunk 2 x CP - 1 - r), and the attention layout of :class:`ContextParallelPack`: each local chunk
    is a query sequence whose keys are its rollout's tokens from the start up to the chunk's end, read
    from the rank-major concatenation of every rank's local keys.
    """
    bounds = cu.tolist()
    pieces = {}  # rank -> list of (rollout start, chunk offset, chunk length)
    for rank in range(cp_size):
        pieces[rank] = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            c = (end - start) // (2 * cp_size)
            assert c * 2 * cp_size == end - start, "rollout spans must be multiples of 2 x CP"
            pieces[rank] += [(start, rank * c, c), (start, (2 * cp_size - 1 - rank) * c, c)]

    def positions(rank):
        return torch.cat([torch.arange(s + o, s + o + c) for s, o, c in pieces[rank]])

    gathered = torch.cat([positions(rank) for rank in range(cp_size)])  # pack position of each gathered row
    row_of = torch.empty_like(gathered)
    row_of[gathered] = torch.arange(len(gathered))  # pack position -> row of the gathered keys
    mine = pieces[cp_rank]
    prefix = [o + c for _, o, c in mine]
    attention = dict(
        chunk_cu_q=_cumsum([c for _, _, c in mine]),
        chunk_cu_kv=_cumsum(prefix),
        kv_index=torch.cat([row_of[s: s + n] for (s, _, _), n in zip(mine, prefix)]),
        max_chunk_q=max(c for _, _, c in mine),
        max_chunk_kv=max(prefix),
    )
    return positions(cp_rank), attention


def _cumsum(lengths: list[int]) -> Tensor:
    return torch.tensor([0, *lengths], dtype=torch.long).cumsum(0).to(torch.int32)
