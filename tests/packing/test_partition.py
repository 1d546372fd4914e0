import math
import random

import pytest
import torch

from megacritic.packing.partition import (
    karmarkar_karp_equal,
    fixed_partitions,
    karmarkar_karp,
    reverse_index,
    token_budget_partitions,
)


def assert_permutation(parts, n):
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))
    assert len(flat) == n


def part_sums(weights, parts):
    return [sum(weights[i] for i in p) for p in parts]


def round_robin_sums(weights, k):
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    sums = [0] * k
    for j, i in enumerate(order):
        sums[j % k] += weights[i]
    return sums


def random_case(rng, max_n=60):
    n = rng.randint(1, max_n)
    top = rng.choice([5, 100, 4096])
    weights = [rng.randint(1, top) for _ in range(n)]
    return weights


# ---------------------------------------------------------------- karmarkar_karp


def test_kk_random_balance_and_permutation():
    rng = random.Random(1234)
    for _ in range(400):
        weights = random_case(rng)
        n = len(weights)
        k = rng.randint(1, n)
        parts = karmarkar_karp(weights, k)
        assert len(parts) == k
        assert all(parts)  # non-empty
        assert_permutation(parts, n)
        # indices sorted within parts, parts sorted by smallest index
        assert all(p == sorted(p) for p in parts)
        assert [p[0] for p in parts] == sorted(p[0] for p in parts)

        sums = part_sums(weights, parts)
        rr = round_robin_sums(weights, k)
        assert max(sums) - min(sums) <= max(rr) - min(rr)
        assert max(sums) <= max(rr)
        assert max(sums) <= sum(weights) / k + max(weights)


def test_kk_zero_weights_keep_parts_non_empty():
    weights = [0, 0, 5, 0, 0, 3]
    for k in range(1, len(weights) + 1):
        parts = karmarkar_karp(weights, k)
        assert len(parts) == k and all(parts)
        assert_permutation(parts, len(weights))


def test_kk_deterministic():
    rng = random.Random(7)
    weights = [rng.choice([10, 20, 30]) for _ in range(50)]  # many ties
    first = karmarkar_karp(weights, 6)
    for _ in range(3):
        assert karmarkar_karp(list(weights), 6) == first


def test_kk_k_equals_n_and_one():
    weights = [5, 1, 9, 3]
    assert karmarkar_karp(weights, 4) == [[0], [1], [2], [3]]
    assert karmarkar_karp(weights, 1) == [[0, 1, 2, 3]]


def test_kk_simple_balance():
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    sums = sorted(part_sums([8, 7, 6, 5, 4], parts))
    assert sums[1] - sums[0] <= 2


@pytest.mark.parametrize("k", [0, -1, 4])
def test_kk_k_out_of_range(k):
    with pytest.raises(ValueError):
        karmarkar_karp([1, 2, 3], k)


def test_kk_empty_input_raises():
    with pytest.raises(ValueError):
        karmarkar_karp([], 1)


# ------------------------------------------------------- token_budget_partitions


def test_token_budget_random():
    rng = random.Random(99)
    for _ in range(300):
        n = rng.randint(1, 60)
        budget = rng.randint(16, 512)
        weights = [rng.randint(1, budget) for _ in range(n)]
        parts = token_budget_partitions(weights, budget)
        assert_permutation(parts, n)
        assert all(parts)
        assert all(s <= budget for s in part_sums(weights, parts))
        assert len(parts) >= math.ceil(sum(weights) / budget)
        # smallest k: one fewer part would break the budget (or be impossible)
        k = len(parts)
        if k > max(1, math.ceil(sum(weights) / budget)):
            fewer = karmarkar_karp(weights, k - 1)
            assert max(part_sums(weights, fewer)) > budget


def test_token_budget_multiple_of_and_min_parts():
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(8, 60)
        budget = rng.randint(32, 256)
        weights = [rng.randint(1, budget) for _ in range(n)]
        multiple_of = rng.choice([1, 2, 4])
        min_parts = rng.randint(1, 4)
        try:
            parts = token_budget_partitions(
                weights, budget, min_parts=min_parts, multiple_of=multiple_of
            )
        except ValueError as e:
            assert "micro-batches" in str(e)
            continue
        assert_permutation(parts, n)
        assert len(parts) % multiple_of == 0
        assert len(parts) >= min_parts
        assert all(s <= budget for s in part_sums(weights, parts))


def test_token_budget_min_parts_exact():
    weights = [1] * 10
    parts = token_budget_partitions(weights, 100, min_parts=3)
    assert len(parts) == 3
    parts = token_budget_partitions(weights, 100, min_parts=3, multiple_of=2)
    assert len(parts) == 4
    assert token_budget_partitions(weights, 100) == [list(range(10))]


def test_token_budget_oversize_item():
    with pytest.raises(ValueError, match=r"sequence 3 has 130 tokens.*128"):
        token_budget_partitions([10, 20, 30, 130, 5], 128)


def test_token_budget_too_few_items():
    with pytest.raises(ValueError):
        token_budget_partitions([5, 5], 100, min_parts=3)
    with pytest.raises(ValueError):
        token_budget_partitions([100, 100, 100], 100, multiple_of=2)


# ------------------------------------------------------------- fixed_partitions


def test_fixed_partitions():
    parts = fixed_partitions(6, 2)
    assert parts == [[0, 1], [2, 3], [4, 5]]
    assert_permutation(parts, 6)
    assert fixed_partitions(4, 4) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("n,size", [(5, 2), (3, 0), (7, 4)])
def test_fixed_partitions_errors(n, size):
    with pytest.raises(ValueError):
        fixed_partitions(n, size)


# ---------------------------------------------------------------- reverse_index


def test_reverse_index_round_trip():
    rng = random.Random(3)
    for _ in range(50):
        weights = random_case(rng, max_n=40)
        n = len(weights)
        parts = karmarkar_karp(weights, rng.randint(1, n))
        rev = reverse_index(parts)
        assert rev.dtype == torch.long
        cat = [i for p in parts for i in p]
        assert all(cat[rev[j]] == j for j in range(n))

        data = torch.randn(n, 3)
        out = torch.cat([data[p] for p in parts])  # rows in part order
        assert torch.equal(out[rev], data)


def test_reverse_index_errors():
    with pytest.raises(ValueError):
        reverse_index([[0, 1], [1]])
    with pytest.raises(ValueError):
        reverse_index([[0, 3], [1]])


# ---------------------------------------------------------------- karmarkar_karp_equal


@pytest.mark.parametrize("n, k", [(8, 2), (12, 3), (32, 4), (64, 8), (5, 5), (7, 1)])
def test_kk_equal_counts_balance_and_permutation(n, k):
    rng = random.Random(n * 31 + k)
    for _ in range(20):
        weights = [int(rng.lognormvariate(4, 1.2)) for _ in range(n)]
        parts = karmarkar_karp_equal(weights, k)
        assert len(parts) == k and all(len(p) == n // k for p in parts)
        assert sorted(i for p in parts for i in p) == list(range(n))
        assert all(p == sorted(p) for p in parts) and [p[0] for p in parts] == sorted(p[0] for p in parts)
        sums = [sum(weights[i] for i in p) for p in parts]
        assert max(sums) - min(sums) <= max(weights) - min(weights)  # the bound the docstring proves


def test_kk_equal_beats_a_greedy_split_on_a_known_case():
    # sorted groups (1, 2) (3, 4) (5, 6) (7, 8): two bins of 4 items summing to 18 each
    parts = karmarkar_karp_equal([1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert [sum(i + 1 for i in p) for p in parts] == [18, 18]
    assert all(len(p) == 4 for p in parts)


def test_kk_equal_deterministic_and_errors():
    weights = [5, 5, 5, 5, 1, 1]
    assert karmarkar_karp_equal(weights, 2) == karmarkar_karp_equal(list(weights), 2)
    assert karmarkar_karp_equal([], 3) == [[], [], []]
    with pytest.raises(ValueError, match="equal count"):
        karmarkar_karp_equal([1, 2, 3], 2)
    with pytest.raises(ValueError, match="positive"):
        karmarkar_karp_equal([1, 2], 0)
    with pytest.raises(ValueError, match="non-negative"):
        karmarkar_karp_equal([1, -2], 2)
