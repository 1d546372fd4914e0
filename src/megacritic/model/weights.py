"""Weights in Hugging Face layout, and how they map onto Megatron's sharded parameters.

Every weight is defined by its full (unsharded) tensor under its Hugging Face name
(``model.layers.3.self_attn.q_proj.weight``, ``score.weight`` ...). A rank fills each of its Megatron
parameters by slicing the full tensors it needs for its tensor-parallel rank, so the same model comes
out for every TP / PP / VPP layout. Random initialisation draws each full tensor from a generator
seeded by (seed, name): a rank materialises only the tensors of its own stage, one at a time.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
from torch import nn

from megacritic.config import ModelConfig, head_dim

FullTensor = Callable[[str], torch.Tensor]


def hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the value model's weights, as in a ``*ForTokenClassification`` checkpoint."""
    h, hd = model.hidden_size, head_dim(model)
    q, kv = model.num_attention_heads * hd, model.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (model.vocab_size, h)}
    for i in range(model.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (model.intermediate_size, h),
            p + "mlp.up_proj.weight": (model.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, model.intermediate_size),
        })
        if model.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    shapes.update({"model.norm.weight": (h,), "score.weight": (1, h), "score.bias": (1,)})
    return shapes


def seeded_initializer(model: ModelConfig, seed: int) -> FullTensor:
    """Full tensors drawn as Hugging Face initialises them (normal weights, unit norms, zero biases),
    each from its own generator seeded by (seed, name), so no rank depends on another's draws."""
    shapes = hf_shapes(model)

    def full(name: str) -> torch.Tensor:
        shape = shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        std = model.value_head_init_std if name == "score.weight" else model.init_std
        return torch.randn(shape, generator=gen) * std

    return full


def _tp_slice(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    return t.chunk(tp_size, dim=dim)[tp_rank]


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig,
               tp_rank: int, tp_size: int) -> torch.Tensor:
    """Megatron's linear_qkv rows: per query group, its query heads then its key then its value;
    TP rank r holds a contiguous run of whole groups."""
    hd, groups = head_dim(model), model.num_key_value_heads
    heads_per_group = model.num_attention_heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, heads_per_group * hd, *rest)
    k = k.reshape(groups, hd, *rest)
    v = v.reshape(groups, hd, *rest)
    fused = torch.cat([q, k, v], dim=1)  # [groups, (heads_per_group + 2) * hd, ...]
    return _tp_slice(fused, 0, tp_rank, tp_size).reshape(-1, *rest)


def megatron_tensor(name: str, layer: int | None, full: FullTensor, model: ModelConfig,
                    tp_rank: int, tp_size: int, padded_vocab: int) -> torch.Tensor:
    """The value of Megatron parameter ``name`` (local name inside a chunk) on this TP rank.

    ``layer`` is the global index of the decoder layer the parameter belongs to (None outside layers).
    """
    if name == "embedding.word_embeddings.weight":
        emb = full("model.embed_tokens.weight")
        emb = torch.cat([emb, emb.new_zeros(padded_vocab - emb.shape[0], emb.shape[1])])
        return _tp_slice(emb, 0, tp_rank, tp_size)
    if name == "decoder.final_layernorm.weight":
        return full("model.norm.weight")
    if name == "output_layer.weight":
        return full("score.weight")
    if name == "output_layer.bias":
        return full("score.bias")
    p = f"model.layers.{layer}."
    local = name.split(".", 3)[3]  # decoder.layers.<i>.<local>
    if local == "input_layernorm.weight":
        return full(p + "input_layernorm.weight")
    if local == "pre_mlp_layernorm.weight":
        return full(p + "post_attention_layernorm.weight")
    if local in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = local.rsplit(".", 1)[1]
        q, k, v = (full(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv")
        return _fused_qkv(q, k, v, model, tp_rank, tp_size)
    if local == "self_attention.linear_proj.weight":
        return _tp_slice(full(p + "self_attn.o_proj.weight"), 1, tp_rank, tp_size)
    if local == "mlp.linear_fc1.weight":
        gate = _tp_slice(full(p + "mlp.gate_proj.weight"), 0, tp_rank, tp_size)
        up = _tp_slice(full(p + "mlp.up_proj.weight"), 0, tp_rank, tp_size)
        return torch.cat([gate, up])
    if local == "mlp.linear_fc2.weight":
        return _tp_slice(full(p + "mlp.down_proj.weight"), 1, tp_rank, tp_size)
    raise KeyError(f"no Hugging Face source for Megatron parameter {name!r}")


@torch.no_grad()
def load_full_weights(chunks: list[nn.Module], full: FullTensor, model: ModelConfig,
                      tp_rank: int, tp_size: int, padded_vocab: int) -> None:
    """Fill every parameter of this rank's chunks from full Hugging Face-layout tensors."""
    for chunk in chunks:
        layers = getattr(chunk.decoder, "layers", [])
        for name, param in chunk.named_parameters():
            layer = None
            if name.startswith("decoder.layers."):
                layer = layers[int(name.split(".")[2])].layer_number - 1
            value = megatron_tensor(name, layer, full, model, tp_rank, tp_size, padded_vocab)
            if value.shape != param.shape:
                raise RuntimeError(f"{name}: expected shape {tuple(param.shape)}, built {tuple(value.shape)}")
            param.copy_(value)
