"""Splitting sequences into micro-batches.

A training step processes sequences of very different lengths.  When they are
grouped into micro-batches naively, one micro-batch can carry far more tokens
than another, and every pipeline stage and data-parallel rank that finished its
light micro-batch early sits idle waiting for the heavy one.  The helpers here
split a list of per-sequence token counts into parts whose sums are as equal as
practical (``karmarkar_karp``), pick the fewest parts that respect a per
micro-batch token budget (``token_budget_partitions``), split into fixed-size
chunks (``fixed_partitions``), split into parts of equal count with balanced sums
(``karmarkar_karp_equal``: the data-parallel shards), and build the index that puts rows computed in
part order back into input order (``reverse_index``).
"""

from __future__ import annotations

import heapq
import itertools
import math

import torch

__all__ = [
    "karmarkar_karp",
    "karmarkar_karp_equal",
    "token_budget_partitions",
    "fixed_partitions",
    "reverse_index",
]


def _check_weights(weights: list[int]) -> list[int]:
    out = []
    for i, w in enumerate(weights):
        w = int(w)
        if w < 0:
            raise ValueError(f"weight of item {i} is {w}; weights must be non-negative")
        out.append(w)
    return out


def _bin_key(b: tuple[int, list[int]]) -> tuple[int, bool]:
    # Order bins by sum; among equal sums an empty bin sorts first, so empty
    # bins always occupy the lowest positions (this keeps every part non-empty
    # when k <= n, even with zero weights).
    return (b[0], bool(b[1]))


def karmarkar_karp(weights: list[int], k: int) -> list[list[int]]:
    """Split item indices ``0..n-1`` into ``k`` non-empty parts with balanced sums.

    Uses the Karmarkar-Karp largest-differencing method generalised to ``k``
    parts.  Each partial solution is a list of ``k`` bins sorted by sum; its
    *spread* is its largest bin sum minus its smallest.  We start with one
    partial solution per item (the item alone in one bin, ``k - 1`` empty
    bins), then repeatedly take the two partial solutions with the largest
    spread and merge them, pairing the largest bin of one with the smallest bin
    of the other (second largest with second smallest, and so on), so their
    imbalances largely cancel.  When one solution remains, its bins are the
    parts.  The spread of a merge never exceeds the larger spread of its two
    inputs, so the final spread is at most ``max(weights)``.

    It is used to balance token counts across micro-batches so that pipeline
    stages and data-parallel ranks spend less time waiting on the heaviest
    micro-batch.

    The result is deterministic: ties between equal spreads are broken by
    insertion order.  Each part lists its indices in ascending order and parts
    are ordered by their smallest index.
    """
    weights = _check_weights(weights)
    n = len(weights)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"number of parts k must be a positive integer, got {k!r}")
    if k > n:
        raise ValueError(
            f"cannot split {n} items into {k} non-empty parts (k must be at most n)"
        )

    counter = itertools.count()
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i, w in enumerate(weights):
        bins: list[tuple[int, list[int]]] = [(0, []) for _ in range(k - 1)]
        bins.append((w, [i]))
        heapq.heappush(heap, (-w, next(counter), bins))

    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [
            (a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)
        ]
        merged.sort(key=_bin_key)  # stable, so deterministic
        spread = merged[-1][0] - merged[0][0]
        heapq.heappush(heap, (-spread, next(counter), merged))

    bins = heap[0][2]
    parts = [sorted(items) for _, items in bins]
    if any(not p for p in parts):  # cannot happen for k <= n (see _bin_key)
        raise AssertionError("karmarkar_karp produced an empty part")
    parts.sort(key=lambda p: p[0])
    return parts


def karmarkar_karp_equal(weights: list[int], k: int) -> list[list[int]]:
    """Split item indices ``0..n-1`` into ``k`` parts of ``n / k`` items each, with balanced sums.

    The largest-differencing method with a cardinality constraint: the items, sorted by weight, are taken
    ``k`` at a time, and each such group starts one partial solution with one item in every bin (so every
    merge keeps the bins' counts equal). The two partial solutions of largest spread are merged as in
    :func:`karmarkar_karp` (the largest bin of one with the smallest of the other). A group of ``k``
    neighbours in sorted order has a spread of at most ``max(weights) - min(weights)``, and a merge never
    spreads more than the larger of its inputs, so neither does the result.

    Deterministic (ties by weight then index; merges by insertion order): the same parts on every rank.
    Each part lists its indices in ascending order; parts are ordered by their smallest index.
    """
    weights = _check_weights(weights)
    n = len(weights)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"number of parts k must be a positive integer, got {k!r}")
    if n % k:
        raise ValueError(f"cannot split {n} items into {k} parts of equal count (not divisible)")
    if n == 0:
        return [[] for _ in range(k)]
    order = sorted(range(n), key=lambda i: (weights[i], i))
    counter = itertools.count()
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for start in range(0, n, k):
        group = order[start:start + k]  # ascending weights: the bins are sorted by sum
        bins = [(weights[i], [i]) for i in group]
        heapq.heappush(heap, (-(bins[-1][0] - bins[0][0]), next(counter), bins))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)),
                        key=lambda b: b[0])  # stable, so deterministic
        heapq.heappush(heap, (-(merged[-1][0] - merged[0][0]), next(counter), merged))
    parts = [sorted(items) for _, items in heap[0][2]]
    parts.sort(key=lambda p: p[0])
    return parts


def token_budget_partitions(
    weights: list[int],
    max_weight: int,
    min_parts: int = 1,
    multiple_of: int = 1,
) -> list[list[int]]:
    """Fewest balanced parts whose token sums all fit in ``max_weight``.

    Starts from ``k = max(min_parts, ceil(sum / max_weight))`` rounded up to a
    multiple of ``multiple_of`` and tries ``karmarkar_karp(weights, k)``,
    increasing ``k`` by ``multiple_of`` until every part's sum is at most
    ``max_weight``.
    """
    weights = _check_weights(weights)
    n = len(weights)
    if max_weight < 1:
        raise ValueError(f"token budget max_weight must be positive, got {max_weight}")
    if min_parts < 1:
        raise ValueError(f"min_parts must be at least 1, got {min_parts}")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be at least 1, got {multiple_of}")
    for i, w in enumerate(weights):
        if w > max_weight:
            raise ValueError(
                f"sequence {i} has {w} tokens, more than the token budget of "
                f"{max_weight} per micro-batch"
            )

    k = max(min_parts, math.ceil(sum(weights) / max_weight), 1)
    k = math.ceil(k / multiple_of) * multiple_of
    while k <= n:
        parts = karmarkar_karp(weights, k)
        if all(sum(weights[i] for i in p) <= max_weight for p in parts):
            return parts
        k += multiple_of
    raise ValueError(
        f"cannot split {n} sequences into {k} non-empty micro-batches "
        f"(need a number of micro-batches that is at least {min_parts}, a multiple "
        f"of {multiple_of} and fits the token budget of {max_weight}, but there "
        f"are too few sequences)"
    )


def fixed_partitions(n: int, size: int) -> list[list[int]]:
    """Consecutive chunks ``[0..size-1], [size..2*size-1], ...`` of ``range(n)``."""
    if size < 1:
        raise ValueError(f"chunk size must be positive, got {size}")
    if n < 0:
        raise ValueError(f"number of items must be non-negative, got {n}")
    if n % size != 0:
        raise ValueError(f"{n} items cannot be split into chunks of {size} (not divisible)")
    return [list(range(s, s + size)) for s in range(0, n, size)]


def reverse_index(parts: list[list[int]]) -> torch.Tensor:
    """Index that restores input order from rows produced in part order.

    With ``cat = [i for p in parts for i in p]`` the returned LongTensor ``rev``
    satisfies ``cat[rev[j]] == j``, so ``out[rev]`` reorders rows computed part
    by part back into the original item order.
    """
    cat = [int(i) for p in parts for i in p]
    n = len(cat)
    seen = [False] * n
    for i in cat:
        if not 0 <= i < n or seen[i]:
            problem = "out of range" if not 0 <= i < n else "repeated"
            raise ValueError(
                f"parts must be a permutation of 0..{n - 1}: index {i} is {problem}"
            )
        seen[i] = True
    rev = torch.empty(n, dtype=torch.long)
    rev[torch.tensor(cat, dtype=torch.long)] = torch.arange(n, dtype=torch.long)
    return rev
