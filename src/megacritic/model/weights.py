"""Weights in Hugging Face layout, and how they map onto Megatron's sharded parameters.

Every weight is defined by its full (unsharded) tensor under its Hugging Face name
(``model.layers.3.self_attn.q_proj.weight``, ``score.weight`` ...). A rank fills each of its Megatron
parameters by slicing the full tensors it needs for its tensor-parallel rank, so the same model comes
out for every TP / PP / VPP layout. A source of full tensors is a callable ``full(name)``; one that also
has ``read_slice(name, dim, start, stop)`` (a checkpoint, :mod:`megacritic.hf.config`) is asked only for the
rows of this rank's shard, so a rank reads no more than it holds. Random initialisation draws each full
tensor from a generator seeded by (seed, name): a rank materialises only the tensors of its own stage, one
at a time. :func:`hf_from_megatron` is the inverse mapping, used to export.

Mixture-of-experts layers: each routed expert's weights are those of one SwiGLU MLP, split over expert
tensor parallelism (ETP) like a dense MLP over TP; expert parallelism (EP) gives each rank a contiguous run of
whole experts (Megatron's local expert j on EP rank r is expert r * local + j).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from megacritic.config import (ModelConfig, expert_ffn_size, head_dim, hf_family, moe_layer_pattern,
                               shared_expert_size)

FullTensor = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class ExpertRanks:
    """This rank's place among the experts: expert-parallel (EP) and expert tensor-parallel (ETP) rank/size."""

    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1


NO_EXPERT_PARALLELISM = ExpertRanks()


def moe_hf_names(model: ModelConfig) -> tuple[str, tuple[str, str, str]]:
    """(MoE block name in a layer, HF names of an expert's gate / up / down projections) of the family."""
    if hf_family(model) == "mixtral":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def _mlp_shapes(prefix: str, names: tuple[str, str, str], h: int, ffn: int) -> dict[str, tuple[int, ...]]:
    gate, up, down = names
    return {f"{prefix}{gate}.weight": (ffn, h), f"{prefix}{up}.weight": (ffn, h), f"{prefix}{down}.weight": (h, ffn)}


def hf_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the value model's weights, as in a ``*ForTokenClassification`` checkpoint."""
    h, hd = model.hidden_size, head_dim(model)
    q, kv = model.num_attention_heads * hd, model.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (model.vocab_size, h)}
    block, expert_names = moe_hf_names(model)
    for i, moe in enumerate(moe_layer_pattern(model)):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
        })
        if not moe:
            shapes.update(_mlp_shapes(p + "mlp.", ("gate_proj", "up_proj", "down_proj"), h, model.intermediate_size))
        else:
            shapes[f"{p}{block}.gate.weight"] = (model.num_experts, h)
            for e in range(model.num_experts):
                shapes.update(_mlp_shapes(f"{p}{block}.experts.{e}.", expert_names, h, expert_ffn_size(model)))
            if shared_expert_size(model):
                shapes.update(_mlp_shapes(f"{p}mlp.shared_expert.", ("gate_proj", "up_proj", "down_proj"), h,
                                          shared_expert_size(model)))
                shapes[f"{p}mlp.shared_expert_gate.weight"] = (1, h)
        if model.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if model.qk_layernorm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    shapes.update({"model.norm.weight": (h,), "score.weight": (1, h), "score.bias": (1,)})
    return shapes


def seeded_initializer(model: ModelConfig, seed: int) -> FullTensor:
    """Full tensors drawn as Hugging Face initialises them (normal weights, unit norms, zero biases),
    each from its own generator seeded by (seed, name), so no rank depends on another's draws. The value
    head follows model.value_head_init (normal or zeros)."""
    shapes = hf_shapes(model)

    def full(name: str) -> torch.Tensor:
        shape = shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith(".bias") or (name == "score.weight" and model.value_head_init == "zeros"):
            return torch.zeros(shape)
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        std = model.value_head_init_std if name == "score.weight" else model.init_std
        return torch.randn(shape, generator=gen) * std

    return full


def _read(full: FullTensor, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop along ``dim`` of full tensor ``name``, read alone where the source can."""
    read_slice = getattr(full, "read_slice", None)
    if read_slice is not None:
        return read_slice(name, dim, start, stop)
    return full(name).narrow(dim, start, stop - start)


def _tp_part(full: FullTensor, name: str, dim: int, size: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank's contiguous 1/tp_size of full tensor ``name`` (``size`` long along ``dim``)."""
    part = size // tp_size
    return _read(full, name, dim, tp_rank * part, (tp_rank + 1) * part)


def _fuse_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, hd: int) -> torch.Tensor:
    """Megatron's linear_qkv rows for ``groups`` consecutive query groups: per group, its query heads, then
    its key head, then its value head."""
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, hd, *rest), v.reshape(groups, hd, *rest)],
                      dim=1)
    return fused.reshape(-1, *rest)


def _group_rows(model: ModelConfig, tp_rank: int, tp_size: int) -> tuple[int, int, int, int]:
    """This TP rank's query groups (a contiguous run) as (groups, query rows start, kv rows start, hd)."""
    hd, groups = head_dim(model), model.num_key_value_heads // tp_size
    first = tp_rank * groups
    return groups, first * (model.num_attention_heads // model.num_key_value_heads) * hd, first * hd, hd


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig,
               tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank's linear_qkv rows from full q, k, v: a contiguous run of whole query groups."""
    groups, q0, kv0, hd = _group_rows(model, tp_rank, tp_size)
    q_rows = groups * (model.num_attention_heads // model.num_key_value_heads) * hd
    return _fuse_groups(q[q0:q0 + q_rows], k[kv0:kv0 + groups * hd], v[kv0:kv0 + groups * hd], groups, hd)


def _moe_source(local: str, model: ModelConfig, p: str) -> tuple[str, int, int] | str | None:
    """Where MoE parameter ``local`` (name inside a layer, expert index global) comes from: an HF name for a
    replicated tensor, or (HF MLP prefix, expert index or -1 for the shared expert, FFN size); None if
    ``local`` is not an MoE parameter."""
    block, _ = moe_hf_names(model)
    if local == "mlp.router.weight":
        return f"{p}{block}.gate.weight"
    if local == "mlp.shared_experts.gate_weight":
        return f"{p}mlp.shared_expert_gate.weight"
    if local.startswith("mlp.shared_experts."):
        return f"{p}mlp.shared_expert.", -1, shared_expert_size(model)
    if local.startswith("mlp.experts.local_experts."):
        e = int(local.split(".")[3])
        return f"{p}{block}.experts.{e}.", e, expert_ffn_size(model)
    return None


def _expert_global_name(local: str, ep: ExpertRanks, experts_per_rank: int) -> str:
    """``mlp.experts.local_experts.<j>...`` on this EP rank -> the same name with the global expert index."""
    parts = local.split(".")
    parts[3] = str(ep.ep_rank * experts_per_rank + int(parts[3]))
    return ".".join(parts)


def _fc_names(model: ModelConfig, expert: int) -> tuple[str, str, str]:
    """HF gate / up / down names of the shared expert (-1) or a routed expert (>= 0)."""
    return moe_hf_names(model)[1] if expert >= 0 else ("gate_proj", "up_proj", "down_proj")


def megatron_tensor(name: str, layer: int | None, full: FullTensor, model: ModelConfig,
                    tp_rank: int, tp_size: int, padded_vocab: int,
                    experts: ExpertRanks = NO_EXPERT_PARALLELISM) -> torch.Tensor:
    """The value of Megatron parameter ``name`` (local name inside a chunk) on this TP rank (and, for routed
    experts, this EP / ETP rank).

    ``layer`` is the global index of the decoder layer the parameter belongs to (None outside layers).
    """
    h, ffn = model.hidden_size, model.intermediate_size
    if name == "embedding.word_embeddings.weight":
        # Rows of the padded vocabulary; the padding rows (beyond vocab_size) are zeros.
        part = padded_vocab // tp_size
        start, stop = tp_rank * part, min((tp_rank + 1) * part, model.vocab_size)
        emb = _read(full, "model.embed_tokens.weight", 0, start, stop) if stop > start else torch.zeros(0, h)
        return torch.cat([emb, emb.new_zeros(part - emb.shape[0], h)])
    if name == "decoder.final_layernorm.weight":
        return full("model.norm.weight")
    if name == "output_layer.weight":
        return full("score.weight")
    if name == "output_layer.bias":
        return full("score.bias")
    p = f"model.layers.{layer}."
    local = name.split(".", 3)[3]  # decoder.layers.<i>.<local>
    if local in _REPLICATED:
        return full(p + _REPLICATED[local])
    if local in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = local.rsplit(".", 1)[1]
        groups, q0, kv0, hd = _group_rows(model, tp_rank, tp_size)
        q_rows = groups * (model.num_attention_heads // model.num_key_value_heads) * hd
        q = _read(full, f"{p}self_attn.q_proj.{kind}", 0, q0, q0 + q_rows)
        k, v = (_read(full, f"{p}self_attn.{x}_proj.{kind}", 0, kv0, kv0 + groups * hd) for x in "kv")
        return _fuse_groups(q, k, v, groups, hd)
    if local == "self_attention.linear_proj.weight":
        return _tp_part(full, p + "self_attn.o_proj.weight", 1, model.num_attention_heads * head_dim(model),
                        tp_rank, tp_size)
    mlp_prefix, names, rank, size = p + "mlp.", ("gate_proj", "up_proj", "down_proj"), tp_rank, tp_size
    if local.startswith("mlp.experts.local_experts."):
        local = _expert_global_name(local, experts, model.num_experts // experts.ep_size)
    source = _moe_source(local, model, p)
    if isinstance(source, str):
        return full(source)
    if source is not None:
        mlp_prefix, expert, ffn = source
        names = _fc_names(model, expert)
        if expert >= 0:  # routed experts are split over expert tensor parallelism, the shared one over TP
            rank, size = experts.etp_rank, experts.etp_size
        local = "mlp." + local.rsplit(".", 2)[1] + ".weight"
    if local == "mlp.linear_fc1.weight":
        gate = _tp_part(full, f"{mlp_prefix}{names[0]}.weight", 0, ffn, rank, size)
        up = _tp_part(full, f"{mlp_prefix}{names[1]}.weight", 0, ffn, rank, size)
        return torch.cat([gate, up])
    if local == "mlp.linear_fc2.weight":
        return _tp_part(full, f"{mlp_prefix}{names[2]}.weight", 1, ffn, rank, size)
    raise KeyError(f"no Hugging Face source for Megatron parameter {name!r}")


# Decoder-layer parameters that every TP rank holds whole: Megatron local name -> HF name in the layer.
_REPLICATED = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


def hf_from_megatron(name: str, layer: int | None, pieces: list[torch.Tensor],
                     model: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`megatron_tensor`: the full HF tensors held by Megatron parameter ``name``, from
    its value on every TP rank (``pieces``, in TP rank order; for a routed expert: on every ETP rank, and
    ``name`` carries the global expert index)."""
    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": torch.cat(pieces)[: model.vocab_size]}  # drop the padding rows
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": pieces[0]}
    if name in ("output_layer.weight", "output_layer.bias"):
        return {"score." + name.rsplit(".", 1)[1]: pieces[0]}
    p = f"model.layers.{layer}."
    local = name.split(".", 3)[3]
    if local in _REPLICATED:
        return {p + _REPLICATED[local]: pieces[0]}
    if local in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = local.rsplit(".", 1)[1]
        hd, groups = head_dim(model), model.num_key_value_heads
        fused = torch.cat(pieces)  # ranks hold consecutive groups, so this is the TP=1 layout
        rest = fused.shape[1:]
        q, k, v = fused.reshape(groups, -1, *rest).split(
            [model.num_attention_heads // groups * hd, hd, hd], dim=1)
        return {f"{p}self_attn.{x}_proj.{kind}": t.reshape(-1, *rest) for x, t in zip("qkv", (q, k, v))}
    if local == "self_attention.linear_proj.weight":
        return {p + "self_attn.o_proj.weight": torch.cat(pieces, dim=1)}
    mlp_prefix, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    source = _moe_source(local, model, p)
    if isinstance(source, str):
        return {source: pieces[0]}
    if source is not None:
        mlp_prefix, expert, _ = source
        names = _fc_names(model, expert)
        local = "mlp." + local.rsplit(".", 2)[1] + ".weight"
    if local == "mlp.linear_fc1.weight":
        halves = [piece.chunk(2) for piece in pieces]  # each rank: [its gate rows; its up rows]
        return {f"{mlp_prefix}{names[0]}.weight": torch.cat([g for g, _ in halves]),
                f"{mlp_prefix}{names[1]}.weight": torch.cat([u for _, u in halves])}
    if local == "mlp.linear_fc2.weight":
        return {f"{mlp_prefix}{names[2]}.weight": torch.cat(pieces, dim=1)}
    raise KeyError(f"no Hugging Face name for Megatron parameter {name!r}")


def param_layer(chunk: nn.Module, name: str) -> int | None:
    """Global index of the decoder layer that chunk parameter ``name`` belongs to (None outside layers)."""
    if not name.startswith("decoder.layers."):
        return None
    return chunk.decoder.layers[int(name.split(".")[2])].layer_number - 1


@torch.no_grad()
def load_full_weights(chunks: list[nn.Module], full: FullTensor, model: ModelConfig,
                      tp_rank: int, tp_size: int, padded_vocab: int,
                      experts: ExpertRanks = NO_EXPERT_PARALLELISM) -> None:
    """Fill every parameter of this rank's chunks from full Hugging Face-layout tensors."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            value = megatron_tensor(name, param_layer(chunk, name), full, model, tp_rank, tp_size, padded_vocab,
                                    experts)
            if value.shape != param.shape:
                raise RuntimeError(f"{name}: expected shape {tuple(param.shape)}, built {tuple(value.shape)}")
            param.copy_(value)
