"""megacritic.model.weights: Hugging Face names and shapes, seeded initialisation, and the exact
Megatron tensor-parallel layouts built from full tensors (pure tensor logic, no process group)."""

from __future__ import annotations

import pytest
import torch

from megacritic.config import ModelConfig, tiny_model
from megacritic.model.value_model import padded_vocab_size
from megacritic.model.weights import (TensorSource, WholeTensors, _fused_qkv, hf_from_megatron, hf_shapes,
                                      megatron_tensor, seeded_initializer, tensor_source)

# --------------------------------------------------------------------------------------------------
# hf_shapes


def _expected_names(layers: int, bias: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight", "score.weight", "score.bias"}
    for i in range(layers):
        p = f"model.layers.{i}."
        names |= {p + n for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
        if bias:
            names |= {p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"}
    return names


@pytest.mark.parametrize("bias", [True, False])
def test_hf_shapes_names_and_shapes(bias):
    m = tiny_model(vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, attention_bias=bias)
    shapes = hf_shapes(m)
    assert set(shapes) == _expected_names(3, bias)
    hd = 24 // 6
    assert shapes["model.embed_tokens.weight"] == (50, 24)
    assert shapes["model.norm.weight"] == (24,)
    assert shapes["score.weight"] == (1, 24)
    assert shapes["score.bias"] == (1,)
    for i in range(3):
        p = f"model.layers.{i}."
        assert shapes[p + "input_layernorm.weight"] == (24,)
        assert shapes[p + "post_attention_layernorm.weight"] == (24,)
        assert shapes[p + "self_attn.q_proj.weight"] == (6 * hd, 24)
        assert shapes[p + "self_attn.k_proj.weight"] == (2 * hd, 24)
        assert shapes[p + "self_attn.v_proj.weight"] == (2 * hd, 24)
        assert shapes[p + "self_attn.o_proj.weight"] == (24, 6 * hd)
        assert shapes[p + "mlp.gate_proj.weight"] == (40, 24)
        assert shapes[p + "mlp.up_proj.weight"] == (40, 24)
        assert shapes[p + "mlp.down_proj.weight"] == (24, 40)
        if bias:
            assert shapes[p + "self_attn.q_proj.bias"] == (6 * hd,)
            assert shapes[p + "self_attn.k_proj.bias"] == (2 * hd,)
            assert shapes[p + "self_attn.v_proj.bias"] == (2 * hd,)


def test_hf_shapes_explicit_head_dim():
    m = tiny_model(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=1)
    shapes = hf_shapes(m)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 16)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 16)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (16, 32)


# --------------------------------------------------------------------------------------------------
# seeded_initializer


def test_seeded_initializer_shapes_and_kinds():
    m = tiny_model(attention_bias=True)
    full = seeded_initializer(m, 0)
    for name, shape in hf_shapes(m).items():
        t = full(name)
        assert tuple(t.shape) == shape, name
        assert t.dtype == torch.float32, name
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones(shape)), name
        elif name.endswith(".bias"):
            assert torch.equal(t, torch.zeros(shape)), name
        else:
            assert t.std() > 0, name
    with pytest.raises(KeyError):
        full("model.layers.99.mlp.up_proj.weight")


def test_seeded_initializer_deterministic_per_seed_and_name():
    m = tiny_model()
    a, b, c = seeded_initializer(m, 7), seeded_initializer(m, 7), seeded_initializer(m, 8)
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    # Same (seed, name): same tensor, whatever was drawn before (b draws in reverse order).
    first = {n: a(n) for n in names}
    for n in reversed(names):
        assert torch.equal(b(n), first[n]), n
        assert torch.equal(a(n), first[n]), n  # repeated calls too
    # Different seeds differ; different names differ.
    for n in names:
        assert not torch.equal(c(n), first[n]), n
    q0, q1 = first["model.layers.0.self_attn.q_proj.weight"], first["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(q0, q1)
    gate, up = a("model.layers.0.mlp.gate_proj.weight"), a("model.layers.0.mlp.up_proj.weight")
    assert not torch.equal(gate, up)


def test_seeded_initializer_std():
    m = tiny_model(hidden_size=256, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, init_std=0.02, value_head_init_std=1.0)
    full = seeded_initializer(m, 3)
    w = full("model.layers.0.mlp.gate_proj.weight")  # 262144 draws
    assert abs(w.std().item() - 0.02) < 0.02 * 0.02
    assert abs(w.mean().item()) < 0.02 * 0.02
    score = full("score.weight")  # the value head has its own std (256 draws)
    assert abs(score.std().item() - 1.0) < 0.2


# --------------------------------------------------------------------------------------------------
# megatron_tensor / _fused_qkv layouts


def _arange_full(m: ModelConfig):
    """Dict-backed ``full``: every HF tensor distinct and arange-valued, so layouts check exactly."""
    tensors, offset = {}, 0
    for name, shape in hf_shapes(m).items():
        n = 1
        for s in shape:
            n *= s
        tensors[name] = torch.arange(offset, offset + n, dtype=torch.float64).reshape(shape)
        offset += n
    return tensors, tensors.__getitem__


# (heads, groups): GQA, MHA, and one allowing TP=4.
CONFIGS = [(4, 2), (4, 4), (8, 4)]


def _model(heads, groups, bias=True):
    return tiny_model(vocab_size=10, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=groups, head_dim=2, attention_bias=bias)


def _cases():
    return [pytest.param(heads, groups, tp, id=f"h{heads}g{groups}-tp{tp}")
            for heads, groups in CONFIGS for tp in (1, 2, 4) if groups % tp == 0]


def _shards(name, layer, full, m, tp):
    padded = padded_vocab_size(m.vocab_size, tp)
    return [megatron_tensor(name, layer, full, m, r, tp, padded) for r in range(tp)]


def _qkv_layout(q, k, v, groups, heads, hd):
    """Megatron's linear_qkv rows built group by group: [q heads of group g; k_g; v_g] for g in order."""
    hpg = heads // groups
    rows = []
    for g in range(groups):
        rows += [q[g * hpg * hd:(g + 1) * hpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    return torch.cat(rows)


@pytest.mark.parametrize("heads,groups,tp", _cases())
def test_embedding_shards(heads, groups, tp):
    m = _model(heads, groups)
    tensors, full = _arange_full(m)
    shards = _shards("embedding.word_embeddings.weight", None, full, m, tp)
    padded = padded_vocab_size(m.vocab_size, tp)
    assert all(s.shape == (padded // tp, m.hidden_size) for s in shards)
    cat = torch.cat(shards)
    assert torch.equal(cat[:m.vocab_size], tensors["model.embed_tokens.weight"])
    assert torch.equal(cat[m.vocab_size:], torch.zeros(padded - m.vocab_size, m.hidden_size, dtype=cat.dtype))
    tp1 = megatron_tensor("embedding.word_embeddings.weight", None, full, m, 0, 1, m.vocab_size)
    assert torch.equal(tp1, tensors["model.embed_tokens.weight"])


def test_padded_vocab_size():
    assert padded_vocab_size(10, 1) == 10
    assert padded_vocab_size(10, 2) == 10
    assert padded_vocab_size(10, 4) == 12
    assert padded_vocab_size(12, 4) == 12


@pytest.mark.parametrize("heads,groups,tp", _cases())
def test_row_parallel_shards(heads, groups, tp):
    m = _model(heads, groups)
    tensors, full = _arange_full(m)
    # Chunk-local layer index 0 holding global layer 1 (as under pipeline parallelism): `layer` decides.
    for local, hf in (("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
                      ("mlp.linear_fc2.weight", "mlp.down_proj.weight")):
        shards = _shards(f"decoder.layers.0.{local}", 1, full, m, tp)
        ref = tensors[f"model.layers.1.{hf}"]
        assert all(s.shape == (ref.shape[0], ref.shape[1] // tp) for s in shards), local
        assert torch.equal(torch.cat(shards, dim=1), ref), local
        assert torch.equal(torch.cat(shards, dim=1), _shards(f"decoder.layers.0.{local}", 1, full, m, 1)[0])


@pytest.mark.parametrize("heads,groups,tp", _cases())
def test_fc1_shards_are_gate_then_up(heads, groups, tp):
    m = _model(heads, groups)
    tensors, full = _arange_full(m)
    gate, up = tensors["model.layers.1.mlp.gate_proj.weight"], tensors["model.layers.1.mlp.up_proj.weight"]
    part = m.intermediate_size // tp
    shards = _shards("decoder.layers.0.mlp.linear_fc1.weight", 1, full, m, tp)
    for r, shard in enumerate(shards):
        expected = torch.cat([gate[r * part:(r + 1) * part], up[r * part:(r + 1) * part]])
        assert torch.equal(shard, expected), r


@pytest.mark.parametrize("kind", ["weight", "bias"])
@pytest.mark.parametrize("heads,groups,tp", _cases())
def test_qkv_shards_megatron_layout(heads, groups, tp, kind):
    m = _model(heads, groups)
    hd = 2
    tensors, full = _arange_full(m)
    q, k, v = (tensors[f"model.layers.1.self_attn.{x}_proj.{kind}"] for x in "qkv")
    layout = _qkv_layout(q, k, v, groups, heads, hd)
    assert layout.shape[0] == (heads + 2 * groups) * hd
    name = f"decoder.layers.0.self_attention.linear_qkv.{kind}"
    tp1 = _shards(name, 1, full, m, 1)[0]
    assert torch.equal(tp1, layout)
    # Rank r holds whole groups r * groups / tp ... (r + 1) * groups / tp - 1 of that layout, in order.
    rows_per_group = (heads // groups + 2) * hd
    per_rank = groups // tp * rows_per_group
    shards = _shards(name, 1, full, m, tp)
    for r, shard in enumerate(shards):
        assert torch.equal(shard, layout[r * per_rank:(r + 1) * per_rank]), r
    # The direct helper agrees.
    for r in range(tp):
        assert torch.equal(_fused_qkv(q, k, v, m, r, tp), shards[r])


def test_qkv_tp2_is_halves_of_groups():
    """The literal example: heads=4, groups=2, head_dim=2, TP=2 -> rank 0 = group 0, rank 1 = group 1."""
    m = _model(4, 2)
    tensors, full = _arange_full(m)
    q, k, v = (tensors[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    r0, r1 = _shards(name, 0, full, m, 2)
    assert torch.equal(r0, torch.cat([q[0:4], k[0:2], v[0:2]]))  # q heads 0,1; k head 0; v head 0
    assert torch.equal(r1, torch.cat([q[4:8], k[2:4], v[2:4]]))  # q heads 2,3; k head 1; v head 1
    full_layout = _shards(name, 0, full, m, 1)[0]
    assert torch.equal(torch.cat([r0, r1]), full_layout)


def test_replicated_params_and_unknown_name():
    m = _model(4, 2)
    tensors, full = _arange_full(m)
    padded = padded_vocab_size(m.vocab_size, 2)
    for r in range(2):
        def get(name, layer=None):
            return megatron_tensor(name, layer, full, m, r, 2, padded)

        assert torch.equal(get("decoder.final_layernorm.weight"), tensors["model.norm.weight"])
        assert torch.equal(get("output_layer.weight"), tensors["score.weight"])
        assert torch.equal(get("output_layer.bias"), tensors["score.bias"])
        assert torch.equal(get("decoder.layers.0.input_layernorm.weight", 1),
                           tensors["model.layers.1.input_layernorm.weight"])
        assert torch.equal(get("decoder.layers.0.pre_mlp_layernorm.weight", 1),
                           tensors["model.layers.1.post_attention_layernorm.weight"])
    with pytest.raises(KeyError):
        megatron_tensor("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", 0, full, m, 0, 1, 10)


def test_qkv_without_attention_bias_has_no_bias_source():
    m = _model(4, 2, bias=False)
    _, full = _arange_full(m)
    qkv = megatron_tensor("decoder.layers.0.self_attention.linear_qkv.weight", 0, full, m, 0, 1, 10)
    assert qkv.shape == ((4 + 2 * 2) * 2, m.hidden_size)
    with pytest.raises(KeyError):
        megatron_tensor("decoder.layers.0.self_attention.linear_qkv.bias", 0, full, m, 0, 1, 10)


# --------------------------------------------------------------------------------------------------
# TensorSource


class _CountingSource:
    """A TensorSource that records which reads it served."""

    def __init__(self, tensors):
        self.tensors, self.whole, self.slices = tensors, [], []

    def __call__(self, name):
        self.whole.append(name)
        return self.tensors[name]

    def read_slice(self, name, dim, start, stop):
        self.slices.append(name)
        return self.tensors[name].narrow(dim, start, stop - start)


def test_tensor_sources():
    m = _model(4, 2)
    seeded = seeded_initializer(m, 3)
    assert isinstance(seeded, TensorSource)
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(seeded.read_slice(name, 1, 2, 6), seeded(name)[:, 2:6])
    tensors, get = _arange_full(m)
    wrapped = tensor_source(get)  # a plain function of the name
    assert isinstance(wrapped, WholeTensors) and isinstance(wrapped, TensorSource)
    assert torch.equal(wrapped.read_slice(name, 0, 1, 3), tensors[name][1:3])
    counting = _CountingSource(tensors)
    assert tensor_source(counting) is counting


def test_sharded_parameters_read_slices_only():
    """A TP rank asks a source that reads slices for its rows alone: whole reads only for tensors every rank
    holds whole."""
    m = _model(4, 2)
    tensors, _ = _arange_full(m)
    source = _CountingSource(tensors)
    for local in ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
                  "mlp.linear_fc2.weight"):
        megatron_tensor(f"decoder.layers.0.{local}", 1, source, m, 1, 2, padded_vocab_size(m.vocab_size, 2))
    megatron_tensor("embedding.word_embeddings.weight", None, source, m, 1, 2, padded_vocab_size(m.vocab_size, 2))
    assert source.whole == [] and len(source.slices) == 3 + 1 + 2 + 1 + 1
    megatron_tensor("decoder.layers.0.input_layernorm.weight", 1, source, m, 1, 2, 10)
    assert source.whole == ["model.layers.1.input_layernorm.weight"]


def test_unknown_parameter_has_no_hf_name():
    m = _model(4, 2)
    for name in ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "embedding.position_embeddings.weight"):
        with pytest.raises(KeyError, match="no Hugging Face name"):
            hf_from_megatron(name, 0, [torch.zeros(1)], m)
