"""Tests for megacritic.batching: micro-batch tensors (left-aligned rows, value positions) and planning."""

import threading

import pytest
import torch
from tensordict import TensorDict

from megacritic.batch import BatchError, rollouts_from_batch
from megacritic.batching import MicroBatch, build_micro_batch, plan_micro_batches
from megacritic.losses import token_weights

VOCAB = 1000


def make_rollouts(prompt_lens, response_lens, prompt_width, response_width, seed=0):
    """Rollouts from a valid verl-layout batch (left-padded prompts, right-padded responses, pad id 0)."""
    gen = torch.Generator().manual_seed(seed)
    b, p, r = len(prompt_lens), prompt_width, response_width
    attention_mask = torch.zeros(b, p + r, dtype=torch.int64)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens)):
        attention_mask[i, p - pl:p] = 1
        attention_mask[i, p:p + rl] = 1
    input_ids = torch.randint(1, VOCAB, (b, p + r), generator=gen) * attention_mask
    td = TensorDict({
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "responses": input_ids[:, -r:].clone(),
        "values": torch.randn(b, r, generator=gen),
        "returns": torch.randn(b, r, generator=gen),
    }, batch_size=[b])
    return td, rollouts_from_batch(td, need_targets=True, vocab_size=VOCAB)


def random_lengths(gen, b, p, r):
    pl = torch.randint(1, p + 1, (b,), generator=gen).tolist()
    rl = torch.randint(0, r + 1, (b,), generator=gen).tolist()
    rl[0] = r       # a full-width response
    if b > 1:
        rl[1] = 0   # an empty response
    return pl, rl


def prefix_hash_padded(input_ids, attention_mask):
    """A causal 'model' over the padded layout: the output at column c depends only on the real tokens at
    columns <= c and on c's index among real tokens (what a model sees with verl's mask/position_ids)."""
    k = attention_mask.cumsum(1) - 1  # index of each column among the real tokens
    contrib = input_ids * (k + 1) * attention_mask
    return contrib.cumsum(1) + 1_000_000_000 * k


def prefix_hash_compact(ids):
    """The same causal 'model' on left-aligned rows (positions 0..s-1)."""
    k = torch.arange(ids.shape[1])[None, :]
    return (ids * (k + 1)).cumsum(1) + 1_000_000_000 * k


# ---------------------------------------------------------------- build_micro_batch

@pytest.mark.parametrize("seq_multiple", [1, 3, 8])
def test_build_micro_batch_left_aligns_tokens(seq_multiple):
    gen = torch.Generator().manual_seed(seq_multiple)
    P, R = 7, 6
    pl, rl = random_lengths(gen, 9, P, R)
    td, ro = make_rollouts(pl, rl, P, R, seed=seq_multiple)
    rows = [5, 0, 3, 8, 1]  # unsorted on purpose
    mb = build_micro_batch(ro, rows, seq_multiple=seq_multiple)
    assert isinstance(mb, MicroBatch)
    longest = max(pl[i] + rl[i] for i in rows)
    s = -(-longest // seq_multiple) * seq_multiple
    assert mb.input_ids.shape == (len(rows), s)
    assert mb.input_ids.shape[1] % seq_multiple == 0
    assert mb.rows == len(rows) and mb.tokens == len(rows) * s
    for out_row, i in enumerate(rows):
        real = td["input_ids"][i][td["attention_mask"][i] == 1]
        assert torch.equal(mb.input_ids[out_row, :len(real)], real)
        assert torch.all(mb.input_ids[out_row, len(real):] == 0)
    # Without weights: no loss fields, but values/returns are carried.
    assert mb.weights is None and mb.loss_mask is None
    assert torch.equal(mb.values, ro.values[rows]) and torch.equal(mb.returns, ro.returns[rows])


def test_value_index_matches_verl_values_slice():
    gen = torch.Generator().manual_seed(17)
    P, R = 6, 5
    for trial in range(5):
        b = 8
        pl, rl = random_lengths(gen, b, P, R)
        td, ro = make_rollouts(pl, rl, P, R, seed=trial)
        am = td["attention_mask"]
        # verl: output in the padded layout, values = output[:, -R-1:-1]
        out_pos_padded = am.cumsum(1) - 1                     # value at column c = position of c among real tokens
        out_hash_padded = prefix_hash_padded(td["input_ids"], am)
        verl_pos = out_pos_padded[:, -R - 1:-1]
        verl_hash = out_hash_padded[:, -R - 1:-1]
        response_mask = am[:, P:] == 1

        rows = torch.randperm(b, generator=gen)[:6].tolist()
        mb = build_micro_batch(ro, rows, seq_multiple=4)
        s = mb.input_ids.shape[1]
        assert mb.value_index.shape == (len(rows), R) and mb.value_index.dtype == torch.int64
        assert torch.all((mb.value_index >= 0) & (mb.value_index < s))
        assert torch.equal(mb.value_mask, response_mask[rows].float())
        out_pos = torch.arange(s).expand(len(rows), s)        # position t holds value t
        got_pos = out_pos.gather(1, mb.value_index)
        got_hash = prefix_hash_compact(mb.input_ids).gather(1, mb.value_index)
        m = mb.value_mask.bool()
        assert m.sum() == response_mask[rows].sum()
        assert torch.equal(got_pos[m], verl_pos[rows][m])
        assert torch.equal(got_hash[m], verl_hash[rows][m])


def test_value_index_hand_computed():
    # Row 0: prompt 2, response 3 -> value of response token j at p - 1 + j = 1, 2, 3.
    # Row 1: prompt 1, response 1 -> index 0 (others masked).
    _, ro = make_rollouts([2, 1], [3, 1], 3, 4)
    mb = build_micro_batch(ro, [0, 1])
    assert mb.input_ids.shape == (2, 5)
    assert mb.value_index[0, :3].tolist() == [1, 2, 3]
    assert mb.value_index[1, 0].item() == 0
    assert mb.value_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]


def test_build_micro_batch_with_weights_and_pad_to():
    gen = torch.Generator().manual_seed(5)
    P, R = 5, 4
    pl, rl = random_lengths(gen, 6, P, R)
    td, ro = make_rollouts(pl, rl, P, R, seed=2)
    weights = token_weights(ro.response_mask, "seq-mean-token-mean")
    rows = [2, 4, 1]
    plain = build_micro_batch(ro, rows, weights=weights)
    assert torch.equal(plain.weights, weights[rows])
    assert torch.equal(plain.loss_mask, ro.response_mask[rows])

    b_pad, s_pad = 5, plain.input_ids.shape[1] + 3
    mb = build_micro_batch(ro, rows, pad_to=(b_pad, s_pad), weights=weights)
    assert mb.rows == len(rows)
    assert mb.input_ids.shape == (b_pad, s_pad)
    assert mb.value_index.shape == mb.value_mask.shape == mb.weights.shape == (b_pad, R)
    assert mb.values.shape == mb.returns.shape == mb.loss_mask.shape == (b_pad, R)
    # Real rows are unchanged except for the extra right padding.
    s = plain.input_ids.shape[1]
    assert torch.equal(mb.input_ids[:3, :s], plain.input_ids)
    assert torch.all(mb.input_ids[:3, s:] == 0)
    for key in ("value_mask", "weights", "loss_mask", "values", "returns"):
        assert torch.equal(getattr(mb, key)[:3], getattr(plain, key)), key
    m = plain.value_mask.bool()  # value positions of padding tokens are arbitrary (clamped)
    assert torch.equal(mb.value_index[:3][m], plain.value_index[m])
    # Dummy rows contribute nothing.
    assert torch.all(mb.input_ids[3:] == 0)
    assert torch.all(mb.value_mask[3:] == 0)
    assert torch.all(mb.weights[3:] == 0)
    assert torch.all(mb.loss_mask[3:] == 0)
    assert torch.all((mb.value_index >= 0) & (mb.value_index < s_pad))
    # pad_to smaller than the natural shape never truncates.
    small = build_micro_batch(ro, rows, pad_to=(1, 1), weights=weights)
    assert small.input_ids.shape == plain.input_ids.shape


def test_build_micro_batch_single_row_full_width():
    _, ro = make_rollouts([4], [3], 4, 3)
    mb = build_micro_batch(ro, [0])
    assert mb.input_ids.shape == (1, 7)
    assert torch.equal(mb.input_ids[0], ro.input_ids[0])
    assert mb.value_index[0].tolist() == [3, 4, 5]


# ---------------------------------------------------------------- plan_micro_batches

def identity(x):
    return x


def assert_each_row_once(parts, n):
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))


def test_plan_fixed_size():
    parts = plan_micro_batches([5, 3, 9, 1, 2, 7], micro_batch_size=2, max_tokens=None, multiple_of=1,
                               max_over_ranks=identity)
    assert parts == [[0, 1], [2, 3], [4, 5]]
    parts = plan_micro_batches([5] * 8, micro_batch_size=2, max_tokens=None, multiple_of=2,
                               max_over_ranks=identity)
    assert len(parts) == 4 and len(parts) % 2 == 0
    assert_each_row_once(parts, 8)


def test_plan_fixed_size_honours_multiple_of():
    try:
        parts = plan_micro_batches([5] * 6, micro_batch_size=2, max_tokens=None, multiple_of=2,
                                   max_over_ranks=identity)
    except BatchError:
        return
    assert len(parts) % 2 == 0


@pytest.mark.parametrize("multiple_of", [1, 2, 3])
def test_plan_token_budget(multiple_of):
    gen = torch.Generator().manual_seed(multiple_of)
    for _ in range(10):
        n = int(torch.randint(6, 40, (1,), generator=gen))
        lens = torch.randint(1, 60, (n,), generator=gen).tolist()
        budget = int(torch.randint(60, 200, (1,), generator=gen))
        parts = plan_micro_batches(lens, micro_batch_size=None, max_tokens=budget, multiple_of=multiple_of,
                                   max_over_ranks=identity)
        assert_each_row_once(parts, n)
        assert all(p for p in parts)
        assert all(sum(lens[i] for i in p) <= budget for p in parts)
        assert len(parts) % multiple_of == 0


def test_plan_token_budget_uses_few_parts():
    parts = plan_micro_batches([10] * 8, micro_batch_size=None, max_tokens=40, multiple_of=1,
                               max_over_ranks=identity)
    assert len(parts) == 2
    assert all(sum(10 for _ in p) == 40 for p in parts)


@pytest.mark.parametrize("multiple_of,other_ranks,expected", [(1, 6, 6), (2, 6, 6), (4, 6, 8), (1, 2, 3)])
def test_plan_token_budget_agrees_with_other_ranks(multiple_of, other_ranks, expected):
    lens = [10, 20, 5, 30, 15, 25, 10, 5, 20, 10]  # 150 tokens; budget 60 -> 3 parts alone
    calls = []

    def max_over_ranks(x):
        calls.append(x)
        return max(x, other_ranks)

    parts = plan_micro_batches(lens, micro_batch_size=None, max_tokens=60, multiple_of=multiple_of,
                               max_over_ranks=max_over_ranks)
    assert len(parts) == expected
    assert len(parts) % multiple_of == 0
    assert_each_row_once(parts, len(lens))
    assert all(sum(lens[i] for i in p) <= 60 for p in parts)
    assert calls[-1] == expected  # the last collective confirmed the final count


def test_plan_token_budget_ranks_agree_in_threads():
    """Simulate DP ranks with an all-reduce MAX across threads: all ranks end with the same count."""
    rank_lens = [
        [5, 5, 5, 5, 5, 5, 5, 5],                 # light: fits in 1 part
        [40, 35, 30, 20, 10, 10, 5, 5],          # heavy: needs >= 4 parts of 50
        [45, 45, 2, 2, 2, 2, 2, 2],
    ]
    world = len(rank_lens)
    barrier = threading.Barrier(world)
    slots = [None] * world
    results, errors = [None] * world, []

    def make_max(rank):
        def max_over_ranks(x):
            slots[rank] = x
            barrier.wait(timeout=10)
            m = max(slots)
            barrier.wait(timeout=10)
            return m
        return max_over_ranks

    def worker(rank):
        try:
            results[rank] = plan_micro_batches(rank_lens[rank], micro_batch_size=None, max_tokens=50,
                                               multiple_of=2, max_over_ranks=make_max(rank))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors
    counts = {len(p) for p in results}
    assert len(counts) == 1
    for lens, parts in zip(rank_lens, results):
        assert_each_row_once(parts, len(lens))
        assert all(sum(lens[i] for i in p) <= 50 for p in parts)
        assert len(parts) % 2 == 0


def test_plan_sequence_longer_than_budget():
    with pytest.raises(BatchError) as info:
        plan_micro_batches([10, 80, 5], micro_batch_size=None, max_tokens=64, multiple_of=1,
                           max_over_ranks=identity)
    msg = str(info.value)
    assert "ppo_max_token_len_per_gpu" in msg and "forward_max_token_len_per_gpu" in msg
    assert "64" in msg


def test_plan_too_few_sequences_for_multiple():
    # 3 sequences cannot form a multiple of 4 non-empty micro-batches.
    with pytest.raises(BatchError, match="ppo_max_token_len_per_gpu"):
        plan_micro_batches([10, 10, 10], micro_batch_size=None, max_tokens=64, multiple_of=4,
                           max_over_ranks=identity)
