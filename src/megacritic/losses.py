"""The clipped value loss, with normalisation over the whole mini-batch, and the metrics of a step.

verl divides each micro-batch's loss by that micro-batch's own token (or sequence) count and Megatron then
averages micro-batches, so the loss and its gradient change with micro-batching and the data-parallel
layout. Here the aggregation weight of every response token is computed once from the *whole* mini-batch
(:func:`token_weights`), before it is split over data-parallel ranks and micro-batches; a micro-batch's
loss is then the plain weighted sum of its tokens' terms, and the sum over micro-batches and ranks
(Megatron run with ``calculate_per_token_loss`` and no DP averaging) is exactly the mini-batch aggregate.

Metrics are carried as sums (:data:`STAT_KEYS`) in float64, added over micro-batches and ranks once per
step, and turned into means only at the end (:func:`metrics_from_sums`).
"""

from __future__ import annotations

import torch
from torch import Tensor

STAT_KEYS = ("loss", "tokens", "clipped", "vpred", "ret", "ret_sq", "err", "err_sq")


def token_weights(response_mask: Tensor, mode: str, horizon: float | None = None) -> Tensor:
    """Aggregation weight of each response token over a whole mini-batch [B, R] (0 on masked tokens).

    ``sum(weights * loss_mat)`` equals verl's ``agg_loss(loss_mat, response_mask, mode)`` on the full
    mini-batch: token-mean divides the token sum by the mini-batch's tokens, token-sum is the plain sum of
    the token losses, seq-mean-token-sum / seq-mean-token-mean average each sequence's token sum / mean over
    the sequences with response tokens, and seq-mean-token-sum-norm divides each sequence's token sum by
    ``horizon`` (verl's loss_scale_factor; default: the response width R) and averages over sequences.
    """
    mask = response_mask.to(torch.float64)
    tokens_per_seq = mask.sum(-1, keepdim=True)
    valid_seqs = (tokens_per_seq > 0).sum().clamp(min=1)
    if mode == "token-mean":
        weights = mask / mask.sum().clamp(min=1)
    elif mode == "token-sum":
        weights = mask
    elif mode == "seq-mean-token-sum":
        weights = mask / valid_seqs
    elif mode == "seq-mean-token-mean":
        weights = mask / (tokens_per_seq.clamp(min=1) * valid_seqs)
    elif mode == "seq-mean-token-sum-norm":
        weights = mask / ((horizon or mask.shape[-1]) * valid_seqs)
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    return weights


def clipped_value_loss(vpreds: Tensor, values: Tensor, returns: Tensor, cliprange_value: float):
    """Per-token PPO value loss ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)`` and clip indicator."""
    # clamp(V, lo, hi) returns V itself inside the range, so an unclipped token never counts as clipped
    # through rounding (values + clamp(V - values) would not be bit-exact).
    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpreds_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped)


def value_loss_and_stats(vpreds: Tensor, values: Tensor, returns: Tensor, weights: Tensor, mask: Tensor,
                         cliprange_value: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss contribution of one micro-batch (a weighted sum) and its metric sums (detached, float64)."""
    loss_mat, was_clipped = clipped_value_loss(vpreds, values, returns, cliprange_value)
    loss = (loss_mat * weights.to(loss_mat.dtype)).sum()
    with torch.no_grad():
        m = mask.to(torch.float64)
        v, r = vpreds.detach().to(torch.float64), returns.to(torch.float64)
        err = r - v
        stats = {
            "loss": loss.detach().to(torch.float64),
            "tokens": m.sum(),
            "clipped": (was_clipped * m).sum(),
            "vpred": (v * m).sum(),
            "ret": (r * m).sum(),
            "ret_sq": (r * r * m).sum(),
            "err": (err * m).sum(),
            "err_sq": (err * err * m).sum(),
        }
    return loss, stats


def stack_stats(stats: list[dict[str, Tensor]], device) -> Tensor:
    """Sum per-micro-batch stat dicts into one float64 vector ordered as STAT_KEYS."""
    total = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=device)
    for s in stats:
        total += torch.stack([s[k] for k in STAT_KEYS]).to(device)
    return total


def metrics_from_sums(sums: Tensor) -> dict[str, float]:
    """verl's critic metrics (plus explained variance) from summed stats over a mini-batch."""
    s = dict(zip(STAT_KEYS, sums.tolist()))
    n = max(s["tokens"], 1.0)
    ret_var = s["ret_sq"] / n - (s["ret"] / n) ** 2
    err_var = s["err_sq"] / n - (s["err"] / n) ** 2
    return {
        "critic/vf_loss": s["loss"],
        "critic/vf_clipfrac": s["clipped"] / n,
        "critic/vpred_mean": s["vpred"] / n,
        "critic/vf_explained_var": 1.0 - err_var / ret_var if ret_var > 1e-12 else float("nan"),
        "critic/response_tokens": s["tokens"],
    }


def step_metrics(sums: Tensor, *, grad_norm: float, lr: float, skipped: bool, empty: bool, tokens: int,
                 seconds: float, data_seconds: float, timers: dict[str, float],
                 moe_aux_loss: float | None = None) -> dict[str, float]:
    """The metrics of one optimizer step (verl's names), taken or not.

    ``sums``: the step's STAT_KEYS sums over the whole mini-batch; ``skipped``: the step was not applied for
    a non-finite loss or gradient; ``empty``: the mini-batch had no response token, so no step was taken
    (its explained variance is reported as 0, its time as 0: nothing ran); ``tokens``: the mini-batch's real
    tokens; ``timers``: the timing_s/* seconds of Megatron's timers.
    """
    metrics = metrics_from_sums(sums)
    if empty:
        metrics["critic/vf_explained_var"] = 0.0
    metrics.update({
        "critic/grad_norm": float(grad_norm),
        "critic/lr": float(lr),
        "critic/skipped_steps": float(skipped),
        "critic/empty_steps": float(empty),
        "perf/real_tokens": float(tokens),
        "perf/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "timing_s/step": float(seconds),
        "timing_s/data": float(data_seconds),
    })
    metrics.update(timers)
    if moe_aux_loss is not None:
        metrics["critic/moe_aux_loss"] = moe_aux_loss
    return metrics
