"""Rollout batches: accept verl's layout, check it, and split it into mini-batches and DP shards.

A batch is a ``tensordict.TensorDict`` or any object with ``.batch`` (TensorDict) and ``.meta_info``
(verl's ``DataProto``). Keys (B rollouts, T = prompt + response width, R = response width):
``input_ids``, ``attention_mask``, ``position_ids`` [B, T], ``responses`` [B, R]; for updates also
``values`` and ``returns`` [B, R]; optionally ``response_mask`` [B, R] (the loss mask; defaults to the
response part of ``attention_mask``). Prompts are left-padded, responses right-padded.

verl 0.9's no-padding layout (``left_right_2_no_padding``) is accepted too: ``input_ids`` and
``position_ids`` as jagged ``torch.nested`` tensors holding only the real tokens of each rollout, the
other keys still padded. ``attention_mask`` [B, T] must be present (verl keeps it) to say where each
rollout's prompt ends; the batch then describes the same :class:`Rollouts` as its padded form.

Every rank passes the same global batch; each data-parallel rank takes its own shard, balanced by tokens
(:func:`dp_shards`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from tensordict import TensorDict
from torch import Tensor

from megacritic.packing.partition import karmarkar_karp_equal


class BatchError(ValueError):
    """A batch does not have the keys, shapes or layout the critic needs; nothing was changed."""


@dataclass
class Rollouts:
    """A checked rollout batch. Real tokens of row i: ``prompt_lens[i]`` prompt then ``response_lens[i]``
    response tokens, contiguous, ending at column ``prompt_width + response_lens[i]``."""

    input_ids: Tensor        # [B, T] long
    prompt_lens: Tensor      # [B] long, real prompt tokens (>= 1)
    response_lens: Tensor    # [B] long, real response tokens
    response_mask: Tensor    # [B, R] float, loss mask
    values: Tensor | None    # [B, R] float32, values from compute_values (old values)
    returns: Tensor | None   # [B, R] float32

    @property
    def response_width(self) -> int:
        return self.response_mask.shape[1]

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.response_width

    @property
    def seq_lens(self) -> Tensor:
        return self.prompt_lens + self.response_lens

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: Tensor) -> "Rollouts":
        return replace(self, **{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                                for f in fields(self)})

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def to_tensordict(data) -> TensorDict:
    if isinstance(data, TensorDict):
        return data
    batch = getattr(data, "batch", None)
    if isinstance(batch, TensorDict):
        return batch
    raise BatchError(f"expected a TensorDict or an object with a .batch TensorDict (verl DataProto), "
                     f"got {type(data).__name__}")


def verl_batch(tokens: Tensor, prompt_lens: Tensor, response_lens: Tensor, prompt_width: int, pad_id: int = 0,
               **per_response_token: Tensor) -> TensorDict:
    """The one builder of verl's padded layout: rollout i has ``prompt_lens[i]`` prompt tokens ending at column
    ``prompt_width`` (left-padded) and ``response_lens[i]`` response tokens from there (right-padded) in the
    [B, T] grid ``tokens``, whose other entries are replaced by ``pad_id``. ``per_response_token``: [B, R]
    tensors added as they are (``returns``, ``values``, ``token_level_rewards`` ...)."""
    cols = torch.arange(tokens.shape[1])
    attention_mask = ((cols[None, :] >= (prompt_width - prompt_lens)[:, None])
                      & (cols[None, :] < (prompt_width + response_lens)[:, None])).long()
    input_ids = torch.where(attention_mask.bool(), tokens, torch.full_like(tokens, pad_id))
    return TensorDict({"input_ids": input_ids,
                       "attention_mask": attention_mask,
                       "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
                       "responses": input_ids[:, prompt_width:].clone(),
                       "response_mask": attention_mask[:, prompt_width:].to(torch.float32),
                       **per_response_token}, batch_size=[tokens.shape[0]])


def _rows(bad: Tensor, limit: int = 8) -> str:
    rows = bad.nonzero().flatten().tolist()
    more = f" (and {len(rows) - limit} more)" if len(rows) > limit else ""
    return f"{rows[:limit]}{more}"


def _monotone(mask: Tensor, increasing: bool) -> Tensor:
    """Rows of a boolean mask that are not all-False-then-all-True (increasing) or all-True-then-all-False."""
    before, after = mask[:, :-1].view(torch.int8), mask[:, 1:].view(torch.int8)  # (int8 compares faster than bool)
    return (before > after).any(1) if increasing else (before < after).any(1)


def _is_nested(x) -> bool:
    return isinstance(x, Tensor) and x.is_nested


def _unpadded_tensors(td: TensorDict) -> dict[str, Tensor]:
    """verl 0.9's no-padding layout turned back into the padded one: each rollout's real tokens (and
    positions) placed where ``attention_mask`` has its 1s. Every check of the padded layout then applies."""
    input_ids = td["input_ids"]
    if "attention_mask" not in td.keys() or _is_nested(td["attention_mask"]):
        raise BatchError("input_ids is a nested (no-padding) tensor: the batch also needs the padded "
                         "attention_mask [batch, prompt+response] (verl's left_right_2_no_padding keeps it) to "
                         "say where each rollout's prompt ends")
    for key in ("position_ids", "responses"):
        if key not in td.keys():
            raise BatchError(f"batch is missing key {key!r}; it has {sorted(td.keys())}")
    attention_mask, responses, positions = td["attention_mask"], td["responses"], td["position_ids"]
    if attention_mask.ndim != 2 or input_ids.dim() != 2 or input_ids.size(0) != attention_mask.shape[0]:
        raise BatchError(f"nested input_ids holds {input_ids.size(0)} rollouts; attention_mask must be "
                         f"[{input_ids.size(0)}, prompt+response], got {tuple(attention_mask.shape)}")
    if not _is_nested(positions) or positions.dim() != 2:
        raise BatchError("with nested input_ids, position_ids must be nested the same way (one position per real "
                         "token; 3-D multimodal positions are not supported)")
    b, t = attention_mask.shape
    if responses.ndim != 2 or responses.shape[0] != b or not 0 < responses.shape[1] < t:
        raise BatchError(f"responses has shape {tuple(responses.shape)}; expected [{b}, R] with 0 < R < {t}")
    bad = ((attention_mask != 0) & (attention_mask != 1)).any(1)
    if bad.any():
        raise BatchError(f"attention_mask must be 0/1; rows {_rows(bad)}")
    real = attention_mask.bool()
    for key, x in (("input_ids", input_ids), ("position_ids", positions)):
        lens = x.offsets().diff()
        bad = lens != real.sum(1)
        if bad.any():
            raise BatchError(f"{key} (nested) rows {_rows(bad)} hold {lens[bad].tolist()[:8]} tokens where "
                             f"attention_mask counts {real.sum(1)[bad].tolist()[:8]}")
    r = responses.shape[1]
    ids = torch.zeros((b, t), dtype=input_ids.dtype)
    ids[:, t - r:] = responses.to(ids.dtype)  # padding columns as in the padded layout
    if "prompts" in td.keys() and not _is_nested(td["prompts"]) and tuple(td["prompts"].shape) == (b, t - r):
        ids[:, : t - r] = td["prompts"].to(ids.dtype)
    ids[real] = input_ids.values().to(ids.dtype)
    pos = (attention_mask.to(torch.int64).cumsum(1) - 1).clamp(min=0)
    pos[real] = positions.values().to(torch.int64)
    out = {"input_ids": ids, "position_ids": pos}
    for key in ("response_mask", "values", "returns"):
        if key in td.keys() and _is_nested(td[key]):
            out[key] = td[key].to_padded_tensor(0.0, output_size=(b, r))
    return out


def check_batch(data, need_targets: bool, vocab_size: int | None, max_positions: int | None,
                mini_batch_size: int | None = None) -> Rollouts:
    """Every check of a batch that needs no collective (what a driver can refuse before sending it anywhere):
    :func:`rollouts_from_batch`, the model's position limit, and with ``mini_batch_size`` that the batch splits
    into whole mini-batches."""
    rollouts = rollouts_from_batch(data, need_targets, vocab_size=vocab_size)
    if mini_batch_size is not None:
        check_mini_batches(len(rollouts), mini_batch_size)
    too_long = rollouts.seq_lens > max_positions if max_positions is not None else None
    if too_long is not None and too_long.any():
        raise BatchError(f"attention_mask: rollouts {_rows(too_long)} have {int(rollouts.seq_lens.max())} real tokens, "
                         f"more than the model's {max_positions} positions (model.max_position_embeddings)")
    return rollouts


def rollouts_from_batch(data, need_targets: bool, vocab_size: int | None = None) -> Rollouts:
    """Check a verl-layout batch (padded, or verl 0.9's no-padding one) and describe it as :class:`Rollouts`;
    raises BatchError naming the key."""
    td = to_tensordict(data)
    if "input_ids" in td.keys() and _is_nested(td["input_ids"]):
        td = TensorDict({k: td[k] for k in ("attention_mask", "responses", "response_mask", "values", "returns")
                         if k in td.keys()} | _unpadded_tensors(td), batch_size=td.batch_size[:1])
    required = ["input_ids", "attention_mask", "position_ids", "responses"]
    if need_targets:
        required += ["values", "returns"]
    missing = [k for k in required if k not in td.keys()]
    if missing:
        raise BatchError(f"batch is missing key(s) {missing}; it has {sorted(td.keys())}")
    input_ids, attention_mask, position_ids, responses = (td[k] for k in required[:4])
    if input_ids.ndim != 2 or input_ids.shape[0] == 0:
        raise BatchError(f"input_ids must be [batch, prompt+response] with batch >= 1, got {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise BatchError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    b, t = input_ids.shape
    for key in ("attention_mask", "position_ids"):
        if tuple(td[key].shape) != (b, t):
            raise BatchError(f"{key} has shape {tuple(td[key].shape)}, input_ids has {(b, t)}")
    if responses.ndim != 2 or responses.shape[0] != b or not 0 < responses.shape[1] < t:
        raise BatchError(f"responses has shape {tuple(responses.shape)}; expected [{b}, R] with 0 < R < {t}")
    r = responses.shape[1]
    p = t - r
    # The checks run on the host before every call, over [batch, prompt + response] tensors: they work on a
    # 1-byte copy of the mask, a pass or two each.
    real = attention_mask.bool()
    bad = (attention_mask != real).any(1)  # an entry other than 0 and 1
    if bad.any():
        raise BatchError(f"attention_mask must be 0/1; rows {_rows(bad)}")
    prompt_mask, resp_mask_attn = real[:, :p], real[:, p:]
    bad = _monotone(prompt_mask, increasing=True)
    if bad.any():
        raise BatchError(f"attention_mask: prompts must be left-padded (0s then 1s); rows {_rows(bad)}")
    bad = _monotone(resp_mask_attn, increasing=False)
    if bad.any():
        raise BatchError(f"attention_mask: responses must be right-padded (1s then 0s); rows {_rows(bad)}")
    prompt_lens, response_lens = prompt_mask.sum(1), resp_mask_attn.sum(1)
    if (prompt_lens == 0).any():
        raise BatchError(f"attention_mask: every rollout needs at least one prompt token; empty prompts in rows "
                         f"{_rows(prompt_lens == 0)}")
    if not torch.equal(input_ids[:, p:], responses.to(input_ids.dtype)):
        raise BatchError("responses must equal the last R columns of input_ids")
    # Rotary positions restart at 0 on each rollout's first real token (verl's left-padded layout). The real
    # tokens of row i are one span (checked above) starting at column p - prompt_lens[i].
    first = (p - prompt_lens)[:, None]
    counted = torch.arange(t, device=real.device)[None, :] - first
    bad = (position_ids.to(torch.int64) != counted).logical_and_(real).any(1)
    if bad.any():
        raise BatchError(f"position_ids must count real tokens from 0 (cumsum(attention_mask) - 1); rows {_rows(bad)}")
    if vocab_size is not None:
        bad = input_ids.aminmax(dim=1)
        bad = (bad.min < 0) | (bad.max >= vocab_size)
        if bad.any():
            raise BatchError(f"input_ids: token ids outside the vocabulary [0, {vocab_size}) in rows {_rows(bad)}")

    if "response_mask" in td.keys():
        response_mask = td["response_mask"].to(torch.float32)
        if tuple(response_mask.shape) != (b, r):
            raise BatchError(f"response_mask has shape {tuple(response_mask.shape)}, expected {(b, r)}")
        if (response_mask != 0).logical_and_(~resp_mask_attn).any():
            raise BatchError("response_mask marks tokens that attention_mask says are padding")
    else:
        response_mask = resp_mask_attn.to(torch.float32)

    values = returns = None
    if need_targets:
        values, returns = td["values"], td["returns"]
        for key, x in (("values", values), ("returns", returns)):
            if tuple(x.shape) != (b, r):
                raise BatchError(f"{key} has shape {tuple(x.shape)}, expected [batch, response] = {(b, r)}")
            if not x.is_floating_point():
                raise BatchError(f"{key} must be floating point, got {x.dtype}")
        on_response = response_mask > 0
        values, returns = (torch.where(on_response, x, 0).to(torch.float32) for x in (values, returns))
        for key, x in (("values", values), ("returns", returns)):
            # a row holds a NaN / inf on a response token iff its sum does (in float64 no float32 sum overflows)
            bad = ~torch.isfinite(x.sum(1, dtype=torch.float64))
            if bad.any():
                raise BatchError(f"{key} has NaN/inf (or a value beyond float32's range) on response tokens in "
                                 f"rows {_rows(bad)}")
    return Rollouts(input_ids=input_ids.to(torch.int64), prompt_lens=prompt_lens, response_lens=response_lens,
                    response_mask=response_mask, values=values, returns=returns)


def nested_token_values(values: Tensor, rollouts: Rollouts) -> Tensor:
    """Response values [B, R] in verl 0.9's no-padding layout: a jagged [B, prompt+response] tensor of each
    rollout's real tokens, where token ``P_b - 1 + i`` holds the value of response token i of rollout b (the
    output at the token before it, which verl's ``no_padding_2_padding`` reads back) and the rest are 0."""
    lens, p, r = rollouts.seq_lens, rollouts.prompt_lens, rollouts.response_lens
    offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    flat = torch.zeros(int(offsets[-1]), dtype=values.dtype)
    cols = torch.arange(values.shape[1])
    inside = cols[None, :] < r[:, None]
    flat[(offsets[:-1, None] + p[:, None] - 1 + cols[None, :])[inside]] = values[inside]
    return torch.nested.nested_tensor_from_jagged(flat, offsets=offsets)


def check_mini_batches(n: int, mini_batch_size: int) -> None:
    if n % mini_batch_size:
        raise BatchError(f"batch of {n} rollouts is not a multiple of ppo_mini_batch_size ({mini_batch_size})")


def mini_batch_indices(n: int, mini_batch_size: int, epochs: int, shuffle: bool, seed: int | None,
                       call_index: int = 0) -> list[Tensor]:
    """Row indices of each mini-batch, epoch after epoch; a fresh seeded permutation per epoch.

    ``call_index`` (the number of earlier update calls) varies the shuffle from one call to the next
    while keeping it reproducible.
    """
    check_mini_batches(n, mini_batch_size)
    out = []
    for epoch in range(epochs):
        order = seeded_permutation(n, seed, call_index=call_index, epoch=epoch) if shuffle else torch.arange(n)
        out.extend(order.split(mini_batch_size))
    return out


def seeded_permutation(n: int, seed: int, *, call_index: int = 0, epoch: int = 0) -> Tensor:
    """The permutation of ``range(n)`` that every shuffle of megacritic draws: the same on every rank, call
    and machine for the same (seed, call_index, epoch)."""
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(call_index) * 1009 + int(epoch))
    return torch.randperm(n, generator=gen)


def dp_shards(seq_lens: Tensor, dp_size: int, unit: int = 1) -> list[Tensor]:
    """Rows of each data-parallel rank: equal counts, balanced by real tokens (Karmarkar-Karp with equal
    cardinality), so that no rank waits for another in the gradient reduction. Deterministic: the same on
    every rank. Rows computed shard by shard go back to input order with ``reverse_index(shards)``.

    ``unit``: rows are dealt in whole groups of ``unit`` consecutive rows, kept together and in order. With
    fixed-size micro-batches the groups are the micro-batches one process would form, so every layout runs
    the same micro-batches: the value loss does not depend on them (its weights are computed over the whole
    mini-batch), but the MoE routers' load-balancing loss is computed per micro-batch.
    """
    n = len(seq_lens)
    if n % (dp_size * unit):
        per = f" in groups of {unit} (the micro-batch size)" if unit > 1 else ""
        raise BatchError(f"{n} rollouts cannot be split evenly over {dp_size} data-parallel ranks{per}")
    if dp_size == 1:
        return [torch.arange(n)]
    group_tokens = seq_lens.reshape(-1, unit).sum(1)
    return [(torch.tensor(p, dtype=torch.long)[:, None] * unit + torch.arange(unit)).flatten()
            for p in karmarkar_karp_equal(group_tokens.tolist(), dp_size)]
