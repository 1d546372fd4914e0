"""Tests for megacritic.packing.micro_batches: micro-batch tensors (padded and packed THD layouts, value positions),
the context-parallel split, and planning."""

import threading

import pytest
import torch
from tensordict import TensorDict

from megacritic.data.rollouts import BatchError, rollouts_from_batch
from megacritic.packing.context_parallel import context_parallel_split
from megacritic.packing.micro_batches import MicroBatch, build_micro_batch, plan_micro_batches
from megacritic.packing.pack import pack_length
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


def simulated_output(mb):
    """The causal 'model' applied to a micro-batch in its own layout: per row when padded, per cu_seqlens
    segment when packed (positions restart at 0 in each segment), so each token's output depends only on
    its own rollout's tokens up to it. Returned in the model's output shape ([b, s] or [1, t])."""
    if mb.packed is None:
        return prefix_hash_compact(mb.input_ids)
    flat = mb.input_ids.reshape(-1)
    out = torch.full_like(flat, -1)
    cu = mb.packed.cu_seqlens_q.tolist()
    for a, e in zip(cu[:-1], cu[1:]):
        out[a:e] = prefix_hash_compact(flat[a:e][None])[0]
    assert torch.all(out >= 0)  # cu_seqlens cover the whole pack
    return out.reshape(mb.input_ids.shape)


def rollout_spans(mb, lens):
    """[start, end) of each real rollout in the flattened output."""
    if mb.packed is None:
        s = mb.input_ids.shape[1]
        return [(i * s, i * s + n) for i, n in enumerate(lens)]
    cu = mb.packed.cu_seqlens_q.tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(lens))]


def real_tokens(td, i):
    return td["input_ids"][i][td["attention_mask"][i] == 1]


LAYOUTS = pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])


# ---------------------------------------------------------------- build_micro_batch

@LAYOUTS
@pytest.mark.parametrize("seq_multiple", [1, 3, 8])
def test_build_micro_batch_layout(packed, seq_multiple):
    gen = torch.Generator().manual_seed(seq_multiple)
    P, R = 7, 6
    pl, rl = random_lengths(gen, 9, P, R)
    td, ro = make_rollouts(pl, rl, P, R, seed=seq_multiple)
    rows = [5, 0, 3, 8, 1]  # unsorted on purpose
    mb = build_micro_batch(ro, rows, packed=packed, seq_multiple=seq_multiple)
    assert isinstance(mb, MicroBatch)
    assert mb.rows == len(rows)
    assert mb.input_ids.dtype == torch.long
    lens = [pl[i] + rl[i] for i in rows]
    if packed:
        total = sum(lens)
        t = -(-total // seq_multiple) * seq_multiple
        assert mb.input_ids.shape == (1, t)
        concat = torch.cat([real_tokens(td, i) for i in rows])
        assert torch.equal(mb.input_ids[0, :total], concat)
        assert torch.all(mb.input_ids[0, total:] == 0)
    else:
        assert mb.packed is None
        longest = max(lens)
        s = -(-longest // seq_multiple) * seq_multiple
        assert mb.input_ids.shape == (len(rows), s)
        for out_row, i in enumerate(rows):
            real = real_tokens(td, i)
            assert torch.equal(mb.input_ids[out_row, :len(real)], real)
            assert torch.all(mb.input_ids[out_row, len(real):] == 0)
    assert mb.input_ids.shape[1] % seq_multiple == 0
    assert mb.value_index.shape == mb.value_mask.shape == (len(rows), R)
    # Without weights: no loss fields, but values/returns are carried.
    assert mb.weights is None and mb.loss_mask is None
    assert torch.equal(mb.values, ro.values[rows]) and torch.equal(mb.returns, ro.returns[rows])


@pytest.mark.parametrize("seq_multiple", [1, 3, 8])
def test_packed_cu_seqlens(seq_multiple):
    gen = torch.Generator().manual_seed(100 + seq_multiple)
    P, R = 7, 6
    for trial in range(5):
        pl, rl = random_lengths(gen, 9, P, R)
        _, ro = make_rollouts(pl, rl, P, R, seed=trial)
        rows = torch.randperm(9, generator=gen)[:int(torch.randint(1, 10, (1,), generator=gen))].tolist()
        mb = build_micro_batch(ro, rows, packed=True, seq_multiple=seq_multiple)
        ps = mb.packed
        assert ps.qkv_format == "sbhd"  # Megatron sees one [t, 1] sequence; boundaries are ours
        assert ps.cu_seqlens_q.dtype == ps.cu_seqlens_kv.dtype == torch.int32
        assert torch.equal(ps.cu_seqlens_q, ps.cu_seqlens_kv)
        lens = [pl[i] + rl[i] for i in rows]
        ends = torch.tensor(lens).cumsum(0).tolist()
        t = mb.input_ids.shape[1]
        expected = [0] + ends + ([t] if t > ends[-1] else [])
        assert ps.cu_seqlens_q.tolist() == expected
        assert ps.cu_seqlens_q[-1].item() == t
        segs = [b - a for a, b in zip(expected[:-1], expected[1:])]
        assert all(n > 0 for n in segs)
        assert ps.max_seqlen_q == ps.max_seqlen_kv == max(segs)
        assert ps.max_seqlen_q >= max(lens)
        # RoPE positions restart at 0 in every segment (the trailing filler included)
        expected_pos = torch.cat([torch.arange(n) for n in segs])
        assert torch.equal(mb.position_ids, expected_pos[None])


def test_packed_seq_multiple_adds_trailing_segment():
    _, ro = make_rollouts([2, 3], [3, 1], 3, 3)  # lengths 5 and 4: 9 tokens
    mb = build_micro_batch(ro, [0, 1], packed=True, seq_multiple=4)
    assert mb.input_ids.shape == (1, 12)
    assert mb.packed.cu_seqlens_q.tolist() == [0, 5, 9, 12]
    assert mb.packed.max_seqlen_q == 5
    assert torch.all(mb.input_ids[0, 9:] == 0)
    # No trailing segment when the pack is already a multiple.
    mb = build_micro_batch(ro, [0, 1], packed=True, seq_multiple=3)
    assert mb.input_ids.shape == (1, 9)
    assert mb.packed.cu_seqlens_q.tolist() == [0, 5, 9]
    # pad_to longer than the pack: one trailing segment up to pad_to[1] (possibly the longest one).
    mb = build_micro_batch(ro, [0, 1], packed=True, seq_multiple=4, pad_to=(1, 20))
    assert mb.input_ids.shape == (1, 20)
    assert mb.packed.cu_seqlens_q.tolist() == [0, 5, 9, 20]
    assert mb.packed.max_seqlen_q == mb.packed.max_seqlen_kv == 11
    assert torch.all(mb.input_ids[0, 9:] == 0)
    # pad_to shorter than the rounded pack never truncates.
    mb = build_micro_batch(ro, [0, 1], packed=True, seq_multiple=4, pad_to=(1, 10))
    assert mb.input_ids.shape == (1, 12)
    assert mb.packed.cu_seqlens_q.tolist() == [0, 5, 9, 12]


@LAYOUTS
@pytest.mark.parametrize("seq_multiple,pad_extra", [(1, None), (4, None), (3, 5)])
def test_value_index_matches_verl_values_slice(packed, seq_multiple, pad_extra):
    """A causal model run on the micro-batch layout and read at value_index gives verl's
    ``values[:, -R-1:-1]`` of the same model on the verl padded layout, on every real response token."""
    gen = torch.Generator().manual_seed(17 + seq_multiple)
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
        lens = [pl[i] + rl[i] for i in rows]
        pad_to = None
        if pad_extra is not None:
            pad_to = (1, sum(lens) + pad_extra) if packed else (len(rows), max(lens) + pad_extra)
        mb = build_micro_batch(ro, rows, packed=packed, seq_multiple=seq_multiple, pad_to=pad_to)
        flat_len = mb.input_ids.numel()
        assert mb.value_index.shape == (len(rows), R) and mb.value_index.dtype == torch.int64
        assert torch.all((mb.value_index >= 0) & (mb.value_index < flat_len))
        assert torch.equal(mb.value_mask, response_mask[rows].float())
        output = simulated_output(mb)
        got_hash = output.reshape(-1)[mb.value_index]
        # position of each output token within its own rollout
        pos = torch.full((flat_len,), -1, dtype=torch.long)
        for a, e in rollout_spans(mb, lens):
            pos[a:e] = torch.arange(e - a)
        got_pos = pos[mb.value_index]
        m = mb.value_mask.bool()
        assert m.sum() == response_mask[rows].sum()
        assert torch.equal(got_pos[m], verl_pos[rows][m])
        assert torch.equal(got_hash[m], verl_hash[rows][m])
        # The output the critic reads also matches the value-of-real-tokens slice row by row.
        for k, i in enumerate(rows):
            assert torch.equal(got_hash[k, :rl[i]], verl_hash[i, :rl[i]])


@LAYOUTS
def test_masked_value_index_stays_in_own_rollout(packed):
    gen = torch.Generator().manual_seed(3)
    P, R = 6, 7
    for trial in range(5):
        pl, rl = random_lengths(gen, 8, P, R)
        _, ro = make_rollouts(pl, rl, P, R, seed=trial)
        rows = torch.randperm(8, generator=gen)[:5].tolist()
        lens = [pl[i] + rl[i] for i in rows]
        mb = build_micro_batch(ro, rows, packed=packed, seq_multiple=4, pad_to=(len(rows) + 2, 64) if not packed
                               else (1, 64))
        spans = rollout_spans(mb, lens)
        for k, i in enumerate(rows):
            a, e = spans[k]
            idx = mb.value_index[k]
            assert torch.all((idx >= a) & (idx < e)), (k, idx, a, e)
            expected = torch.minimum(pl[i] - 1 + torch.arange(R), torch.tensor(lens[k] - 1))
            assert torch.equal(idx - a, expected)
            assert mb.value_mask[k].tolist() == [1.0] * rl[i] + [0.0] * (R - rl[i])


@LAYOUTS
def test_value_index_hand_computed(packed):
    # Row 0: prompt 2, response 3 -> value of response token j at p - 1 + j = 1, 2, 3 (masked j=3 -> 4).
    # Row 1: prompt 1, response 1 -> index 0 (masked clamp to its last token, 1).
    _, ro = make_rollouts([2, 1], [3, 1], 3, 4)
    mb = build_micro_batch(ro, [0, 1], packed=packed)
    if packed:
        assert mb.input_ids.shape == (1, 7)
        assert mb.packed.cu_seqlens_q.tolist() == [0, 5, 7]
        assert mb.value_index.tolist() == [[1, 2, 3, 4], [5, 6, 6, 6]]
    else:
        assert mb.input_ids.shape == (2, 5)
        assert mb.value_index.tolist() == [[1, 2, 3, 4], [5, 6, 6, 6]]
    assert mb.value_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    # Padded with a wider sequence: row 1 starts at s.
    mb = build_micro_batch(ro, [0, 1], packed=False, seq_multiple=4)
    assert mb.input_ids.shape == (2, 8)
    assert mb.value_index.tolist() == [[1, 2, 3, 4], [8, 9, 9, 9]]
    # Packed with a trailing pad segment: indices unchanged.
    mb = build_micro_batch(ro, [1, 0], packed=True, seq_multiple=4)
    assert mb.packed.cu_seqlens_q.tolist() == [0, 2, 7, 8]
    assert mb.value_index.tolist() == [[0, 1, 1, 1], [3, 4, 5, 6]]


@LAYOUTS
def test_build_micro_batch_with_weights_and_pad_to(packed):
    gen = torch.Generator().manual_seed(5)
    P, R = 5, 4
    pl, rl = random_lengths(gen, 6, P, R)
    td, ro = make_rollouts(pl, rl, P, R, seed=2)
    weights = token_weights(ro.response_mask, "seq-mean-token-mean")
    rows = [2, 4, 1]
    plain = build_micro_batch(ro, rows, packed=packed, weights=weights)
    assert torch.equal(plain.weights, weights[rows])
    assert torch.equal(plain.loss_mask, ro.response_mask[rows])
    n = plain.input_ids.shape[1]

    if packed:
        t_pad = n + 3
        mb = build_micro_batch(ro, rows, packed=True, pad_to=(1, t_pad), weights=weights)
        assert mb.rows == len(rows)
        assert mb.input_ids.shape == (1, t_pad)
        assert torch.equal(mb.input_ids[0, :n], plain.input_ids[0])
        assert torch.all(mb.input_ids[0, n:] == 0)
        assert mb.packed.cu_seqlens_q.tolist() == plain.packed.cu_seqlens_q.tolist() + [t_pad]
        for key in ("value_index", "value_mask", "weights", "loss_mask", "values", "returns"):
            assert torch.equal(getattr(mb, key), getattr(plain, key)), key
        assert torch.all((mb.value_index >= 0) & (mb.value_index < n))  # never in the trailing padding
        small = build_micro_batch(ro, rows, packed=True, pad_to=(1, 1), weights=weights)
        assert small.input_ids.shape == plain.input_ids.shape
        assert small.packed.cu_seqlens_q.tolist() == plain.packed.cu_seqlens_q.tolist()
        return

    b_pad, s_pad = 5, n + 3
    mb = build_micro_batch(ro, rows, packed=False, pad_to=(b_pad, s_pad), weights=weights)
    assert mb.rows == len(rows)
    assert mb.input_ids.shape == (b_pad, s_pad)
    assert mb.value_index.shape == mb.value_mask.shape == mb.weights.shape == (b_pad, R)
    assert mb.values.shape == mb.returns.shape == mb.loss_mask.shape == (b_pad, R)
    # Real rows are unchanged except for the extra right padding.
    assert torch.equal(mb.input_ids[:3, :n], plain.input_ids)
    assert torch.all(mb.input_ids[:3, n:] == 0)
    for key in ("value_mask", "weights", "loss_mask", "values", "returns"):
        assert torch.equal(getattr(mb, key)[:3], getattr(plain, key)), key
    # The flat index follows the wider row stride: row i, position t -> i * s_pad + t.
    row = torch.arange(3)[:, None]
    assert torch.equal(mb.value_index[:3] - row * s_pad, plain.value_index - row * n)
    # Dummy rows contribute nothing.
    assert torch.all(mb.input_ids[3:] == 0)
    assert torch.all(mb.value_mask[3:] == 0)
    assert torch.all(mb.weights[3:] == 0)
    assert torch.all(mb.loss_mask[3:] == 0)
    assert torch.all((mb.value_index >= 0) & (mb.value_index < b_pad * s_pad))
    # pad_to smaller than the natural shape never truncates.
    small = build_micro_batch(ro, rows, packed=False, pad_to=(1, 1), weights=weights)
    assert small.input_ids.shape == plain.input_ids.shape


@LAYOUTS
def test_build_micro_batch_single_row_full_width(packed):
    _, ro = make_rollouts([4], [3], 4, 3)
    mb = build_micro_batch(ro, [0], packed=packed)
    assert mb.input_ids.shape == (1, 7)
    assert torch.equal(mb.input_ids[0], ro.input_ids[0])
    assert mb.value_index[0].tolist() == [3, 4, 5]
    if packed:
        assert mb.packed.cu_seqlens_q.tolist() == [0, 7]
        assert mb.packed.max_seqlen_q == 7


def test_build_micro_batch_device_cpu():
    _, ro = make_rollouts([2, 3], [2, 1], 3, 2)
    for packed in (False, True):
        mb = build_micro_batch(ro, [0, 1], packed=packed, device="cpu")
        assert mb.input_ids.device.type == mb.value_index.device.type == "cpu"
        if packed:
            assert mb.packed.cu_seqlens_q.device.type == "cpu"


def identity(x):
    return x


def assert_each_row_once(parts, n):
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))


# ---------------------------------------------------------------- context parallelism


def test_context_parallel_split_hand_computed():
    # rollouts of 8 and 4 tokens, CP=2: chunks of 2 and 1; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    cu = torch.tensor([0, 8, 12])
    take0, att0 = context_parallel_split(cu, 2, 0)
    take1, att1 = context_parallel_split(cu, 2, 1)
    assert take0.tolist() == [0, 1, 6, 7, 8, 11]
    assert take1.tolist() == [2, 3, 4, 5, 9, 10]
    # rank 0's query chunks [0,1], [6,7], [8], [11] attend to key prefixes of 2, 8, 1 and 4 tokens
    assert att0["chunk_cu_q"].tolist() == [0, 2, 4, 5, 6]
    assert att0["chunk_cu_kv"].tolist() == [0, 2, 10, 11, 15]
    assert (att0["max_chunk_q"], att0["max_chunk_kv"]) == (2, 8)
    gathered = torch.cat([take0, take1])  # what the all-gather concatenates, rank by rank
    assert gathered[att0["kv_index"]].tolist() == [0, 1, *range(8), 8, 8, 9, 10, 11]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_context_parallel_split_covers_the_pack_with_mirrored_chunks(cp):
    gen = torch.Generator().manual_seed(cp)
    spans = (torch.randint(1, 6, (7,), generator=gen) * 2 * cp).tolist()
    cu = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()])
    splits = [context_parallel_split(cu, cp, r) for r in range(cp)]
    takes = [t for t, _ in splits]
    assert len({len(t) for t in takes}) == 1  # every rank holds the same number of tokens
    assert torch.equal(torch.cat(takes).sort().values, torch.arange(int(cu[-1])))  # each token once
    gathered = torch.cat(takes)
    for r, (take, att) in enumerate(splits):
        expected = []
        for start, span in zip(cu[:-1].tolist(), spans):
            c = span // (2 * cp)
            expected += [*range(start + r * c, start + (r + 1) * c),
                         *range(start + (2 * cp - 1 - r) * c, start + (2 * cp - r) * c)]
        assert take.tolist() == expected
        cq, ck = att["chunk_cu_q"].tolist(), att["chunk_cu_kv"].tolist()
        assert cq[-1] == len(take) and len(cq) == len(ck) == 2 * len(spans) + 1
        for i in range(len(cq) - 1):
            queries = take[cq[i]:cq[i + 1]]
            keys = gathered[att["kv_index"][ck[i]:ck[i + 1]]]
            start = max(a for a in cu[:-1].tolist() if a <= int(queries[0]))
            # keys: the rollout from its start up to the chunk's end, so the chunk is the last rows of its
            # keys (the bottom-right causal alignment the attention uses)
            assert torch.equal(keys, torch.arange(start, int(queries[-1]) + 1))
            assert torch.equal(keys[-len(queries):], queries)


@pytest.mark.parametrize("cp,seq_multiple", [(2, 1), (2, 2), (3, 1), (3, 4)])
def test_build_micro_batch_context_parallel_split_and_unsplit(cp, seq_multiple):
    """Each CP rank's share, put back together, is the pack with every rollout padded to a multiple of
    2 x CP; the values each rank reads, summed over ranks, are those of the unsplit micro-batch."""
    gen = torch.Generator().manual_seed(10 * cp + seq_multiple)
    P, R = 7, 6
    pl, rl = random_lengths(gen, 9, P, R)  # odd lengths, lengths not divisible by 2 x CP, an empty response
    td, ro = make_rollouts(pl, rl, P, R, seed=cp)
    weights = token_weights(ro.response_mask, "seq-mean-token-mean")
    rows = [5, 0, 3, 8, 1]
    lens = [pl[i] + rl[i] for i in rows]
    ref = build_micro_batch(ro, rows, packed=True, seq_multiple=seq_multiple, weights=weights)
    mbs = [build_micro_batch(ro, rows, packed=True, seq_multiple=seq_multiple, weights=weights,
                             cp_size=cp, cp_rank=r) for r in range(cp)]
    cu = mbs[0].packed.cu_seqlens_q.long()  # the whole pack's rollouts (and trailing dummy)
    total = int(cu[-1])
    assert total == pack_length(torch.tensor(lens), seq_multiple, cp)
    assert all(torch.equal(mb.packed.cu_seqlens_q, mbs[0].packed.cu_seqlens_q) for mb in mbs)
    for mb in mbs:
        assert mb.input_ids.shape == (1, total // cp) and (total // cp) % seq_multiple == 0
    # unsplit the tokens and positions
    ids, pos = torch.full((total,), -1), torch.full((total,), -1)
    for r, mb in enumerate(mbs):
        take, _ = context_parallel_split(cu, cp, r)
        ids[take], pos[take] = mb.input_ids[0], mb.position_ids[0]
    spans = (cu[1:] - cu[:-1]).tolist()
    for k, i in enumerate(rows):
        start, span = int(cu[k]), spans[k]
        assert span % (2 * cp) == 0 and lens[k] <= span < lens[k] + 2 * cp
        assert torch.equal(ids[start:start + lens[k]], real_tokens(td, i))
        assert torch.all(ids[start + lens[k]:start + span] == 0)  # fillers only after the real tokens
    assert torch.equal(pos, torch.cat([torch.arange(n) for n in spans]))  # positions restart per rollout
    # values: a causal model over the whole pack, read by each rank at its own positions, summed over ranks
    whole = torch.cat([prefix_hash_compact(ids[a:e][None])[0] for a, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    got = sum(whole[context_parallel_split(cu, cp, r)[0]][mb.value_index] * mb.value_mask
              for r, mb in enumerate(mbs))
    expected = simulated_output(ref).reshape(-1)[ref.value_index] * ref.value_mask
    assert torch.equal(got, expected)
    # every response token is counted by exactly one rank (the masks are 0/1 on every rank)
    for key in ("value_mask", "loss_mask", "weights"):
        assert torch.equal(sum(getattr(mb, key) for mb in mbs), getattr(ref, key)), key
    assert all(torch.equal(mb.values, ref.values) for mb in mbs)


def test_build_micro_batch_context_parallel_pad_to():
    _, ro = make_rollouts([2, 3], [3, 2], 3, 3)  # lengths 5 and 5: spans of 8 with CP=2 and 6 with CP=3
    mb = build_micro_batch(ro, [0, 1], packed=True, cp_size=2, cp_rank=1, pad_to=(1, 21))
    assert mb.packed.cu_seqlens_q.tolist() == [0, 8, 16, 24]  # 21 rounded up to 2 x CP
    assert mb.input_ids.shape == (1, 12)
    # sequence parallelism: each rank's share a multiple of TP (here 3), so the pack a multiple of lcm(6, 9)
    mb = build_micro_batch(ro, [0, 1], packed=True, cp_size=3, cp_rank=0, seq_multiple=3)
    assert mb.packed.cu_seqlens_q.tolist() == [0, 6, 12, 18]
    assert mb.input_ids.shape == (1, 6)


# ---------------------------------------------------------------- plan_micro_batches

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
