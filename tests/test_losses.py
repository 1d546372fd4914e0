"""Tests for megacritic.losses: mini-batch-wide loss weights, the clipped value loss, and metrics."""

import math

import pytest
import torch

from megacritic.losses import (
    STAT_KEYS,
    clipped_value_loss,
    metrics_from_sums,
    stack_stats,
    step_metrics,
    token_weights,
    value_loss_and_stats,
)

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# ---------------------------------------------------------------- reference implementation

def ref_agg_loss(loss_mat, mask, mode, horizon=None):
    """Plain-loop reference of verl's agg_loss semantics over the full batch (as specified for megacritic:
    sequence means run over sequences that have at least one token; a batch without tokens gives 0)."""
    loss_mat = loss_mat.to(torch.float64).tolist()
    mask = mask.to(torch.float64).tolist()
    width = len(mask[0])
    if mode == "token-mean":
        num = sum(l * m for lr, mr in zip(loss_mat, mask) for l, m in zip(lr, mr))
        den = sum(m for mr in mask for m in mr)
        return num / den if den else 0.0
    if mode == "token-sum":  # verl 0.9: the sum of the token losses over the whole (global) batch
        return sum(l * m for lr, mr in zip(loss_mat, mask) for l, m in zip(lr, mr))
    per_seq = []
    for lr, mr in zip(loss_mat, mask):
        n_tok = sum(mr)
        if n_tok == 0:
            continue
        tok_sum = sum(l * m for l, m in zip(lr, mr))
        if mode == "seq-mean-token-sum":
            per_seq.append(tok_sum)
        elif mode == "seq-mean-token-mean":
            per_seq.append(tok_sum / n_tok)
        elif mode == "seq-mean-token-sum-norm":
            per_seq.append(tok_sum / (horizon if horizon is not None else width))
        else:
            raise ValueError(mode)
    return sum(per_seq) / len(per_seq) if per_seq else 0.0


def right_padded_mask(gen, b, r, allow_empty=True):
    lens = torch.randint(0 if allow_empty else 1, r + 1, (b,), generator=gen)
    return (torch.arange(r)[None, :] < lens[:, None]).to(torch.float32)


def random_mask(gen, b, r, density=0.6):
    return (torch.rand(b, r, generator=gen) < density).to(torch.float32)


def random_groups(gen, n):
    """Random permutation of 0..n-1 cut into random non-empty contiguous groups."""
    perm = torch.randperm(n, generator=gen)
    cuts = sorted(set(torch.randint(1, n, (torch.randint(0, n, (1,), generator=gen).item(),),
                                    generator=gen).tolist())) if n > 1 else []
    bounds = [0, *cuts, n]
    return [perm[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


# ---------------------------------------------------------------- token_weights

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_kind", ["right_padded", "random"])
def test_token_weights_match_reference(mode, mask_kind):
    gen = torch.Generator().manual_seed(1234)
    for trial in range(20):
        b, r = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 12, (1,), generator=gen))
        mask = right_padded_mask(gen, b, r) if mask_kind == "right_padded" else random_mask(gen, b, r)
        if trial % 4 == 0 and b > 1:
            mask[0] = 0  # make sure a fully-masked row is present
        loss_mat = torch.randn(b, r, generator=gen, dtype=torch.float64) * 3
        w = token_weights(mask, mode)
        assert w.shape == (b, r)
        assert w.dtype == torch.float64
        assert torch.all(w[mask == 0] == 0)
        assert torch.all(w >= 0)
        got = float((w * loss_mat).sum())
        assert got == pytest.approx(ref_agg_loss(loss_mat, mask, mode), rel=1e-12, abs=1e-12)


def test_token_weights_bool_and_float_masks_agree():
    gen = torch.Generator().manual_seed(5)
    mask = random_mask(gen, 6, 7)
    for mode in MODES:
        assert torch.equal(token_weights(mask, mode), token_weights(mask.bool(), mode))


@pytest.mark.parametrize("horizon", [None, 5, 16, 100, 2.5])
def test_token_weights_seq_mean_token_sum_norm_horizon(horizon):
    gen = torch.Generator().manual_seed(7)
    mask = right_padded_mask(gen, 7, 10)
    mask[2] = 0
    loss_mat = torch.randn(7, 10, generator=gen, dtype=torch.float64)
    w = token_weights(mask, "seq-mean-token-sum-norm", horizon=horizon)
    ref = ref_agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", horizon=horizon)
    assert float((w * loss_mat).sum()) == pytest.approx(ref, rel=1e-12, abs=1e-12)
    # The default horizon is the response width R.
    if horizon is None:
        explicit = token_weights(mask, "seq-mean-token-sum-norm", horizon=10)
        assert torch.equal(w, explicit)


def test_token_weights_hand_computed():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0],
                         [1.0, 0.0, 0.0, 0.0],
                         [0.0, 0.0, 0.0, 0.0]])
    # token-mean: 4 tokens
    assert torch.allclose(token_weights(mask, "token-mean"), mask.double() / 4)
    # token-sum: every response token weighs 1
    assert torch.equal(token_weights(mask, "token-sum"), mask.double())
    # seq-mean-token-sum: 2 valid sequences
    assert torch.allclose(token_weights(mask, "seq-mean-token-sum"), mask.double() / 2)
    # seq-mean-token-mean: row 0 -> 1/(3*2), row 1 -> 1/(1*2)
    expected = torch.tensor([[1 / 6, 1 / 6, 1 / 6, 0], [1 / 2, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    assert torch.allclose(token_weights(mask, "seq-mean-token-mean"), expected, rtol=0, atol=1e-15)
    # seq-mean-token-sum-norm: 1 / (R=4 * 2 valid sequences)
    assert torch.allclose(token_weights(mask, "seq-mean-token-sum-norm"), mask.double() / 8)
    assert torch.allclose(token_weights(mask, "seq-mean-token-sum-norm", horizon=3), mask.double() / 6)


def test_token_weights_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        token_weights(torch.ones(2, 3), "seq-mean")


@pytest.mark.parametrize("mode", MODES)
def test_token_weights_all_masked(mode):
    w = token_weights(torch.zeros(3, 5), mode)
    assert torch.equal(w, torch.zeros(3, 5, dtype=torch.float64))


# ---------------------------------------------------------------- layout invariance

def _random_problem(gen, b, r, dtype=torch.float64):
    mask = right_padded_mask(gen, b, r)
    mask[0] = 0
    values = torch.randn(b, r, generator=gen, dtype=dtype)
    returns = torch.randn(b, r, generator=gen, dtype=dtype)
    vpreds = values + 0.5 * torch.randn(b, r, generator=gen, dtype=dtype)  # some clipped, some not
    return mask, vpreds, values, returns


@pytest.mark.parametrize("mode", MODES)
def test_loss_is_layout_invariant(mode):
    gen = torch.Generator().manual_seed(99)
    clip = 0.2
    for _ in range(10):
        b, r = 13, 9
        mask, vpreds, values, returns = _random_problem(gen, b, r)
        weights = token_weights(mask, mode)

        v_full = vpreds.clone().requires_grad_(True)
        full_loss, full_stats = value_loss_and_stats(v_full, values, returns, weights, mask, clip)
        full_loss.backward()

        # The full-batch loss is verl's aggregate of the clipped loss matrix.
        loss_mat, _ = clipped_value_loss(vpreds, values, returns, clip)
        assert float(full_loss) == pytest.approx(ref_agg_loss(loss_mat, mask, mode), rel=1e-12, abs=1e-12)

        v_split = vpreds.clone().requires_grad_(True)
        total = torch.zeros((), dtype=torch.float64)
        stats = []
        for rows in random_groups(gen, b):
            loss, s = value_loss_and_stats(v_split[rows], values[rows], returns[rows], weights[rows],
                                           mask[rows], clip)
            total = total + loss
            stats.append(s)
        total.backward()

        assert float(total) == pytest.approx(float(full_loss), rel=1e-12, abs=1e-12)
        assert torch.allclose(v_split.grad, v_full.grad, rtol=1e-12, atol=1e-14)
        summed = stack_stats(stats, "cpu")
        expected = stack_stats([full_stats], "cpu")
        assert summed.dtype == torch.float64
        assert torch.allclose(summed, expected, rtol=1e-12, atol=1e-12)
        for key in STAT_KEYS:
            assert sum(float(s[key]) for s in stats) == pytest.approx(float(full_stats[key]), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_loss_is_layout_invariant_float32(mode):
    gen = torch.Generator().manual_seed(3)
    mask, vpreds, values, returns = _random_problem(gen, 16, 12, dtype=torch.float32)
    weights = token_weights(mask, mode)
    full, _ = value_loss_and_stats(vpreds, values, returns, weights, mask, 0.3)
    assert full.dtype == torch.float32
    parts = sum(value_loss_and_stats(vpreds[g], values[g], returns[g], weights[g], mask[g], 0.3)[0]
                for g in random_groups(gen, 16))
    loss_mat, _ = clipped_value_loss(vpreds.double(), values.double(), returns.double(), 0.3)
    ref = ref_agg_loss(loss_mat, mask, mode)
    assert float(full) == pytest.approx(ref, rel=1e-6, abs=1e-6)
    assert float(parts) == pytest.approx(float(full), rel=1e-6, abs=1e-6)


# ---------------------------------------------------------------- clipped_value_loss

def test_clipped_value_loss_no_clipping_inside_range():
    vpreds = torch.tensor([1.0, -0.3, 0.05], dtype=torch.float64)
    values = torch.tensor([0.9, -0.2, 0.0], dtype=torch.float64)
    returns = torch.tensor([0.5, 1.0, -2.0], dtype=torch.float64)
    loss, clipped = clipped_value_loss(vpreds, values, returns, 0.2)
    assert torch.allclose(loss, 0.5 * (vpreds - returns) ** 2, rtol=0, atol=1e-15)
    assert not clipped.any()
    assert clipped.dtype == torch.bool


def test_clipped_value_loss_clipped_term_dominates():
    # V=2, V_old=1, eps=0.5 -> clip(V)=1.5; R=3: unclipped (2-3)^2=1, clipped (1.5-3)^2=2.25.
    vpreds = torch.tensor([2.0, -2.0], dtype=torch.float64, requires_grad=True)
    values = torch.tensor([1.0, -1.0], dtype=torch.float64)
    returns = torch.tensor([3.0, -3.0], dtype=torch.float64)
    loss, clipped = clipped_value_loss(vpreds, values, returns, 0.5)
    assert torch.allclose(loss, torch.tensor([1.125, 1.125], dtype=torch.float64), rtol=0, atol=1e-15)
    assert clipped.tolist() == [True, True]
    # The clipped term dominates and V is outside [V_old - eps, V_old + eps]: no gradient reaches V.
    loss.sum().backward()
    assert torch.equal(vpreds.grad, torch.zeros(2, dtype=torch.float64))


def test_clipped_value_loss_unclipped_term_dominates_outside_range():
    # V=2, V_old=1, eps=0.5, R=1: unclipped (2-1)^2=1 beats clipped (1.5-1)^2=0.25 -> loss 0.5, grad V-R=1.
    vpreds = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
    loss, clipped = clipped_value_loss(vpreds, torch.tensor([1.0], dtype=torch.float64),
                                       torch.tensor([1.0], dtype=torch.float64), 0.5)
    assert float(loss) == pytest.approx(0.5, abs=1e-15)
    assert not clipped.item()
    loss.sum().backward()
    assert float(vpreds.grad) == pytest.approx(1.0, abs=1e-15)


def test_clipped_value_loss_gradient_inside_range():
    vpreds = torch.tensor([1.1], dtype=torch.float64, requires_grad=True)
    loss, _ = clipped_value_loss(vpreds, torch.tensor([1.0], dtype=torch.float64),
                                 torch.tensor([0.0], dtype=torch.float64), 0.5)
    loss.sum().backward()
    assert float(vpreds.grad) == pytest.approx(1.1, abs=1e-15)


def test_clipped_value_loss_random_against_formula():
    gen = torch.Generator().manual_seed(11)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        v = torch.randn(50, generator=gen).to(dtype)
        old = torch.randn(50, generator=gen).to(dtype)
        ret = torch.randn(50, generator=gen).to(dtype)
        eps = 0.25
        loss, clipped = clipped_value_loss(v, old, ret, eps)
        vc = torch.clamp(v, old - eps, old + eps)
        l1, l2 = (v - ret) ** 2, (vc - ret) ** 2
        assert torch.allclose(loss, 0.5 * torch.maximum(l1, l2), rtol=tol, atol=tol)
        assert torch.equal(clipped, l2 > l1)


# ---------------------------------------------------------------- metrics

def _direct_metrics(vpreds, values, returns, mask, clip):
    m = mask.bool()
    v, r = vpreds[m].double(), returns[m].double()
    _, was_clipped = clipped_value_loss(vpreds, values, returns, clip)
    err = r - v
    return {
        "critic/vf_clipfrac": was_clipped[m].double().mean().item(),
        "critic/vpred_mean": v.mean().item(),
        "critic/vf_explained_var": (1 - err.var(unbiased=False) / r.var(unbiased=False)).item(),
        "critic/response_tokens": float(m.sum()),
    }


def test_metrics_from_sums_match_direct_computation():
    gen = torch.Generator().manual_seed(21)
    for _ in range(5):
        mask, vpreds, values, returns = _random_problem(gen, 10, 8)
        weights = token_weights(mask, "token-mean")
        loss, stats = value_loss_and_stats(vpreds, values, returns, weights, mask, 0.2)
        metrics = metrics_from_sums(stack_stats([stats], "cpu"))
        direct = _direct_metrics(vpreds, values, returns, mask, 0.2)
        assert metrics["critic/vf_loss"] == pytest.approx(float(loss), rel=1e-12)
        for key, val in direct.items():
            assert metrics[key] == pytest.approx(val, rel=1e-10, abs=1e-12), key
        assert 0.0 <= metrics["critic/vf_clipfrac"] <= 1.0


def test_metrics_explained_var_is_one_for_perfect_predictions():
    returns = torch.tensor([[1.0, 2.0, 3.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    _, stats = value_loss_and_stats(returns.clone(), returns, returns, token_weights(mask, "token-mean"), mask, 0.2)
    metrics = metrics_from_sums(stack_stats([stats], "cpu"))
    assert metrics["critic/vf_explained_var"] == pytest.approx(1.0, abs=1e-12)
    assert metrics["critic/vpred_mean"] == pytest.approx(2.0, abs=1e-12)
    assert metrics["critic/vf_loss"] == 0.0


def test_metrics_explained_var_nan_for_constant_returns():
    gen = torch.Generator().manual_seed(2)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    returns = torch.full((2, 4), 0.7, dtype=torch.float64)
    returns[mask == 0] = 5.0  # varies only on masked tokens
    vpreds = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    _, stats = value_loss_and_stats(vpreds, vpreds.clone(), returns, token_weights(mask, "token-mean"), mask, 0.2)
    metrics = metrics_from_sums(stack_stats([stats], "cpu"))
    assert math.isnan(metrics["critic/vf_explained_var"])
    assert math.isfinite(metrics["critic/vpred_mean"])


def test_masked_tokens_do_not_affect_metrics_or_loss():
    gen = torch.Generator().manual_seed(8)
    mask, vpreds, values, returns = _random_problem(gen, 9, 7)
    masked = mask == 0
    garbage = lambda x: torch.where(masked, 1e6 * torch.randn(x.shape, generator=gen, dtype=x.dtype), x)
    for mode in MODES:
        w = token_weights(mask, mode)
        clean_loss, clean = value_loss_and_stats(vpreds * mask, values * mask, returns * mask, w, mask, 0.2)
        dirty_loss, dirty = value_loss_and_stats(garbage(vpreds), garbage(values), garbage(returns), w, mask, 0.2)
        assert float(dirty_loss) == pytest.approx(float(clean_loss), rel=1e-12, abs=1e-15)
        m_clean = metrics_from_sums(stack_stats([clean], "cpu"))
        m_dirty = metrics_from_sums(stack_stats([dirty], "cpu"))
        for key in m_clean:
            assert m_dirty[key] == pytest.approx(m_clean[key], rel=1e-12, abs=1e-15), key


def test_all_masked_batch_gives_zero_loss_and_no_nan():
    gen = torch.Generator().manual_seed(4)
    mask = torch.zeros(4, 6)
    for dtype in (torch.float64, torch.float32):
        vpreds = torch.randn(4, 6, generator=gen).to(dtype).requires_grad_(True)
        values = torch.randn(4, 6, generator=gen).to(dtype)
        returns = torch.randn(4, 6, generator=gen).to(dtype)
        for mode in MODES:
            vpreds.grad = None
            loss, stats = value_loss_and_stats(vpreds, values, returns, token_weights(mask, mode), mask, 0.2)
            loss.backward()
            assert float(loss) == 0.0
            assert torch.equal(vpreds.grad, torch.zeros_like(vpreds))
            assert all(math.isfinite(float(v)) for v in stats.values())
            metrics = metrics_from_sums(stack_stats([stats], "cpu"))
            assert metrics["critic/vf_loss"] == 0.0
            assert metrics["critic/vf_clipfrac"] == 0.0
            assert metrics["critic/vpred_mean"] == 0.0
            assert metrics["critic/response_tokens"] == 0.0
            # No tokens -> no return variance -> explained variance is undefined (reported as nan).
            assert math.isnan(metrics["critic/vf_explained_var"])


def test_stack_stats_order_and_sum():
    s1 = {k: torch.tensor(float(i), dtype=torch.float64) for i, k in enumerate(STAT_KEYS)}
    s2 = {k: torch.tensor(10.0 * i, dtype=torch.float64) for i, k in enumerate(STAT_KEYS)}
    total = stack_stats([s1, s2], "cpu")
    assert total.tolist() == [11.0 * i for i in range(len(STAT_KEYS))]
    assert stack_stats([], "cpu").tolist() == [0.0] * len(STAT_KEYS)


# ---------------------------------------------------------------- step_metrics

TIMERS = {"timing_s/forward_backward": 0.25, "timing_s/optimizer": 0.125}


def _sums(**values):
    return torch.tensor([values.get(k, 0.0) for k in STAT_KEYS], dtype=torch.float64)


def test_step_metrics_of_a_step_taken():
    sums = _sums(loss=0.5, tokens=4, clipped=1, vpred=2, ret=4, ret_sq=6, err=2, err_sq=3)
    m = step_metrics(sums, grad_norm=1.5, lr=1e-3, skipped=False, empty=False, tokens=40, seconds=2.0,
                     data_seconds=0.5, timers=TIMERS, moe_aux_loss=0.75)
    assert m == {**metrics_from_sums(sums), "critic/grad_norm": 1.5, "critic/lr": 1e-3, "critic/skipped_steps": 0.0,
                 "critic/empty_steps": 0.0, "perf/real_tokens": 40.0, "perf/tokens_per_s": 20.0,
                 "timing_s/step": 2.0, "timing_s/data": 0.5, **TIMERS, "critic/moe_aux_loss": 0.75}


def test_step_metrics_of_an_empty_and_of_a_skipped_step_have_the_same_keys():
    taken = step_metrics(_sums(tokens=4, ret=1, ret_sq=2), grad_norm=1.0, lr=1e-3, skipped=False, empty=False,
                         tokens=40, seconds=1.0, data_seconds=0.1, timers=TIMERS)
    skipped = step_metrics(_sums(loss=float("nan"), tokens=4, ret=1, ret_sq=2), grad_norm=float("nan"), lr=1e-3,
                           skipped=True, empty=False, tokens=40, seconds=1.0, data_seconds=0.1, timers=TIMERS)
    empty = step_metrics(_sums(), grad_norm=0.0, lr=1e-3, skipped=False, empty=True, tokens=0, seconds=0.0,
                         data_seconds=0.0, timers=dict.fromkeys(TIMERS, 0.0))
    assert set(taken) == set(skipped) == set(empty)
    assert skipped["critic/skipped_steps"] == 1.0 and math.isnan(skipped["critic/grad_norm"])
    assert empty["critic/empty_steps"] == 1.0 and empty["critic/skipped_steps"] == 0.0
    # nothing ran and there is nothing to explain: zeros, not NaN or a division by zero
    assert all(v == 0.0 for k, v in empty.items() if k not in ("critic/empty_steps", "critic/lr"))
