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

Context parallelism (CP > 1, packed only) splits every rollout of the pack into 2 x CP equal chunks; rank r
holds chunks r and 2 x CP - 1 - r (Megatron's load-balanced layout for causal attention: every rank gets
one early, cheap chunk and one late, expensive one). Each rollout is first padded to a multiple of 2 x CP
with filler tokens after its real ones rather than cut into ragged chunks: causal attention never lets a
real token see a later filler token, so real tokens stay exact, fillers carry no value or loss, and equal
chunks keep every rank's local pack the same length (which the all-gather of keys and sequence
parallelism need). A rank reads the values only at the positions it holds: ``value_mask``, ``weights``
and ``loss_mask`` are zero elsewhere, so sums over the context-parallel group count every token once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from megacritic.data.rollouts import BatchError, Rollouts
from megacritic.packing.context_parallel import context_parallel_split
from megacritic.packing.pack import ContextParallelPack, Pack, pack_length, pack_multiple, rollout_spans, round_up
from megacritic.packing.partition import fixed_partitions, token_budget_partitions


def to_device(x: Tensor, device) -> Tensor:
    """A host tensor on ``device`` (None: where it is) without making the host wait for the GPU: a copy
    from pageable memory blocks until the device's queue has drained (bench/NOTES.md: 10 such waits per
    micro-batch), so on a GPU the tensor goes through pinned memory (the caching host allocator's, which keeps
    the buffer until the copy has run) with an asynchronous copy."""
    if device is None:
        return x
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


@dataclass
class MicroBatch:
    input_ids: Tensor         # [b, s] padded, or [1, t] packed (this rank's t / CP with context parallelism)
    packed: Pack | None  # rollout boundaries (cu_seqlens) when packed
    position_ids: Tensor | None  # [1, t] position of each packed token within its rollout (None: padded)
    value_index: Tensor       # [b, R] index of each response token's value in this rank's flattened output
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
                      device=None, cp_size: int = 1, cp_rank: int = 0, sequence_slots: int | None = None) -> MicroBatch:
    """Tensors of one micro-batch from ``rows`` of ``rollouts`` (see module doc).

    ``seq_multiple`` rounds the sequence (padded) or this rank's pack (packed) length up, as sequence
    parallelism needs a multiple of TP. ``pad_to`` = (rows, length) fixes the shape, for pipelines that
    need equal micro-batch shapes: extra rows are dummies, extra pack length a dummy trailing sequence
    (length: of the whole pack, before a context-parallel split). ``cp_size`` > 1 (packed only): this
    context-parallel rank's share of the pack (module doc). ``sequence_slots`` (packed): give the pack's
    boundaries this many sequences where it has fewer, the extra ones empty at its end (the fixed shape of
    a pack replayed by a CUDA graph).
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
    owned = None
    if packed:
        spans = rollout_spans(lens, cp_size)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), spans.cumsum(0)])
        multiple = pack_multiple(seq_multiple, cp_size)
        total = round_up(int(starts[-1]), multiple)
        if pad_to is not None:
            total = max(total, round_up(pad_to[1], multiple))
        ids = torch.zeros(total, dtype=torch.long)
        placed = (starts[:-1, None] + positions[None, :])[real]
        ids[placed] = aligned[real]
        padding = torch.ones(total, dtype=torch.bool)
        padding[placed] = False
        cu = starts if total == starts[-1] else torch.cat([starts, torch.tensor([total])])
        if sequence_slots is not None and len(cu) - 1 < sequence_slots:
            cu = torch.cat([cu, cu[-1:].expand(sequence_slots - (len(cu) - 1))])
        seq_lens = cu[1:] - cu[:-1]
        position_ids = torch.arange(total) - torch.repeat_interleave(cu[:-1], seq_lens)
        value_index = starts[:-1, None] + value_pos
        max_len = int(seq_lens.max())
        cu32 = to_device(cu.to(torch.int32), device)
        pack = dict(qkv_format="sbhd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32, max_seqlen_q=max_len,
                    max_seqlen_kv=max_len)
        if cp_size > 1:
            take, attention = context_parallel_split(cu, cp_size, cp_rank)
            local = torch.full((total,), -1, dtype=torch.long)
            local[take] = torch.arange(len(take))
            ids, position_ids, padding = ids[take], position_ids[take], padding[take]
            owned = local[value_index] >= 0
            value_index = local[value_index].clamp(min=0)
            packed_params = ContextParallelPack(**pack, **{k: to_device(v, device) if torch.is_tensor(v) else v
                                                          for k, v in attention.items()})
        else:
            packed_params = Pack(**pack)
        ids, padding = ids[None], padding[None]
        position_ids = to_device(position_ids[None], device)
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

    weights, loss_mask = rows_of(weights), rows_of(rollouts.response_mask) if weights is not None else None
    if owned is not None:  # a context-parallel rank counts only the values at positions it holds
        value_mask = value_mask * owned
        weights, loss_mask = (None if x is None else x * owned for x in (weights, loss_mask))
    fields = dict(value_index=value_index, value_mask=value_mask, values=rows_of(rollouts.values),
                  returns=rows_of(rollouts.returns), weights=weights, loss_mask=loss_mask)
    extra = b - len(rows)  # dummy rows (padded layout with pad_to): they read position 0, with zero weight
    for key, x in fields.items():
        if x is None:
            continue
        if extra:
            x = torch.cat([x, x.new_zeros(extra, *x.shape[1:])])
        fields[key] = to_device(x, device)
    ids, padding = to_device(ids, device), to_device(padding, device)
    return MicroBatch(input_ids=ids, packed=packed_params, position_ids=position_ids, rows=len(rows),
                      padding_mask=padding, tokens=int(lens.sum()), **fields)


@dataclass(frozen=True)
class MicroBatchSizing:
    """How the rollouts of one rank are cut into micro-batches: ``size`` rollouts each, or a token budget of
    ``max_tokens`` per micro-batch (exactly one of them is set)."""

    size: int | None
    max_tokens: int | None


@dataclass(frozen=True)
class MicroBatchPolicy:
    """The micro-batching of a run, derived once from the config and the parallel layout: the sizing of
    training and of forward-only calls, the layout of a micro-batch, and the shape constraints of the
    pipeline (module doc)."""

    train: MicroBatchSizing
    forward: MicroBatchSizing
    packed: bool         # model.use_remove_padding
    seq_multiple: int    # sequence parallelism: a multiple of TP per sequence (or per rank's pack)
    multiple_of: int     # micro-batches per call: a multiple of this (the interleaved pipeline's group)
    cp: int              # context-parallel ranks sharing each micro-batch
    fixed_shape: bool    # every micro-batch of a call padded to one shape (the PP=2 + VPP pipeline)
    graph_slots: int | None = None  # model.cuda_graphs: packs of this many sequences ...
    graph_multiple: int = 1         # ... padded to a multiple of this many tokens (at most the budget)

    @classmethod
    def from_config(cls, config, layout) -> "MicroBatchPolicy":
        """``config``: a CriticConfig; ``layout``: its :class:`~megacritic.parallel.ParallelLayout`."""
        if config.use_dynamic_bsz:
            # As in verl: the budget is per GPU, and a micro-batch is shared by the CP ranks.
            train = MicroBatchSizing(None, config.ppo_max_token_len_per_gpu * layout.cp)
            forward = MicroBatchSizing(
                None, (config.forward_max_token_len_per_gpu or config.ppo_max_token_len_per_gpu) * layout.cp)
        else:
            train = MicroBatchSizing(config.ppo_micro_batch_size_per_gpu, None)
            forward = MicroBatchSizing(config.forward_micro_batch_size_per_gpu or config.ppo_micro_batch_size_per_gpu,
                                       None)
        graphs = config.model.cuda_graphs
        return cls(train=train, forward=forward, packed=config.model.use_remove_padding,
                   seq_multiple=layout.seq_multiple, multiple_of=layout.micro_batch_multiple, cp=layout.cp,
                   fixed_shape=layout.fixed_micro_batch_shape,
                   graph_slots=config.model.cuda_graph_max_rollouts + 1 if graphs else None,
                   graph_multiple=config.model.cuda_graph_pack_multiple)

    def plan(self, seq_lens: Tensor, forward_only: bool, max_over_ranks: Callable[[int], int]) -> list[list[int]]:
        """This rank's micro-batches (rollout indices), the same count on every data-parallel rank."""
        sizing = self.forward if forward_only else self.train
        if sizing.size is not None and len(seq_lens) % sizing.size:
            # compute_values' batches are the caller's; a training mini-batch's split is checked by the config
            raise BatchError(f"{len(seq_lens)} rollouts per data-parallel rank are not a multiple of the "
                             f"micro-batch size {sizing.size}")
        return plan_micro_batches(seq_lens.tolist(), micro_batch_size=sizing.size, max_tokens=sizing.max_tokens,
                                  multiple_of=self.multiple_of, max_over_ranks=max_over_ranks)

    def pad_to(self, seq_lens: Tensor, parts: list[list[int]]) -> tuple[int, int] | None:
        """The one shape of every micro-batch of a call, where the pipeline needs it (None: free shapes)."""
        if not self.fixed_shape:
            return None
        if self.packed:
            return 1, max(pack_length(seq_lens[p], self.seq_multiple, self.cp) for p in parts)
        return max(len(p) for p in parts), round_up(int(seq_lens.max()), self.seq_multiple)

    def build(self, rollouts: Rollouts, parts: list[list[int]], *, weights: Tensor | None, device,
              cp_rank: int, forward_only: bool = False) -> list[MicroBatch]:
        """The micro-batches of ``parts`` of ``rollouts``, on ``device``."""
        pad_to = [self.pad_to(rollouts.seq_lens, parts)] * len(parts)
        if self.graph_slots is not None:
            # a pack with more rollouts than the graphs' slots runs eagerly, at its own length
            pad_to = [(1, self.graph_length(int(rollouts.seq_lens[p].sum()), forward_only))
                      if len(p) < self.graph_slots else None for p in parts]
        return [build_micro_batch(rollouts, p, packed=self.packed, seq_multiple=self.seq_multiple, pad_to=shape,
                                  weights=weights, device=device, cp_size=self.cp, cp_rank=cp_rank,
                                  sequence_slots=self.graph_slots) for p, shape in zip(parts, pad_to)]

    def graph_lengths(self, forward_only: bool) -> list[int]:
        """model.cuda_graphs: every length a pack can be padded to."""
        budget = (self.forward if forward_only else self.train).max_tokens
        return sorted({self.graph_length(n, forward_only) for n in range(self.graph_multiple, budget + 1,
                                                                          self.graph_multiple)} | {budget})

    def graph_length(self, tokens: int, forward_only: bool) -> int:
        """model.cuda_graphs: the length a pack of ``tokens`` real tokens is padded to (validation: packed, by
        token budget, no pipeline, no context or sequence parallelism)."""
        budget = (self.forward if forward_only else self.train).max_tokens
        return max(tokens, min(round_up(tokens, self.graph_multiple), budget))
