"""model.cuda_graphs: packs padded to a few lengths and replayed through the decoder's graphs.

On the CPU the "graphs" re-run what they captured (megacritic.model.cuda_graphs), so this checks everything
but the capture itself (tests/test_gpu.py): the fixed-shape packs (a trailing dummy rollout, empty
boundary slots), the static buffers refilled per micro-batch, and the gradients routed back to the
parameters through autograd and Megatron's hooks. Padding changes the shapes the float32 kernels see, so
the comparison with the unpadded run is to float32 rounding (1e-5 relative), not bitwise; the padded run
with and without graphs runs the same kernels on the same shapes and is compared bit for bit.
"""

import logging

import pytest
import torch

from megacritic import CriticWorker, load_config
from megacritic.config import ConfigError, TINY_MODEL_OVERRIDES
from megacritic.data.sources import SyntheticRollouts
from megacritic.model.cuda_graphs import DecoderGraphs
from megacritic.packing.micro_batches import MicroBatchPolicy

BASE = [*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4", "use_dynamic_bsz=true",
        "ppo_max_token_len_per_gpu=64", "forward_max_token_len_per_gpu=96", "model.num_hidden_layers=2",
        "data.response_length=[2,20]", "shuffle=false", "model.dtype=float32", "model.cuda_graph_max_rollouts=6",
        "model.cuda_graph_pack_multiple=16"]


def _run(extra, calls=2):
    worker = CriticWorker(load_config(BASE + extra))
    worker.init_model()
    try:
        batch = SyntheticRollouts(worker.config).batch(0)
        batch["values"] = worker.compute_values(batch)
        metrics = [worker.update_critic(batch) for _ in range(calls)]
        values = worker.compute_values(batch)
        params = [p for chunk in worker.state.model for p in chunk.parameters()]
        grads = [p.main_grad.clone() for p in params]  # the last mini-batch's
        weights = [p.detach().clone() for p in params]
        graphs = [chunk.module.decoder.forward for chunk in worker.state.model]
        captured = [sorted(g.graphs) for g in graphs if isinstance(g, DecoderGraphs)]
        replays = sum(g.replays for g in graphs if isinstance(g, DecoderGraphs))
        return batch["values"], values, metrics, grads, weights, captured, replays
    finally:
        worker.close()


@pytest.fixture(scope="module")
def eager():
    return _run([])


@pytest.fixture(scope="module")
def padded_eager():
    """The fixed-shape packs of model.cuda_graphs, every one run eagerly."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecoderGraphs, "_fits", lambda *args: False)
        return _run(["model.cuda_graphs=true"])


@pytest.fixture(scope="module")
def graphed():
    return _run(["model.cuda_graphs=true"])


def _close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def test_graphs_were_captured_per_pack_length(graphed, padded_eager):
    (keys,) = graphed[5]
    train = [n for grad, n in keys if grad]
    forward = [n for grad, n in keys if not grad]
    # every length a pack can be padded to (multiples of 16 up to the budget), captured at the first use
    assert train == [16, 32, 48, 64] and forward == [16, 32, 48, 64, 80, 96]
    assert padded_eager[5] == [[]]
    assert graphed[6] > 0 and padded_eager[6] == 0


def test_graphed_equals_the_same_padded_packs_run_eagerly(graphed, padded_eager):
    _close([graphed[0], graphed[1]], [padded_eager[0], padded_eager[1]], 0, 0)
    _close(graphed[3], padded_eager[3], 0, 0)
    _close(graphed[4], padded_eager[4], 0, 0)
    for got, want in zip(graphed[2], padded_eager[2]):
        assert {k: v for k, v in got.items() if k.startswith("critic/")} == \
            {k: v for k, v in want.items() if k.startswith("critic/")}


def test_graphed_equals_unpadded_to_float32_rounding(graphed, eager):
    _close([graphed[0], graphed[1]], [eager[0], eager[1]])
    _close(graphed[3], eager[3])
    _close(graphed[4], eager[4])
    for got, want in zip(graphed[2], eager[2]):
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key


def test_fixed_packs_fill_the_budget_and_the_slots():
    config = load_config(BASE + ["model.cuda_graphs=true"])
    from megacritic.data.rollouts import rollouts_from_batch
    from megacritic.parallel import ParallelLayout
    policy = MicroBatchPolicy.from_config(config, ParallelLayout.from_config(config.megatron, 1))
    rollouts = rollouts_from_batch(SyntheticRollouts(config).batch(0), need_targets=False)
    for forward_only, budget in ((False, 64), (True, 96)):
        parts = policy.plan(rollouts.seq_lens, forward_only, lambda n: n)
        for mb, part in zip(policy.build(rollouts, parts, weights=None, device=None, cp_rank=0,
                                         forward_only=forward_only), parts):
            real = int(rollouts.seq_lens[part].sum())
            length = min(-(-real // 16) * 16, budget)
            assert mb.input_ids.shape == (1, length)
            cu = mb.packed.cu_seqlens_q
            assert cu.numel() == 6 + 2 and int(cu[-1]) == length
            assert int(cu[len(part)]) == real and mb.tokens == real
            assert bool((cu[1:] >= cu[:-1]).all())


@pytest.mark.parametrize("extra, message", [
    (["model.use_remove_padding=false"], "use_remove_padding"),
    (["use_dynamic_bsz=false", "ppo_micro_batch_size_per_gpu=2"], "use_dynamic_bsz"),
    (["megatron.tensor_model_parallel_size=2"], "tensor_model_parallel_size=1"),
    (["megatron.pipeline_model_parallel_size=2"], "pipeline_model_parallel_size=1"),
    (["megatron.recompute_granularity=selective"], "recompute"),
    (["megatron.param_offload=true"], "param_offload"),
    (["megatron.grad_offload=true"], "grad_offload"),
    (["model.cuda_graph_max_rollouts=0"], "cuda_graph_max_rollouts"),
    (["model.cuda_graph_pack_multiple=0"], "cuda_graph_pack_multiple"),
])
def test_settings_it_cannot_run_with_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(BASE + ["model.cuda_graphs=true"] + extra)


def test_a_pack_with_more_rollouts_than_slots_runs_eagerly_unpadded_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="megacritic.model.cuda_graphs"):
        result = _run(["model.cuda_graphs=true", "model.cuda_graph_max_rollouts=1"], calls=1)
    assert "more than model.cuda_graph_max_rollouts=1" in caplog.text
    config = load_config(BASE + ["model.cuda_graphs=true", "model.cuda_graph_max_rollouts=1"])
    from megacritic.data.rollouts import rollouts_from_batch
    from megacritic.parallel import ParallelLayout
    policy = MicroBatchPolicy.from_config(config, ParallelLayout.from_config(config.megatron, 1))
    rollouts = rollouts_from_batch(SyntheticRollouts(config).batch(0), need_targets=False)
    parts = policy.plan(rollouts.seq_lens, False, lambda n: n)
    for mb, part in zip(policy.build(rollouts, parts, weights=None, device=None, cp_rank=0), parts):
        if len(part) > 1:  # not padded: its own length and boundaries
            assert mb.input_ids.shape[1] == int(rollouts.seq_lens[part].sum())
            assert mb.packed.cu_seqlens_q.numel() == len(part) + 1


def test_graphs_are_captured_again_when_the_parameters_move(caplog):
    worker = CriticWorker(load_config(BASE + ["model.cuda_graphs=true"]))
    worker.init_model()
    try:
        batch = SyntheticRollouts(worker.config).batch(0)
        before = worker.compute_values(batch)
        graphs = worker.state.model[0].module.decoder.forward
        captured = dict(graphs.graphs)
        layer = worker.state.model[0].module.decoder.layers[0]
        weight = layer.mlp.linear_fc1.weight
        weight.data = weight.data.clone()  # what an offload and onload do to the storage's address
        with caplog.at_level(logging.INFO, logger="megacritic.model.cuda_graphs"):
            after = worker.compute_values(batch)
        assert "moved; capturing again" in caplog.text
        assert all(graphs.graphs[key] is not captured[key] for key in captured if key in graphs.graphs)
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    finally:
        worker.close()


def test_graph_lengths_are_the_multiples_up_to_the_budget_and_the_budget():
    config = load_config(BASE + ["model.cuda_graphs=true", "forward_max_token_len_per_gpu=100"])
    from megacritic.parallel import ParallelLayout
    policy = MicroBatchPolicy.from_config(config, ParallelLayout.from_config(config.megatron, 1))
    assert policy.graph_lengths(forward_only=True) == [16, 32, 48, 64, 80, 96, 100]
    assert [policy.graph_length(n, True) for n in (1, 16, 17, 97, 100)] == [16, 16, 32, 100, 100]


def test_a_replay_between_a_packs_forward_and_backward_is_an_error():
    """The graphs share one memory pool: a second pack's forward may overwrite the first's activations."""
    from megacritic.data.rollouts import rollouts_from_batch

    worker = CriticWorker(load_config(BASE + ["model.cuda_graphs=true"]))
    worker.init_model()
    try:
        rollouts = rollouts_from_batch(SyntheticRollouts(worker.config).batch(0), need_targets=False)
        policy = MicroBatchPolicy.from_config(worker.config, worker.layout)
        parts = policy.plan(rollouts.seq_lens, False, lambda n: n)
        first, second = policy.build(rollouts, parts[:2], weights=None, device=None, cp_rank=0)
        model = worker.state.model[0]
        model.train()
        outs = [model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None,
                      packed_seq_params=mb.packed) for mb in (first, second)]
        assert model.module.decoder.forward.replays == 2
        with pytest.raises(RuntimeError, match="between a pack's forward and its backward"):
            outs[0].sum().backward()
    finally:
        worker.close()
