"""Micro-batching: which rollouts go together (fixed count or token budget), and the tensors each
micro-batch feeds to the model and the loss.

A micro-batch holds whole rollouts with their padding removed, in one of two layouts:

* packed (the default): the rollouts' real tokens concatenated into one sequence [1, t], with
  ``cu_seqlens`` marking where each starts, so attention stays within a rollout and no token is padding.
  Megatron sees the pack as one ordinary [t, 1] sequence (``qkv_format="sbhd"``): only our attention
  reads the boundaries, and RoPE takes each token's position within its rollout from ``position_ids``
  in one gather (:class:`~megacritic.model.value_model.ValueModel`), instead of Megatron's THD path,
  which splits every layer's queries and keys per rollout and synchronises with the host to do so;
* padded: rollouts left-aligned and right-padded to the micro-batch's longest, [b, s]; causal attention
  needs no mask because padding only ever follows real tokens.

``value_index`` says where each response token's value is read in the flattened model output: the value
of response token j of a rollout with p prompt tokens is the output at its position p - 1 + j (the state
before the token), matching verl's ``values[:, -R-1:-1]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megacritic.batch import BatchError, Rollouts
from megacritic.partition import fixed_partitions, token_budget_partitions


@dataclass
class MicroBatch:
    input_ids: Tensor         # [b, s] padded, or [1, t] packed
    packed: PackedSeqParams | None  # rollout boundaries (cu_seqlens) when packed
    position_ids: Tensor | None  # [1, t] position of each packed token within its rollout (None: padded)
    value_index: Tensor       # [b, R] index of each response token's value in the flattened output
    value_mask: Tensor        # [b, R] 1 on real response tokens (0 on padding and dummy rows)
    values: Tensor | None     # [b, R] old values (training only)
    returns: Tensor | None    # [b, R]
    weights: Tensor | None    # [b, R] loss aggregation weights (megacritic.losses.token_weights)
    loss_mask: Tensor | None  # [b, R]
    rows: int                 # real rollouts in this micro-batch (the rest are dummy rows)
    padding_mask: Tensor      # shaped as input_ids: True on padding (MoE routers leave it out of their statistics)
    tokens: int               # real tokens


def plan_micro_batches(seq_lens: list[int], *, micro_batch_size: int | None, max_tokens: int | None,
                       multiple_of: int, max_over_ranks: Callable[[int], int]) -> list[list[int]]:
    """Partition rollouts (by index) into micro-batches: ``micro_batch_size`` rollouts each, or by a token
    budget of ``max_tokens`` with Karmarkar-Karp balancing. Every data-parallel rank must run the same
    number of micro-batches (``max_over_ranks`` is an all-reduce MAX over them), a multiple of
    ``multiple_of`` (the interleaved pipeline's group size)."""
    if max_tokens is None:
        parts = fixed_partitions(len(seq_lens), micro_batch_size)
        if len(parts) % multiple_of:
            raise BatchError(f"{len(seq_lens)} rollouts per rank in micro-batches of {micro_batch_size} make "
                             f"{len(parts)} micro-batches; the interleaved pipeline needs a multiple of "
                             f"{multiple_of} (ppo_micro_batch_size_per_gpu / forward_micro_batch_size_per_gpu)")
        return parts
    count = 1
    while True:
        agreed = max_over_ranks(count)
        try:
            parts = token_budget_partitions(seq_lens, max_tokens, min_parts=agreed, multiple_of=multiple_of)
        except ValueError as exc:
            raise BatchError(f"{exc} (ppo_max_token_len_per_gpu / forward_max_token_len_per_gpu)") from None
        count = len(parts)
        if max_over_ranks(count) == agreed:
            return parts


def build_micro_batch(rollouts: Rollouts, rows: list[int], *, packed: bool, seq_multiple: int = 1,
                      pad_to: tuple[int, int] | None = None, weights: Tensor | None = None,
                      device=None) -> MicroBatch:
    """Tensors of one micro-batch from ``rows`` of ``rollouts`` (see module doc).

    ``seq_multiple`` rounds the sequence (padded) or pack (packed) length up, as sequence parallelism needs
    a multiple of TP. ``pad_to`` = (rows, length) fixes the shape, for pipelines that need equal
    micro-batch shapes: extra rows are dummies, extra pack length a dummy trailing sequence.
    """
    sel = torch.tensor(rows, dtype=torch.long)
    p, r, lens = rollouts.prompt_lens[sel], rollouts.response_lens[sel], rollouts.seq_lens[sel]
    b, longest = len(rows), int(lens.max())
    positions = torch.arange(longest)
    # Left-align: token t of row i sits at column (prompt_width - p_i + t) of the verl layout.
    src = (rollouts.prompt_width - p)[:, None] + positions[None, :]
    real = positions[None, :] < lens[:, None]
    aligned = torch.where(real, rollouts.input_ids[sel].gather(1, src.clamp(max=rollouts.input_ids.shape[1] - 1)), 0)
    j = torch.arange(rollouts.response_width)
    # position within the rollout; past a rollout's end (masked) it is clamped to stay inside the rollout
    value_pos = torch.minimum(p[:, None] - 1 + j[None, :], (lens - 1)[:, None])
    value_mask = (j[None, :] < r[:, None]).to(torch.float32)
    packed_params = position_ids = None
    if packed:
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        total = round_up(int(starts[-1]), seq_multiple)
        if pad_to is not None:
            total = max(total, pad_to[1])
        ids = torch.zeros(1, total, dtype=torch.long)
        ids[0, : starts[-1]] = aligned[real]
        padding = torch.arange(total)[None, :] >= starts[-1]
        cu = starts if total == starts[-1] else torch.cat([starts, torch.tensor([total])])
        cu = cu.to(torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
        packed_params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu.to(device), cu_seqlens_kv=cu.to(device),
                                        max_seqlen_q=max_len, max_seqlen_kv=max_len)
        seq_lens = (cu[1:] - cu[:-1]).long()
        position_ids = torch.arange(total) - torch.repeat_interleave(cu[:-1].long(), seq_lens)
        position_ids = position_ids[None].to(device) if device is not None else position_ids[None]
        value_index = starts[:-1, None] + value_pos
    else:
        s = round_up(longest, seq_multiple)
        if pad_to is not None:
            b, s = max(b, pad_to[0]), max(s, pad_to[1])
        ids = torch.zeros(b, s, dtype=torch.long)
        ids[: len(rows), :longest] = aligned
        padding = torch.ones(b, s, dtype=torch.bool)
        padding[: len(rows), :longest] = ~real
        value_index = torch.arange(len(rows))[:, None] * s + value_pos

    def rows_of(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[sel]

    fields = dict(value_index=value_index, value_mask=value_mask, values=rows_of(rollouts.values),
                  returns=rows_of(rollouts.returns), weights=rows_of(weights),
                  loss_mask=rows_of(rollouts.response_mask) if weights is not None else None)
    extra = b - len(rows)  # dummy rows (padded layout with pad_to): they read position 0, with zero weight
    for key, x in fields.items():
        if x is None:
            continue
        if extra:
            x = torch.cat([x, x.new_zeros(extra, *x.shape[1:])])
        fields[key] = x.to(device) if device is not None else x
    if device is not None:
        ids, padding = ids.to(device), padding.to(device)
    return MicroBatch(input_ids=ids, packed=packed_params, position_ids=position_ids, rows=len(rows),
                      padding_mask=padding, tokens=int(lens.sum()), **fields)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
