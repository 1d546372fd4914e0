"""Tests for megacritic.data.rollouts: checking verl-layout batches, mini-batch indices and DP shards."""

import pytest
import torch
from tensordict import TensorDict

from megacritic.data.rollouts import (BatchError, Rollouts, dp_shards, mini_batch_indices, nested_token_values,
                                     rollouts_from_batch)
from megacritic.packing.partition import reverse_index

VOCAB = 50


def make_batch(prompt_lens, response_lens, prompt_width, response_width, *, seed=0, targets=True,
               response_mask=False):
    """A valid verl-layout batch: left-padded prompts, right-padded responses, pad id 0,
    position_ids = clamp(cumsum(attention_mask) - 1, 0), responses = last R columns of input_ids."""
    gen = torch.Generator().manual_seed(seed)
    b, p, r = len(prompt_lens), prompt_width, response_width
    t = p + r
    attention_mask = torch.zeros(b, t, dtype=torch.int64)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens)):
        attention_mask[i, p - pl:p] = 1
        attention_mask[i, p:p + rl] = 1
    input_ids = torch.randint(1, VOCAB, (b, t), generator=gen) * attention_mask
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    data = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, -r:].clone(),
    }
    if targets:
        data["values"] = torch.randn(b, r, generator=gen)
        data["returns"] = torch.randn(b, r, generator=gen)
    if response_mask:
        data["response_mask"] = attention_mask[:, p:].clone()
    return TensorDict(data, batch_size=[b])


class FakeDataProto:
    """Minimal stand-in for verl's DataProto: a TensorDict in .batch plus a meta_info dict."""

    def __init__(self, batch, meta_info=None):
        self.batch = batch
        self.meta_info = meta_info or {}
        self.non_tensor_batch = {}


PL = [3, 1, 4, 2, 4]
RL = [2, 5, 0, 3, 5]
P, R = 4, 5


def valid():
    return make_batch(PL, RL, P, R)


# ---------------------------------------------------------------- valid batches

@pytest.mark.parametrize("wrap", [False, True])
def test_rollouts_from_valid_batch(wrap):
    td = valid()
    data = FakeDataProto(td, {"temperature": 1.0}) if wrap else td
    ro = rollouts_from_batch(data, need_targets=True, vocab_size=VOCAB)
    assert isinstance(ro, Rollouts)
    assert ro.prompt_lens.tolist() == PL
    assert ro.response_lens.tolist() == RL
    assert ro.seq_lens.tolist() == [p + r for p, r in zip(PL, RL)]
    expected_mask = (torch.arange(R)[None, :] < torch.tensor(RL)[:, None]).float()
    assert torch.equal(ro.response_mask, expected_mask)
    assert ro.response_mask.dtype == torch.float32
    assert torch.equal(ro.input_ids, td["input_ids"])
    assert ro.input_ids.dtype == torch.int64
    assert ro.response_width == R and ro.prompt_width == P and len(ro) == len(PL)
    assert ro.values.dtype == torch.float32 and ro.returns.dtype == torch.float32
    assert torch.equal(ro.values, td["values"] * expected_mask)
    assert torch.equal(ro.returns, td["returns"] * expected_mask)


def test_rollouts_without_targets():
    td = valid()
    del td["values"], td["returns"]
    ro = rollouts_from_batch(td, need_targets=False)
    assert ro.values is None and ro.returns is None
    assert ro.response_lens.tolist() == RL
    assert set(ro.tensors()) == {"input_ids", "prompt_lens", "response_lens", "response_mask"}


def test_rollouts_select():
    ro = rollouts_from_batch(valid(), need_targets=True)
    sub = ro.select(torch.tensor([4, 1]))
    assert sub.prompt_lens.tolist() == [PL[4], PL[1]]
    assert torch.equal(sub.values, ro.values[[4, 1]])


def test_explicit_response_mask_is_the_loss_mask():
    td = make_batch(PL, RL, P, R, response_mask=True)
    td["response_mask"][1, 2:] = 0  # loss mask may drop real response tokens
    ro = rollouts_from_batch(td, need_targets=True)
    assert torch.equal(ro.response_mask, td["response_mask"].float())
    assert ro.response_lens.tolist() == RL  # lengths still come from attention_mask
    assert torch.all(ro.values[1, 2:] == 0)


def test_verl_position_ids_on_response_padding_are_accepted():
    # verl's rollout keeps counting positions over response padding; only real tokens are checked.
    td = valid()
    pos = td["position_ids"]
    last_prompt_pos = pos[:, P - 1:P]
    pos[:, P:] = last_prompt_pos + torch.arange(1, R + 1)[None, :]
    rollouts_from_batch(td, need_targets=True)


def test_int32_input_ids_accepted():
    td = valid()
    td["input_ids"] = td["input_ids"].to(torch.int32)
    ro = rollouts_from_batch(td, need_targets=True)
    assert ro.input_ids.dtype == torch.int64


def test_nan_on_masked_positions_accepted_and_zeroed():
    td = valid()
    td["returns"][2, :] = float("nan")  # row 2 has no response tokens
    td["values"][0, 3:] = float("inf")  # row 0 has 2 response tokens
    ro = rollouts_from_batch(td, need_targets=True)
    assert torch.isfinite(ro.returns).all() and torch.isfinite(ro.values).all()
    assert torch.all(ro.returns[2] == 0) and torch.all(ro.values[0, 3:] == 0)
    # The caller's batch is not modified.
    assert torch.isnan(td["returns"][2]).all()


def test_not_a_batch():
    with pytest.raises(BatchError, match="TensorDict"):
        rollouts_from_batch({"input_ids": torch.zeros(1, 2)}, need_targets=False)


# ---------------------------------------------------------------- invalid batches

def _set_attention(td, mask):
    td["attention_mask"] = mask
    td["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
    td["input_ids"] = td["input_ids"].clamp(min=1) * mask
    td["responses"] = td["input_ids"][:, -R:].clone()


@pytest.mark.parametrize("key", ["input_ids", "attention_mask", "position_ids", "responses", "values", "returns"])
def test_missing_key(key):
    td = valid()
    del td[key]
    with pytest.raises(BatchError, match=key):
        rollouts_from_batch(td, need_targets=True)


def test_attention_mask_shape_mismatch():
    td = valid()
    td["attention_mask"] = td["attention_mask"][:, 1:]
    with pytest.raises(BatchError, match="attention_mask"):
        rollouts_from_batch(td, need_targets=True)


def test_position_ids_shape_mismatch():
    td = valid()
    td["position_ids"] = td["position_ids"][:, :-1]
    with pytest.raises(BatchError, match="position_ids"):
        rollouts_from_batch(td, need_targets=True)


@pytest.mark.parametrize("key", ["values", "returns"])
def test_targets_of_wrong_shape(key):
    td = valid()
    td[key] = torch.zeros(len(PL), R + 1)
    with pytest.raises(BatchError, match=key):
        rollouts_from_batch(td, need_targets=True)


def test_targets_of_integer_dtype():
    td = valid()
    td["values"] = torch.zeros(len(PL), R, dtype=torch.int64)
    with pytest.raises(BatchError, match="values"):
        rollouts_from_batch(td, need_targets=True)


def test_nan_returns_on_response_token():
    td = valid()
    td["returns"][3, 1] = float("nan")  # row 3 has 3 response tokens
    with pytest.raises(BatchError, match="returns"):
        rollouts_from_batch(td, need_targets=True)


def test_inf_values_on_response_token():
    td = valid()
    td["values"][1, 4] = float("inf")
    with pytest.raises(BatchError, match="values"):
        rollouts_from_batch(td, need_targets=True)


def test_prompt_not_left_padded():
    td = valid()
    mask = td["attention_mask"].clone()
    mask[0, :P] = torch.tensor([1, 0, 1, 1])
    _set_attention(td, mask)
    with pytest.raises(BatchError, match="attention_mask.*left-padded"):
        rollouts_from_batch(td, need_targets=True)


def test_response_not_right_padded():
    td = valid()
    mask = td["attention_mask"].clone()
    mask[1, P:] = torch.tensor([1, 1, 0, 1, 1])
    _set_attention(td, mask)
    with pytest.raises(BatchError, match="attention_mask.*right-padded"):
        rollouts_from_batch(td, need_targets=True)


def test_attention_mask_not_binary():
    td = valid()
    td["attention_mask"][0, P] = 2
    with pytest.raises(BatchError, match="attention_mask"):
        rollouts_from_batch(td, need_targets=True)


def test_float_and_bool_attention_masks_accepted():
    td = valid()
    td["attention_mask"] = td["attention_mask"].float()
    assert rollouts_from_batch(td, need_targets=True).prompt_lens.tolist() == PL
    td["attention_mask"] = td["attention_mask"].bool()
    assert rollouts_from_batch(td, need_targets=True).response_lens.tolist() == RL


@pytest.mark.parametrize("bad", [0.5, 1.5])
def test_fractional_attention_mask_rejected(bad):
    td = valid()
    mask = td["attention_mask"].float()
    col = 0 if bad < 1 else P - 1  # row 1 has one prompt token: column 0 is padding, P-1 is real
    mask[1, col] = bad
    td["attention_mask"] = mask
    with pytest.raises(BatchError, match="attention_mask"):
        rollouts_from_batch(td, need_targets=True)


def _empty_prompt_batch():
    td = valid()
    mask = td["attention_mask"].clone()
    mask[1, :P] = 0
    _set_attention(td, mask)
    return td


def test_empty_prompt_row_raises():
    with pytest.raises(BatchError, match="prompt"):
        rollouts_from_batch(_empty_prompt_batch(), need_targets=True)


def test_empty_prompt_row_message_names_attention_mask():
    with pytest.raises(BatchError, match="attention_mask"):
        rollouts_from_batch(_empty_prompt_batch(), need_targets=True)


@pytest.mark.parametrize("where", ["prompt", "response"])
def test_token_id_out_of_vocab(where):
    td = valid()
    col = P - 1 if where == "prompt" else P
    td["input_ids"][3, col] = VOCAB
    td["responses"] = td["input_ids"][:, -R:].clone()
    rollouts_from_batch(td, need_targets=True)  # no vocabulary given: not checked
    with pytest.raises(BatchError, match="input_ids"):
        rollouts_from_batch(td, need_targets=True, vocab_size=VOCAB)


def test_negative_token_id():
    td = valid()
    td["input_ids"][0, P - 1] = -1
    with pytest.raises(BatchError, match="input_ids"):
        rollouts_from_batch(td, need_targets=True, vocab_size=VOCAB)


@pytest.mark.parametrize("col", [P - 1, P])
def test_bad_position_ids(col):
    td = valid()
    td["position_ids"][0, col] += 1
    with pytest.raises(BatchError, match="position_ids"):
        rollouts_from_batch(td, need_targets=True)


def test_position_ids_not_restarting_at_zero():
    td = valid()
    td["position_ids"] = torch.arange(P + R).expand(len(PL), -1).clone()  # right-padded style positions
    with pytest.raises(BatchError, match="position_ids"):
        rollouts_from_batch(td, need_targets=True)


def test_responses_not_tail_of_input_ids():
    td = valid()
    td["responses"][1, 0] = (td["responses"][1, 0] + 1) % VOCAB
    with pytest.raises(BatchError, match="responses"):
        rollouts_from_batch(td, need_targets=True)


def test_responses_wrong_width():
    td = valid()
    td["responses"] = td["input_ids"].clone()  # R == T is not allowed
    with pytest.raises(BatchError, match="responses"):
        rollouts_from_batch(td, need_targets=True)


def test_response_mask_marks_padding():
    td = make_batch(PL, RL, P, R, response_mask=True)
    td["response_mask"][0, RL[0]] = 1  # first padding token of row 0
    with pytest.raises(BatchError, match="response_mask"):
        rollouts_from_batch(td, need_targets=True)


def test_response_mask_wrong_shape():
    td = valid()
    td["response_mask"] = torch.ones(len(PL), R - 1)
    with pytest.raises(BatchError, match="response_mask"):
        rollouts_from_batch(td, need_targets=True)


def test_batch_error_is_value_error():
    assert issubclass(BatchError, ValueError)


# ---------------------------------------------------------------- mini_batch_indices

def test_mini_batch_indices_cover_each_row_once_per_epoch():
    n, size, epochs = 12, 4, 3
    batches = mini_batch_indices(n, size, epochs, shuffle=True, seed=7, call_index=2)
    assert len(batches) == epochs * n // size
    assert all(len(b) == size for b in batches)
    per_epoch = n // size
    for e in range(epochs):
        rows = torch.cat(batches[e * per_epoch:(e + 1) * per_epoch])
        assert sorted(rows.tolist()) == list(range(n))
    # Epochs are reshuffled.
    orders = [torch.cat(batches[e * per_epoch:(e + 1) * per_epoch]).tolist() for e in range(epochs)]
    assert len({tuple(o) for o in orders}) > 1


def test_mini_batch_indices_deterministic():
    a = mini_batch_indices(32, 8, 2, shuffle=True, seed=3, call_index=5)
    b = mini_batch_indices(32, 8, 2, shuffle=True, seed=3, call_index=5)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


def test_mini_batch_indices_vary_with_call_index_and_seed():
    base = torch.cat(mini_batch_indices(32, 8, 1, shuffle=True, seed=3, call_index=0))
    other_call = torch.cat(mini_batch_indices(32, 8, 1, shuffle=True, seed=3, call_index=1))
    other_seed = torch.cat(mini_batch_indices(32, 8, 1, shuffle=True, seed=4, call_index=0))
    assert not torch.equal(base, other_call)
    assert not torch.equal(base, other_seed)
    assert sorted(other_call.tolist()) == list(range(32))


def test_mini_batch_indices_without_shuffle():
    batches = mini_batch_indices(6, 2, 2, shuffle=False, seed=None)
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [4, 5]] * 2
    assert torch.equal(torch.cat(mini_batch_indices(6, 3, 1, shuffle=False, seed=1, call_index=9)),
                       torch.arange(6))


def test_mini_batch_indices_not_a_multiple():
    with pytest.raises(BatchError, match="ppo_mini_batch_size"):
        mini_batch_indices(10, 4, 1, shuffle=True, seed=0)


# ---------------------------------------------------------------- dp_shards

@pytest.mark.parametrize("n,dp", [(12, 1), (12, 3), (12, 4), (8, 8)])
def test_dp_shards_are_a_partition_of_equal_counts(n, dp):
    lens = torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(n + dp))
    shards = dp_shards(lens, dp)
    assert len(shards) == dp and all(len(s) == n // dp for s in shards)
    assert sorted(torch.cat(shards).tolist()) == list(range(n))
    assert all(torch.equal(a, b) for a, b in zip(shards, dp_shards(lens.clone(), dp)))  # the same on every rank


@pytest.mark.parametrize("max_prompt, max_response", [(32, 128), (1024, 8192)])
def test_dp_shards_balance_the_bench_rollouts_over_4_ranks(max_prompt, max_response):
    """The bench's long-tailed rollouts (32, as its default run): the token spread between DP=4 ranks stays
    within one rollout's length, where contiguous shares are far apart; values computed shard by shard come
    back in input order."""
    from megacritic.bench import rollouts

    batch = rollouts(32, 64, max_prompt, max_response)
    lens = batch["attention_mask"].sum(1)
    shards = dp_shards(lens, 4)
    tokens = [int(lens[s].sum()) for s in shards]
    assert max(tokens) - min(tokens) <= int(lens.max())
    contiguous = [int(c.sum()) for c in lens.chunk(4)]
    assert max(tokens) - min(tokens) < max(contiguous) - min(contiguous)
    # each rank computes a value per row of its shard; the gather concatenates the shards in rank order
    gathered = torch.cat([lens[s] * 10 for s in shards])
    assert torch.equal(gathered[reverse_index([s.tolist() for s in shards])], lens * 10)


@pytest.mark.parametrize("n, dp, unit", [(16, 2, 2), (24, 4, 3), (32, 4, 4), (8, 2, 4)])
def test_dp_shards_deal_whole_groups_in_order(n, dp, unit):
    """Fixed-size micro-batches: each rank gets whole groups of `unit` consecutive rows (the micro-batches one
    process would run), equal counts of them, balanced within one group's tokens."""
    lens = torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(n * dp + unit))
    shards = dp_shards(lens, dp, unit)
    assert sorted(torch.cat(shards).tolist()) == list(range(n)) and all(len(s) == n // dp for s in shards)
    groups = lens.reshape(-1, unit).sum(1)
    for s in shards:
        for chunk in s.split(unit):  # the rank's own fixed-size micro-batches
            assert chunk[0] % unit == 0 and torch.equal(chunk, chunk[0] + torch.arange(unit))
    tokens = [int(lens[s].sum()) for s in shards]
    assert max(tokens) - min(tokens) <= int(groups.max())


def test_dp_shards_not_divisible():
    with pytest.raises(BatchError, match="data-parallel"):
        dp_shards(torch.arange(10), 4)
    with pytest.raises(BatchError, match="groups of 4"):
        dp_shards(torch.arange(12), 2, unit=4)


# ---------------------------------------------------------------- verl 0.9's no-padding layout


def no_padding(batch: TensorDict) -> TensorDict:
    """The batch as verl 0.9's trainer sends it (``left_right_2_no_padding``): input_ids and position_ids as
    jagged nested tensors of the real tokens, the rest still padded, plus verl's non-tensor extras."""
    out = batch.clone()
    real = out["attention_mask"].bool()
    lens = real.sum(1)
    offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    for key in ("input_ids", "position_ids"):
        padded = out.pop(key)
        out[key] = torch.nested.nested_tensor_from_jagged(padded[real], offsets=offsets)
    if "response_mask" in out.keys():
        out["loss_mask"] = out["response_mask"]
    out.set_non_tensor("max_seq_len", real.shape[1])
    return out


def test_no_padding_batch_gives_the_padded_rollouts():
    padded = make_batch(PL, RL, P, R, response_mask=True)
    padded["response_mask"][1, 2] = 0  # a tool token inside the response
    nested = no_padding(padded)
    assert nested["input_ids"].is_nested
    for need_targets in (True, False):
        a = rollouts_from_batch(padded, need_targets, vocab_size=VOCAB)
        b = rollouts_from_batch(FakeDataProto(nested), need_targets, vocab_size=VOCAB)
        assert a.tensors().keys() == b.tensors().keys()
        for key, value in a.tensors().items():
            assert torch.equal(value, b.tensors()[key]), key
            assert value.dtype == b.tensors()[key].dtype, key


def test_no_padding_batch_with_the_prompts_key():
    padded = make_batch(PL, RL, P, R)
    padded["input_ids"][:, :P] += 7 * (1 - padded["attention_mask"][:, :P])  # pad ids that are not 0
    padded["prompts"] = padded["input_ids"][:, :P].clone()
    a, b = rollouts_from_batch(padded, True), rollouts_from_batch(no_padding(padded), True)
    assert torch.equal(a.input_ids, b.input_ids)


def test_no_padding_batch_needs_the_attention_mask():
    nested = no_padding(valid())
    del nested["attention_mask"]
    with pytest.raises(BatchError, match="attention_mask"):
        rollouts_from_batch(nested, True)


def test_no_padding_batch_whose_rows_disagree_with_the_mask():
    nested = no_padding(valid())
    mask = nested["attention_mask"].clone()
    mask[0, P] = 1 - mask[0, P]
    nested["attention_mask"] = mask
    with pytest.raises(BatchError, match=r"input_ids \(nested\) rows \[0\]"):
        rollouts_from_batch(nested, True)


def test_no_padding_batch_needs_nested_position_ids():
    padded = valid()
    nested = no_padding(padded)
    nested["position_ids"] = torch.nested.as_nested_tensor(
        [torch.zeros(int(n), dtype=torch.int64) + 1 for n in padded["attention_mask"].sum(1)], layout=torch.jagged)
    with pytest.raises(BatchError, match="position_ids"):
        rollouts_from_batch(nested, True)  # positions must count real tokens from 0, as in the padded layout


def test_nested_token_values_sit_before_each_response_token():
    rollouts = rollouts_from_batch(valid(), False)
    values = torch.randn(len(rollouts), R) * rollouts.response_mask
    nested = nested_token_values(values, rollouts)
    assert nested.is_nested and nested.offsets().diff().tolist() == rollouts.seq_lens.tolist()
    flat, offsets = nested.values(), nested.offsets()
    for row, (p, r) in enumerate(zip(rollouts.prompt_lens.tolist(), rollouts.response_lens.tolist())):
        tokens = flat[offsets[row]:offsets[row + 1]]
        # verl's no_padding_2_padding reads token P - 1 + i for response token i
        assert torch.equal(tokens[p - 1:p - 1 + r], values[row, :r])
        assert not tokens[:p - 1].any() and not tokens[p - 1 + r:].any()


def test_critic_worker_gives_the_same_values_and_loss_for_both_layouts():
    from megacritic import CriticWorker, load_config
    from megacritic.config import TINY_MODEL_OVERRIDES
    from megacritic.data.sources import SyntheticRollouts

    config = load_config([*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4", "ppo_micro_batch_size_per_gpu=2",
                          "model.num_hidden_layers=2", "data.response_length=[2,10]"])
    padded = SyntheticRollouts(config).batch(0)
    r = padded["responses"].shape[1]
    padded["response_mask"] = padded["attention_mask"][:, -r:].clone()
    results = []
    for layout in (lambda b: b, no_padding):
        worker = CriticWorker(config)
        worker.init_model()
        try:
            batch = padded.clone()
            values = worker.compute_values(layout(batch))
            batch["values"] = values
            metrics = worker.update_critic(layout(batch))
            results.append((values, metrics, worker.compute_values(layout(batch))))
        finally:
            worker.close()
    (values_a, metrics_a, after_a), (values_b, metrics_b, after_b) = results
    assert values_b.shape == values_a.shape and values_b.dtype == torch.float32
    assert torch.equal(values_a, values_b)
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac"):
        assert metrics_a[key] == metrics_b[key], key
    assert torch.equal(after_a, after_b)
