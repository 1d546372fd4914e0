"""Generalized Advantage Estimation exactly as verl computes it, to turn rewards into the critic's targets.

:func:`compute_gae` reproduces ``compute_gae_advantage_return`` of verl's ``verl/trainer/ppo/core_algos.py``
and the masked statistics of ``verl/utils/torch_functional.py`` (``masked_sum`` / ``masked_mean`` /
``masked_var`` / ``masked_whiten``), as they stand in current verl (read from volcengine/verl:
core_algos.py at commit 012be9d9dcb7c38499f23616142870d2682757fc, torch_functional.py at commit
33ddc71428da6e945cee80f6020dac4b59cb9c63; later verl makes ``masked_sum`` NaN-safe with ``torch.where``).

Masking convention (current verl, "skip values and TD-error on observation tokens"): the backward recursion
over the response *skips* positions whose mask is 0. At such a position ``nextvalues`` and ``lastgaelam``
are carried through unchanged, so a real token's next value is the value of the next *real* token (0 past
the last one) and padding or tool-observation tokens between real ones neither add a TD error nor break
the discounting (gamma and lambda are applied once per real token). Per column ``t``, from last to first::

    delta       = r[t] + gamma * nextvalues - v[t]
    lastgaelam_ = delta + gamma * lam * lastgaelam
    nextvalues  = v[t] * m[t] + (1 - m[t]) * nextvalues          # 0 before the loop
    lastgaelam  = lastgaelam_ * m[t] + (1 - m[t]) * lastgaelam    # 0 before the loop
    advantages[t] = lastgaelam

then ``returns = advantages + values`` (before whitening, on the reward's own scale), and the advantages
are whitened with the masked mean and the unbiased (Bessel-corrected) masked variance over *all* real
tokens of the batch: ``(A - mean) * rsqrt(var + 1e-8)``, ``mean = sum(A*m) / (sum(m) + 1e-8)``.

Older verl (before the skip was introduced) used ``nextvalues = values[:, t + 1]`` regardless of the
mask. For right-padded responses whose padding holds zero values and rewards (verl zeroes values outside
the response) both give the same result on real tokens; they differ only when padding holds non-zero
numbers or when the mask has holes, where the version here ignores the padding entirely.

Like verl, positions with mask 0 are *not* zeroed in the outputs: the advantage there is the carried
``lastgaelam`` (the advantage of the next real token, or 0 after the last one) whitened like the rest, and
the return is that plus the value at that position. Consumers mask them out (the critic's ``returns``
outside the response mask are ignored). The only departure from verl's arithmetic is that a non-finite
number at a masked position cannot leak into real positions (``torch.where`` instead of multiplying by a
0 mask; identical results for finite inputs), in the recursion as in verl's NaN-safe ``masked_sum``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megacritic.data.rollouts import BatchError

__all__ = ["compute_gae", "masked_mean", "masked_var", "masked_whiten"]


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """verl's ``masked_mean`` over all elements: ``sum(values where mask) / (sum(mask) + 1e-8)``."""
    total = (torch.where(mask.bool(), values, torch.zeros_like(values)) * mask).sum()
    return total / (mask.sum() + 1e-8)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """verl's ``masked_var``: masked mean of squared deviations, times n/(n-1) when ``unbiased``.

    Raises BatchError (a ValueError, as verl's) when fewer than two elements are selected and
    ``unbiased`` is set.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n == 0:
            raise BatchError("cannot whiten advantages: the response mask selects no token")
        if n == 1:
            raise BatchError("cannot whiten advantages: the response mask selects a single token "
                             "(the unbiased variance needs at least two)")
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """verl's ``masked_whiten``: ``(values - mean) * rsqrt(var + 1e-8)`` with masked, unbiased statistics;
    with ``shift_mean=False`` the mean is added back."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def compute_gae(token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float,
                lam: float) -> tuple[Tensor, Tensor]:
    """GAE advantages and value targets, exactly as verl's ``compute_gae_advantage_return``.

    Args:
        token_level_rewards: [B, R] reward of each response token (e.g. the score on the last token).
        values: [B, R] old values of the response tokens (``CriticWorker.compute_values``).
        response_mask: [B, R] 1 on real response tokens, 0 on padding (bool, int or float). Masked
            positions are skipped by the recursion (see the module docstring).
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both [B, R] in the dtype of ``values`` (promoted with the rewards').
        ``returns = advantages + values`` is computed before the advantages are whitened over the real
        tokens of the whole batch; ``returns`` is what ``update_critic`` takes as ``batch["returns"]``.

    Raises:
        BatchError: shapes differ or are not 2-D, the mask is not 0/1, or it selects fewer than two
            tokens in the whole batch (the unbiased variance of the whitening is then undefined; verl
            raises ValueError there, of which BatchError is a subclass).
    """
    if token_level_rewards.ndim != 2:
        raise BatchError(f"token_level_rewards must be [batch, response], got {tuple(token_level_rewards.shape)}")
    for name, x in (("values", values), ("response_mask", response_mask)):
        if x.shape != token_level_rewards.shape:
            raise BatchError(f"{name} has shape {tuple(x.shape)}, token_level_rewards has "
                             f"{tuple(token_level_rewards.shape)}")
    if token_level_rewards.shape[1] == 0:
        raise BatchError("token_level_rewards has no response column")
    if ((response_mask != 0) & (response_mask != 1)).any():
        raise BatchError("response_mask must hold only 0 and 1")
    dtype = torch.promote_types(values.dtype, token_level_rewards.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float32
    rewards, values = token_level_rewards.to(dtype), values.to(dtype)
    mask = response_mask.to(dtype)
    real = response_mask.bool()
    with torch.no_grad():
        zero = torch.zeros_like(values[:, 0])
        nextvalues, lastgaelam = zero, zero
        advantages_reversed = []
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_ = delta + gamma * lam * lastgaelam
            # skip values and TD errors of masked tokens: carry the running quantities through them
            nextvalues = torch.where(real[:, t], values[:, t], nextvalues)
            lastgaelam = torch.where(real[:, t], lastgaelam_, lastgaelam)
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        advantages = masked_whiten(advantages, mask)
    return advantages, returns
