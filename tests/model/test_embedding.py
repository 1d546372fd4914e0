"""The embedding's weight gradient added straight to main_grad (megacritic.model.embedding): the looked-up rows'
gradients land in the buffer as their exact sum rounded once to its dtype, every other row untouched, and a
critic's gradients and values are those of Megatron's own embedding (which the parity matrix then checks at
every layout, tensor-parallel masking included)."""

import pytest
import torch
import torch.nn.functional as F

from megacritic import CriticWorker, load_config
from megacritic.config import TINY_MODEL_OVERRIDES
from megacritic.data.sources import SyntheticRollouts
from megacritic.model.embedding import MainGradEmbedding, _LookupIntoMainGrad
from megacritic.model.grad_buffer import accumulates_into_main_grad

VOCAB, HIDDEN = 64, 24


def _weight(dtype):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN).to(dtype))
    weight.main_grad = torch.randn(VOCAB, HIDDEN)  # float32, as DDP's buffer: earlier micro-batches' sum
    weight.grad_added_to_main_grad = False
    return weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lookup_adds_the_rows_exact_sum_to_main_grad(dtype):
    weight = _weight(dtype)
    start = weight.main_grad.clone()
    ids = torch.tensor([[3, 7, 3, 3, 60], [7, 0, 3, 59, 7]])  # repeated rows, two sequences
    upstream = torch.randn(*ids.shape, HIDDEN).to(dtype)

    out = _LookupIntoMainGrad.apply(ids, weight)
    assert out.dtype == dtype and torch.equal(out, F.embedding(ids, weight.detach()))
    out.backward(upstream)

    expected = start.double().index_add(0, ids.reshape(-1), upstream.reshape(-1, HIDDEN).double())
    used = torch.zeros(VOCAB, dtype=torch.bool)
    used[ids.reshape(-1)] = True
    # each used row: a few float32 additions of values of size ~1 (rounding ~6e-8 relative each)
    torch.testing.assert_close(weight.main_grad[used].double(), expected[used], rtol=0, atol=5e-7)
    assert torch.equal(weight.main_grad[~used], start[~used])
    assert weight.grad_added_to_main_grad  # DDP's hook must not add the placeholder gradient
    assert weight.grad is not None and weight.grad.shape == weight.shape  # its hook still runs


def test_the_sum_is_rounded_once_not_per_micro_batch():
    """With bf16 weights the dense path rounds each micro-batch's row sums to bf16 before adding them to
    main_grad; this path adds them in float32: closer to the exact sum."""
    weight = _weight(torch.bfloat16)
    weight.main_grad.zero_()
    ids = torch.full((1, 256), 5)  # one row looked up 256 times: a long sum
    upstream = (1 + torch.rand(1, 256, HIDDEN)).to(torch.bfloat16)
    _LookupIntoMainGrad.apply(ids, weight).backward(upstream)
    exact = upstream[0].double().sum(0)
    dense = upstream[0].float().sum(0).to(torch.bfloat16).double()  # the dense path's rounding
    ours = weight.main_grad[5].double()
    assert (ours - exact).abs().max() < 1e-4 < (dense - exact).abs().max()


def test_only_parameters_with_a_gradient_buffer_take_the_path():
    weight = _weight(torch.float32)
    assert accumulates_into_main_grad(weight)
    plain = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN))
    assert not accumulates_into_main_grad(plain)  # no DDP: torch's own gradient
    frozen = _weight(torch.float32)
    frozen.requires_grad_(False)
    assert not accumulates_into_main_grad(frozen)


BASE = [*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=8", "use_dynamic_bsz=true",
        "ppo_max_token_len_per_gpu=64", "model.num_hidden_layers=2", "data.response_length=[2,20]",
        "shuffle=false", "model.dtype=float32"]


def _one_step(monkeypatch, main_grad_path: bool):
    if not main_grad_path:  # Megatron's own embedding: dense gradient, added by DDP's hook
        monkeypatch.setattr("megacritic.model.value_model.lookup_into_main_grad", lambda embedding: None)
    worker = CriticWorker(load_config(BASE))
    worker.init_model()
    try:
        embedding = worker.state.model[0].module.embedding.word_embeddings
        assert isinstance(embedding, MainGradEmbedding) == main_grad_path
        batch = SyntheticRollouts(worker.config).batch(0)
        values = worker.compute_values(batch)
        batch["values"] = values
        metrics = worker.update_critic(batch)  # one mini-batch of several micro-batches: one optimizer step
        grads = {n: p.main_grad.clone() for n, p in worker.state.model[0].named_parameters()}
        return values, metrics, grads
    finally:
        worker.close()


def test_critic_gradients_equal_megatrons_embedding(monkeypatch):
    values, metrics, grads = _one_step(monkeypatch, True)
    with monkeypatch.context() as m:
        ref_values, ref_metrics, ref_grads = _one_step(m, False)
    assert torch.equal(values, ref_values)  # the forward is the same lookup
    assert metrics["critic/vf_loss"] == ref_metrics["critic/vf_loss"]
    assert grads.keys() == ref_grads.keys()
    name = next(n for n in grads if n.endswith("word_embeddings.weight"))
    # float32 sums of the same terms in another order, over micro-batches: rounding only
    torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7)
    assert torch.equal(grads[name] == 0, ref_grads[name] == 0)  # the same rows untouched
    assert grads[name].abs().sum() > 0
    # the embedding's gradient is the backward's last: every other one is the same arithmetic
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads if n != name)
