"""Tests for megacritic.advantages: verl's GAE against a plain-Python reference."""

import math
import random

import pytest
import torch

from megacritic.advantages import compute_gae, masked_whiten
from megacritic.data.rollouts import BatchError


def reference_gae(rewards, values, mask, gamma, lam):
    """Plain-Python GAE with verl's skip-masked-tokens convention, written independently of the code under
    test: run the textbook recursion over the *real* tokens of each row only, then give a masked position the
    raw advantage of the next real token (0 after the last), and ``returns = advantages + values`` everywhere;
    finally whiten with verl's masked mean and unbiased masked variance over the whole batch."""
    b, r = len(rewards), len(rewards[0])
    adv = [[0.0] * r for _ in range(b)]
    for i in range(b):
        real = [t for t in range(r) if mask[i][t]]
        real_adv = {}
        last = 0.0
        for k in reversed(range(len(real))):
            t = real[k]
            next_value = values[i][real[k + 1]] if k + 1 < len(real) else 0.0
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            last = delta + gamma * lam * last
            real_adv[t] = last
        carried = 0.0
        for t in reversed(range(r)):
            if mask[i][t]:
                carried = real_adv[t]
            adv[i][t] = carried
    returns = [[adv[i][t] + values[i][t] for t in range(r)] for i in range(b)]
    n = sum(mask[i][t] for i in range(b) for t in range(r))
    mean = sum(adv[i][t] for i in range(b) for t in range(r) if mask[i][t]) / (n + 1e-8)
    var = sum((adv[i][t] - mean) ** 2 for i in range(b) for t in range(r) if mask[i][t]) / (n + 1e-8)
    var *= n / (n - 1)
    white = [[(adv[i][t] - mean) / math.sqrt(var + 1e-8) for t in range(r)] for i in range(b)]
    return white, returns


def random_case(seed, b=7, r=11, holes=False):
    rng = random.Random(seed)
    rewards = [[rng.gauss(0, 1) for _ in range(r)] for _ in range(b)]
    values = [[rng.gauss(0, 1) for _ in range(r)] for _ in range(b)]
    lengths = [0, r, 1] + [rng.randint(0, r) for _ in range(b - 3)]    # a fully masked row, a full one
    mask = [[int(t < lengths[i]) for t in range(r)] for i in range(b)]
    if holes:
        mask = [[int(rng.random() < 0.6) for _ in range(r)] for _ in range(b)]
        mask[0] = [0] * r
    return rewards, values, mask


def run(rewards, values, mask, gamma, lam):
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)   # noqa: E731
    adv, ret = compute_gae(f64(rewards), f64(values), f64(mask), gamma, lam)
    assert adv.dtype == ret.dtype == torch.float64
    return adv, ret


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.0, 0.0), (0.7, 0.3), (1.0, 0.9)])
@pytest.mark.parametrize("holes", [False, True])
def test_matches_reference(seed, gamma, lam, holes):
    rewards, values, mask = random_case(seed, holes=holes)
    adv, ret = run(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_gamma_lam_one_returns_are_reward_to_go():
    rewards, values, mask = random_case(11)
    _, ret = run(rewards, values, mask, 1.0, 1.0)
    for i, row in enumerate(mask):
        for t, m in enumerate(row):
            if m:
                to_go = sum(rewards[i][u] for u in range(t, len(row)) if mask[i][u])
                assert ret[i, t].item() == pytest.approx(to_go, abs=1e-12)


def test_gamma_lam_zero_is_one_step_td():
    rewards, values, mask = random_case(12)
    adv, ret = run(rewards, values, mask, 0.0, 0.0)
    m = torch.tensor(mask, dtype=torch.bool)
    r, v = torch.tensor(rewards, dtype=torch.float64), torch.tensor(values, dtype=torch.float64)
    torch.testing.assert_close(ret[m], r[m], rtol=0, atol=1e-12)
    torch.testing.assert_close(adv, masked_whiten(torch.where(m, r - v, 0.0), m.double()), rtol=0, atol=1e-12)


def test_whitened_over_real_tokens_and_returns_before_whitening():
    rewards, values, mask = random_case(13)
    adv, ret = run(rewards, values, mask, 0.9, 0.8)
    m = torch.tensor(mask, dtype=torch.bool)
    assert adv[m].mean().item() == pytest.approx(0.0, abs=1e-9)
    assert adv[m].var(unbiased=True).item() == pytest.approx(1.0, abs=1e-6)
    # returns stay on the reward scale: returns - values are the raw (unwhitened) advantages
    raw = ret - torch.tensor(values, dtype=torch.float64)
    torch.testing.assert_close(masked_whiten(raw, m.double()), adv, rtol=0, atol=1e-12)


def test_fully_masked_row_gets_zero_raw_advantage():
    rewards, values, mask = random_case(14)
    assert not any(mask[0])
    adv, ret = run(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(ret[0], torch.tensor(values[0], dtype=torch.float64))   # raw advantage 0
    assert torch.allclose(adv[0], adv[0, 0].expand_as(adv[0]))                       # one whitened constant


@pytest.mark.parametrize("holes", [False, True])
def test_masked_positions_do_not_influence_real_ones(holes):
    rewards, values, mask = random_case(15, holes=holes)
    adv, ret = run(rewards, values, mask, 0.99, 0.95)
    m = torch.tensor(mask, dtype=torch.bool)
    r2 = torch.where(m, torch.tensor(rewards, dtype=torch.float64), float("nan"))
    v2 = torch.where(m, torch.tensor(values, dtype=torch.float64), 1e6)
    adv2, ret2 = compute_gae(r2, v2, m, 0.99, 0.95)
    torch.testing.assert_close(adv2[m], adv[m], rtol=0, atol=1e-12)
    torch.testing.assert_close(ret2[m], ret[m], rtol=0, atol=1e-12)


def test_same_as_older_verl_on_right_padding_with_zero_padding():
    """Older verl (nextvalues = values[t + 1] whatever the mask) agrees when padding holds zeros."""
    rewards, values, mask = random_case(16)
    m = torch.tensor(mask, dtype=torch.float64)
    r, v = torch.tensor(rewards, dtype=torch.float64) * m, torch.tensor(values, dtype=torch.float64) * m
    last, rev = 0.0, []
    for t in reversed(range(r.shape[1])):
        nextvalues = v[:, t + 1] if t < r.shape[1] - 1 else 0.0
        last = r[:, t] + 0.99 * nextvalues - v[:, t] + 0.99 * 0.95 * last
        rev.append(last)
    old_raw = torch.stack(rev[::-1], 1)
    adv, ret = compute_gae(r, v, m, 0.99, 0.95)
    torch.testing.assert_close(ret * m, (old_raw + v) * m, rtol=0, atol=1e-12)
    torch.testing.assert_close(adv * m, masked_whiten(old_raw, m) * m, rtol=0, atol=1e-12)


def test_float32_and_bool_mask():
    rewards, values, mask = random_case(17)
    adv64, ret64 = run(rewards, values, mask, 0.99, 0.95)
    adv, ret = compute_gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask, dtype=torch.bool),
                           0.99, 0.95)
    assert adv.dtype == ret.dtype == torch.float32
    torch.testing.assert_close(adv.double(), adv64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ret.double(), ret64, rtol=1e-4, atol=1e-5)


def test_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(BatchError, match="values has shape"):
        compute_gae(x, torch.zeros(2, 4), x, 1.0, 1.0)
    with pytest.raises(BatchError, match="response_mask has shape"):
        compute_gae(x, x, torch.ones(3, 3), 1.0, 1.0)
    with pytest.raises(BatchError, match="batch, response"):
        compute_gae(torch.zeros(3), torch.zeros(3), torch.ones(3), 1.0, 1.0)
    with pytest.raises(BatchError, match="only 0 and 1"):
        compute_gae(x, x, torch.full((2, 3), 0.5), 1.0, 1.0)
    with pytest.raises(BatchError, match="no token"):
        compute_gae(x, x, torch.zeros(2, 3), 1.0, 1.0)
    one = torch.zeros(2, 3)
    one[1, 0] = 1
    with pytest.raises(BatchError, match="single token"):
        compute_gae(x, x, one, 1.0, 1.0)
