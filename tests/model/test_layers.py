"""megacritic.model.layers against float64 references: CoreAttention (also context-parallel, with simulated
ranks), RoPE of packed micro-batches, RMSNorm, ValueHead.

Building these modules needs only a Megatron TransformerConfig (no process group, no parallel state).
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from megacritic.config import MegatronConfig, tiny_model
from megacritic.model.layers import RMSNorm, CoreAttention, ValueHead, apply_rotary
from megacritic.model.value_model import transformer_config
from megacritic.parallel import ParallelLayout


def _config(dtype=torch.float32, *, tp=1, sequence_parallel=False, **model):
    layout = ParallelLayout.from_config(
        MegatronConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel), world_size=tp)
    return transformer_config(tiny_model(**model), layout, dtype=dtype, on_cpu=True)


@pytest.fixture(scope="module")
def config():
    return _config()


@pytest.fixture(scope="module")
def config_bf16():
    return _config(torch.bfloat16)


# --------------------------------------------------------------------------------------------------
# CoreAttention


def _reference_attention(q, k, v, scale=None):
    """Naive causal GQA attention in float64; q [s, b, heads, d], k/v [s, b, groups, d] -> [s, b, heads*d]."""
    s, b, heads, d = q.shape
    groups = k.shape[2]
    q, k, v = (t.double() for t in (q, k, v))
    # Query heads of a group are contiguous: head i uses kv head i // (heads // groups).
    k = k.repeat_interleave(heads // groups, dim=2)
    v = v.repeat_interleave(heads // groups, dim=2)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty(s, b, heads, d, dtype=torch.float64)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for bi in range(b):
        for h in range(heads):
            scores = (q[:, bi, h] @ k[:, bi, h].T) * scale  # [s_q, s_k]
            scores = scores.masked_fill(~causal, float("-inf"))
            out[:, bi, h] = torch.softmax(scores, dim=-1) @ v[:, bi, h]
    return out.reshape(s, b, heads * d)


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("softmax_scale", [None, 0.3])
def test_sdpa_attention_matches_naive_reference(config, heads, groups, softmax_scale):
    s, b, d = 7, 3, 8
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    q = torch.randn(s, b, heads, d, generator=gen)
    k = torch.randn(s, b, groups, d, generator=gen)
    v = torch.randn(s, b, groups, d, generator=gen)
    attn = CoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                        softmax_scale=softmax_scale)
    out = attn(q, k, v, attention_mask=None)
    assert out.shape == (s, b, heads * d)
    assert out.dtype == torch.float32
    ref = _reference_attention(q, k, v, softmax_scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_sdpa_attention_gqa_head_order_matters(config):
    """Guard against a reference that could not tell head orders apart: swapping the kv heads changes
    the output of the query heads that use them."""
    s, b, d = 5, 1, 4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, 4, d, generator=gen)
    k = torch.randn(s, b, 2, d, generator=gen)
    v = torch.randn(s, b, 2, d, generator=gen)
    attn = CoreAttention(config, 1, AttnMaskType.causal, "self")
    out = attn(q, k, v, None).reshape(s, b, 4, d)
    swapped = attn(q, k.flip(2), v.flip(2), None).reshape(s, b, 4, d)
    assert not torch.allclose(out[:, :, :2], swapped[:, :, :2])
    # Heads 0,1 use kv head 0, heads 2,3 use kv head 1.
    torch.testing.assert_close(out[:, :, :2].double(), _reference_attention(q, k, v).reshape(s, b, 4, d)[:, :, :2],
                               rtol=1e-5, atol=1e-6)


def test_sdpa_attention_is_causal(config):
    s, b, h, d = 6, 2, 2, 4
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, b, h, d, generator=gen) for _ in range(3))
    attn = CoreAttention(config, 1, AttnMaskType.causal, "self")
    out = attn(q, k, v, None)
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 10.0
    v2[-1] += 10.0  # changing the last position cannot affect earlier ones
    out2 = attn(q, k2, v2, None)
    torch.testing.assert_close(out[:-1], out2[:-1])
    assert not torch.allclose(out[-1], out2[-1])


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4)])
def test_sdpa_attention_packed_equals_each_sequence_alone(config, heads, groups):
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = CoreAttention(config, 1, AttnMaskType.causal, "self")
    lens, d = [5, 1, 9, 3], 8
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(cu[-1])
    q, k, v = torch.randn(t, heads, d), torch.randn(t, groups, d), torch.randn(t, groups, d)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                             max_seqlen_kv=max(lens))
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (t, heads * d)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each rollout attends only to itself
        ref = _reference_attention(q[a:b, None], k[a:b, None], v[a:b, None]).squeeze(1)
        torch.testing.assert_close(out[a:b].double(), ref, rtol=1e-5, atol=1e-6)


def simulate_context_parallel(attn, q, k, v, cu, cp):
    """Run ``attn``'s context-parallel attention for every rank of a simulated CP group of ``cp`` over
    the pack q [t, heads, d], k/v [t, groups, d] (rollout boundaries ``cu``, multiples of 2 x CP), and put
    the outputs back in pack order. The all-gather is the rank-major concatenation of every rank's keys
    and values; autograd through it sums each key's gradient over ranks, as the reduce-scatter does."""
    from megacritic.packing.context_parallel import context_parallel_split
    from megacritic.packing.pack import ContextParallelPack

    splits = [context_parallel_split(cu, cp, r) for r in range(cp)]
    order = torch.cat([take for take, _ in splits])
    kv = torch.cat([k, v], dim=1)[order]  # what every rank's all-gather returns
    cu32 = cu.to(torch.int32)
    outs = []
    for take, layout in splits:
        params = ContextParallelPack(qkv_format="sbhd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32,
                                     max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
                                     max_seqlen_kv=int((cu[1:] - cu[:-1]).max()),
                                     **{key: x.to(q.device) if torch.is_tensor(x) else x for key, x in layout.items()})
        outs.append(attn.attend_chunks(q[take.to(q.device)], kv, params))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return torch.cat(outs)[inverse.to(q.device)]


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4)])
def test_context_parallel_attention_matches_causal_attention(config, cp, heads, groups):
    """Output and gradients of q, k and v equal plain causal attention over each rollout (in float64)."""
    attn = CoreAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=0.3)
    spans = [2 * cp * n for n in (1, 3, 2, 5)]  # rollouts padded to multiples of 2 x CP (megacritic.packing.micro_batches)
    cu = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()])
    t, d = int(cu[-1]), 8
    gen = torch.Generator().manual_seed(cp * 10 + groups)
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (heads, groups, groups))
    w = torch.randn(t, heads * d, generator=gen)

    def grads(fn, dtype):
        leaves = [x.to(dtype, copy=True).requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        (out * w.to(dtype)).sum().backward()
        return out.detach(), [x.grad for x in leaves]

    def reference(q, k, v):  # each rollout alone, causal, float64
        outs = []
        for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            o = torch.nn.functional.scaled_dot_product_attention(
                q[a:e].transpose(0, 1), k[a:e].transpose(0, 1), v[a:e].transpose(0, 1), is_causal=True,
                scale=0.3, enable_gqa=True)
            outs.append(o.transpose(0, 1).reshape(e - a, -1))
        return torch.cat(outs)

    out, (gq, gk, gv) = grads(lambda q, k, v: simulate_context_parallel(attn, q, k, v, cu, cp), torch.float32)
    ref, (rq, rk, rv) = grads(reference, torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for got, want in ((gq, rq), (gk, rk), (gv, rv)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# RoPE of packed micro-batches (applied by CoreAttention)


def _pack_rotary(lens, d, base=10000.0):
    """Per-token freqs [t, 1, 1, d] of a pack whose positions restart at every rollout, as Megatron builds
    them (the two halves share each frequency)."""
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    pos = torch.cat([torch.arange(n, dtype=torch.float64) for n in lens])
    freqs = torch.outer(pos, inv)
    return torch.cat([freqs, freqs], -1)[:, None, None, :]


def test_packed_rope_is_megatrons_arithmetic_and_rotates_each_rollout_from_position_0():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    torch.manual_seed(0)
    lens, heads, groups, d = [5, 1, 9], 4, 2, 16
    t = sum(lens)
    freqs = _pack_rotary(lens, d)
    q, k = torch.randn(t, heads, d), torch.randn(t, groups, d)
    f32 = freqs.float()
    q2, k2 = apply_rotary(q, k, f32.cos()[:, 0], f32.sin()[:, 0])
    # Bit for bit what Megatron's unfused RoPE computes on [t, 1, heads, d].
    assert torch.equal(q2, _apply_rotary_pos_emb_bshd(q[:, None], f32)[:, 0])
    assert torch.equal(k2, _apply_rotary_pos_emb_bshd(k[:, None], f32)[:, 0])
    # And the rotation itself, in float64: pairs (i, i + d/2) turn by position * frequency of i.
    half = d // 2
    angle = freqs[:, 0, 0, :half]
    x1, x2 = q.double()[..., :half], q.double()[..., half:]
    ref = torch.cat([x1 * angle.cos()[:, None] - x2 * angle.sin()[:, None],
                     x2 * angle.cos()[:, None] + x1 * angle.sin()[:, None]], -1)
    assert torch.allclose(q2.double(), ref, atol=1e-5)
    # Each rollout's first token is at position 0: unrotated.
    for start in (0, 5, 6):
        assert torch.equal(q2[start], q[start])


# --------------------------------------------------------------------------------------------------
# Query / key / value out of the QKV projection in one pass (FusedQKVSelfAttention)


@pytest.mark.parametrize("extra", [[], ["model.attention_bias=false"], ["model.qk_layernorm=true"]])
def test_fused_qkv_split_is_megatrons_split_then_rope(extra):
    """Bias, split into heads and RoPE of a pack, and their backward, are bit for bit what Megatron's
    SelfAttention computes (its projection adding the bias, its split, then its unfused RoPE) in float32."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.transformer.attention import SelfAttention

    from megacritic import CriticWorker, load_config
    from megacritic.config import TINY_MODEL_OVERRIDES
    from megacritic.model.layers import FusedQKVSelfAttention

    worker = CriticWorker(load_config([*TINY_MODEL_OVERRIDES, "model.dtype=float32", *extra]))
    worker.init_model()
    try:
        attn = worker.state.model[0].module.decoder.layers[0].self_attention
        assert isinstance(attn, FusedQKVSelfAttention)
        assert attn.linear_qkv.skip_bias_add  # the bias is added by the split
        torch.manual_seed(0)
        with torch.no_grad():
            for p in attn.parameters():
                p.normal_()
        lens, d = [5, 1, 9], attn.hidden_size_per_attention_head
        hidden = torch.randn(sum(lens), 1, attn.config.hidden_size, requires_grad=True)
        freqs = _pack_rotary(lens, d).float()

        def run(ours):
            worker.state.model[0].zero_grad_buffer()  # DDP's hooks add parameter gradients to main_grad
            hidden.grad = None
            if ours:
                attn._rotary = (freqs.cos()[:, 0], freqs.sin()[:, 0])
                q, k, v = attn.get_query_key_value_tensors(hidden)
                attn._rotary = None
            else:
                attn.linear_qkv.skip_bias_add = False
                q, k, v = SelfAttention.get_query_key_value_tensors(attn, hidden)
                attn.linear_qkv.skip_bias_add = True
                q, k = _apply_rotary_pos_emb_bshd(q, freqs), _apply_rotary_pos_emb_bshd(k, freqs)
            gen = torch.Generator().manual_seed(1)
            outs = (q, k, v)
            torch.autograd.backward(outs, [torch.randn(x.shape, generator=gen) for x in outs])
            return [x.detach() for x in outs] + [hidden.grad] + [p.main_grad.clone() for p in attn.parameters()]

        ours, megatron = run(True), run(False)
        assert len(ours) == len(megatron) > 4
        for got, want in zip(ours, megatron):
            assert got.shape == want.shape and torch.equal(got, want)
    finally:
        worker.close()


# --------------------------------------------------------------------------------------------------
# RMSNorm


def _reference_rmsnorm(x, w, eps):
    x, w = x.double(), w.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("eps", [1e-6, 1e-1])
def test_rmsnorm_float32(config, eps):
    hidden = 32
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(config, hidden, eps=eps)
    assert norm.weight.dtype == torch.float32
    torch.testing.assert_close(norm.weight.detach(), torch.ones(hidden))  # starts at one
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    x = torch.randn(5, 3, hidden, generator=gen) * 0.5
    out = norm(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference_rmsnorm(x, norm.weight.detach(), eps), rtol=1e-5, atol=1e-6)


def test_rmsnorm_bfloat16(config_bf16):
    hidden = 32
    eps = config_bf16.layernorm_epsilon
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(config_bf16, hidden, eps=eps)
    assert norm.weight.dtype == torch.bfloat16
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    x = (torch.randn(5, 3, hidden, generator=gen) * 3).bfloat16()
    out = norm(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference_rmsnorm(x, norm.weight.detach(), eps), rtol=1e-2, atol=1e-2)


def test_rmsnorm_default_eps_is_1e_6(config):
    assert RMSNorm(config, 4).eps == 1e-6


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_rmsnorm_weight_carries_sequence_parallel_flag(sequence_parallel):
    # Megatron refuses sequence parallelism without tensor parallelism; the config alone needs no world.
    cfg = _config(tp=2 if sequence_parallel else 1, sequence_parallel=sequence_parallel)
    assert cfg.sequence_parallel is sequence_parallel
    norm = RMSNorm(cfg, 8)
    assert norm.weight.sequence_parallel == cfg.sequence_parallel
    assert norm.weight.device.type == "cpu"


# --------------------------------------------------------------------------------------------------
# ValueHead


def _randomize_head(head, gen):
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen))
        head.bias.copy_(torch.randn(head.bias.shape, generator=gen))


def test_value_head_float32(config):
    hidden = 16
    gen = torch.Generator().manual_seed(4)
    head = ValueHead(config, hidden)
    assert head.weight.shape == (1, hidden) and head.bias.shape == (1,)
    torch.testing.assert_close(head.bias.detach(), torch.zeros(1))
    _randomize_head(head, gen)
    x = torch.randn(6, 2, hidden, generator=gen)
    values, bias = head(x)
    assert bias is None
    assert values.shape == (6, 2, 1) and values.dtype == torch.float32
    ref = x.double() @ head.weight.detach().double().T + head.bias.detach().double()
    torch.testing.assert_close(values.double(), ref, rtol=1e-5, atol=1e-6)


def test_value_head_bfloat16_params_compute_in_float32(config_bf16):
    hidden = 16
    gen = torch.Generator().manual_seed(5)
    head = ValueHead(config_bf16, hidden)
    assert head.weight.dtype == torch.bfloat16 and head.bias.dtype == torch.bfloat16
    _randomize_head(head, gen)
    x = torch.randn(6, 2, hidden, generator=gen).bfloat16()
    values, bias = head(x)
    assert bias is None
    assert values.shape == (6, 2, 1) and values.dtype == torch.float32
    # bf16 values are exact in float32 and float64, so the float32 product is close to the float64 one.
    ref = x.double() @ head.weight.detach().double().T + head.bias.detach().double()
    torch.testing.assert_close(values.double(), ref, rtol=1e-5, atol=1e-5)


def test_value_head_backward_reaches_params(config):
    gen = torch.Generator().manual_seed(6)
    head = ValueHead(config, 8)
    _randomize_head(head, gen)
    x = torch.randn(3, 2, 8, generator=gen, requires_grad=True)
    values, _ = head(x)
    values.sum().backward()
    torch.testing.assert_close(head.weight.grad, x.detach().sum((0, 1)).unsqueeze(0))
    torch.testing.assert_close(head.bias.grad, torch.tensor([6.0]))


def test_moe_spec_groups_the_experts_only_with_fused_kernels():
    from megacritic.model.layers import GroupedExperts
    from megacritic.model.value_model import moe_spec

    for fused in (True, False):
        experts = moe_spec(shared_expert=False, fused=fused).submodules.experts
        assert experts.module is GroupedExperts and experts.params == {"grouped": fused}


# --------------------------------------------------------------------------------------------------
# The attention kernel of packed micro-batches (model.attention_impl), chosen once at build


def test_attention_impl_is_resolved_at_build_and_reported(config, config_bf16):
    from megacritic.config import ConfigError
    from megacritic.model.layers import attention_impl_of, resolve_attention_impl

    # On the CPU (and in float32) every choice but fa4 is the exact per-rollout SDPA loop ...
    for impl in ("auto", "fa2", "sdpa"):
        assert CoreAttention(config_bf16, 1, AttnMaskType.causal, "self", attention_impl=impl).impl == "sdpa"
    assert resolve_attention_impl("fa2", torch.float32, on_gpu=True) == "sdpa"
    # ... and fa4 asked for by name is an error naming the setting and the fix, raised at build.
    with pytest.raises(ConfigError, match=r"model.attention_impl=fa4.*pip install megacritic\[hopper\]"):
        CoreAttention(config, 1, AttnMaskType.causal, "self", attention_impl="fa4")
    chunk = torch.nn.ModuleList([CoreAttention(config, 1, AttnMaskType.causal, "self")])
    assert attention_impl_of([chunk]) == "sdpa"
