"""Micro-batching: which rollouts go together (fixed count or token budget), and the tensors each
micro-batch feeds to the model and the loss.

A micro-batch holds whole rollouts, left-aligned (the prompt's left padding removed) and right-padded to
the micro-batch's longest sequence, so causal attention needs no mask and no token is wasted on another
row's prompt padding. ``value_index`` says where each response token's value is read: the value of
response token j of a rollout with p prompt tokens is the model output at position p - 1 + j (the state
before the token), matching verl's ``values[:, -R-1:-1]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from megacritic.batch import BatchError, Rollouts
from megacritic.partition import fixed_partitions, token_budget_partitions


@dataclass
class MicroBatch:
    input_ids: Tensor         # [b, s]
    value_index: Tensor       # [b, R] position of each response token's value in the output
    value_mask: Tensor        # [b, R] 1 on real response tokens (0 on padding and dummy rows)
    values: Tensor | None     # [b, R] old values (training only)
    returns: Tensor | None    # [b, R]
    weights: Tensor | None    # [b, R] loss aggregation weights (megacritic.losses.token_weights)
    loss_mask: Tensor | None  # [b, R]
    rows: int                 # real rollouts in this micro-batch (the rest are dummy rows)

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


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


def build_micro_batch(rollouts: Rollouts, rows: list[int], *, seq_multiple: int = 1,
                      pad_to: tuple[int, int] | None = None, weights: Tensor | None = None,
                      device=None) -> MicroBatch:
    """Tensors of one micro-batch from ``rows`` of ``rollouts`` (see module doc). ``pad_to`` = (rows,
    length) pads to a fixed shape with dummy rows, for pipelines that need equal micro-batch shapes."""
    sel = torch.tensor(rows, dtype=torch.long)
    p, r, lens = rollouts.prompt_lens[sel], rollouts.response_lens[sel], rollouts.seq_lens[sel]
    s = int(lens.max())
    s = -(-s // seq_multiple) * seq_multiple
    b = len(rows)
    if pad_to is not None:
        b, s = max(b, pad_to[0]), max(s, pad_to[1])
    positions = torch.arange(s)
    # Left-align: token t of row i sits at column (prompt_width - p_i + t) of the padded input.
    src = (rollouts.prompt_width - p)[:, None] + positions[None, :]
    real = positions[None, :] < lens[:, None]
    ids = torch.where(real, rollouts.input_ids[sel].gather(1, src.clamp(max=rollouts.input_ids.shape[1] - 1)), 0)
    j = torch.arange(rollouts.response_width)
    value_index = (p[:, None] - 1 + j[None, :]).clamp(max=s - 1)
    value_mask = (j[None, :] < r[:, None]).to(torch.float32)

    def rows_of(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[sel]

    fields = dict(input_ids=ids, value_index=value_index, value_mask=value_mask,
                  values=rows_of(rollouts.values), returns=rows_of(rollouts.returns),
                  weights=rows_of(weights), loss_mask=rows_of(rollouts.response_mask) if weights is not None else None)
    extra = b - len(rows)
    for key, x in fields.items():
        if x is None:
            continue
        if extra:
            x = torch.cat([x, x.new_zeros(extra, *x.shape[1:])])
        fields[key] = x.to(device) if device is not None else x
    return MicroBatch(rows=len(rows), **fields)
