"""Weights in Hugging Face layout, and how they map onto Megatron's sharded parameters.

Every weight is defined by its full (unsharded) tensor under its Hugging Face name
(``model.layers.3.self_attn.q_proj.weight``, ``score.weight`` ...). A rank fills each of its Megatron
parameters by slicing the full tensors it needs for its tensor-parallel rank, so the same model comes
out for every TP / PP / VPP layout. A source of full tensors is a :class:`TensorSource`: ``full(name)``,
and ``read_slice(name, dim, start, stop)``, with which a checkpoint (:mod:`megacritic.hf.safetensors_reader`) reads
only the rows of this rank's shard, so a rank reads no more than it holds. Random initialisation draws each
full tensor from a generator seeded by (seed, name): a rank materialises only the tensors of its own stage,
one at a time.

One table, :data:`_LAYER_PARAMS` (with :data:`_MODEL_PARAMS` outside the decoder layers), says which HF
tensors each Megatron parameter holds and how (whole, rows of the vocabulary, split along the input dim,
gate and up stacked, query groups fused); :func:`megatron_tensor` (import) and :func:`hf_from_megatron`
(export) both read it.

Mixture-of-experts layers: each routed expert's weights are those of one SwiGLU MLP, split over expert
tensor parallelism (ETP) like a dense MLP over TP; expert parallelism (EP) gives each rank a contiguous run of
whole experts (Megatron's local expert j on EP rank r is expert r * local + j).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import nn

from megacritic.config.schema import (ModelConfig, expert_ffn_size, head_dim, hf_family, moe_layer_pattern,
                               shared_expert_size)


@runtime_checkable
class TensorSource(Protocol):
    """Full (unsharded) tensors in Hugging Face layout, by name (:func:`hf_shapes`)."""

    def __call__(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop along ``dim`` of tensor ``name``, read without the rest where the source can."""


class WholeTensors:
    """A :class:`TensorSource` from a function of the name: slices are cut from the whole tensor."""

    def __init__(self, full: Callable[[str], torch.Tensor]):
        self._full = full

    def __call__(self, name: str) -> torch.Tensor:
        return self._full(name)

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self._full(name).narrow(dim, start, stop - start)


def tensor_source(full: TensorSource | Callable[[str], torch.Tensor]) -> TensorSource:
    """``full`` as a :class:`TensorSource` (a plain function of the name is wrapped in :class:`WholeTensors`)."""
    return full if isinstance(full, TensorSource) else WholeTensors(full)


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


def seeded_initializer(model: ModelConfig, seed: int) -> TensorSource:
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

    return WholeTensors(full)


def _tp_part(full: TensorSource, name: str, dim: int, size: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank's contiguous 1/tp_size of full tensor ``name`` (``size`` long along ``dim``)."""
    part = size // tp_size
    return full.read_slice(name, dim, tp_rank * part, (tp_rank + 1) * part)


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


class Held(Enum):
    """How a Megatron parameter holds its Hugging Face tensors on a (tensor- or expert-tensor-parallel) rank."""

    WHOLE = "whole"  # one tensor, whole on every rank (norms, router, value head)
    VOCAB_ROWS = "vocab_rows"  # rows of the vocabulary padded to a multiple of TP, split over TP
    SPLIT_INPUT = "split_input"  # split along dim 1, the input features of a row-parallel linear
    GATE_UP = "gate_up"  # this rank's gate rows, then its up rows (a column-parallel SwiGLU fc1)
    QKV = "qkv"  # this rank's query groups, each as its query heads, key head, value head


@dataclass(frozen=True)
class _Param:
    """The HF tensors one Megatron parameter holds (name templates) and how; ``split``: the length of the
    split dim (SPLIT_INPUT, GATE_UP)."""

    hf: tuple[str, ...]
    held: Held
    split: Callable[[ModelConfig], int] | None = None


def _query_size(model: ModelConfig) -> int:
    return model.num_attention_heads * head_dim(model)


def _dense_ffn_size(model: ModelConfig) -> int:
    return model.intermediate_size


# Megatron parameters outside the decoder layers -> HF names.
_MODEL_PARAMS = {
    "embedding.word_embeddings.weight": _Param(("model.embed_tokens.weight",), Held.VOCAB_ROWS),
    "decoder.final_layernorm.weight": _Param(("model.norm.weight",), Held.WHOLE),
    "output_layer.weight": _Param(("score.weight",), Held.WHOLE),
    "output_layer.bias": _Param(("score.bias",), Held.WHOLE),
}

# Megatron parameters inside ``decoder.layers.<i>.`` -> HF names inside ``model.layers.<layer>.``. In the
# templates, {block} is the family's MoE block, {e} the global index of a routed expert and {gate} / {up} /
# {down} the family's names of its projections (moe_hf_names). Routed experts are split over expert tensor
# parallelism, everything else over TP.
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LAYER_PARAMS = {
    "input_layernorm.weight": _Param(("input_layernorm.weight",), Held.WHOLE),
    "pre_mlp_layernorm.weight": _Param(("post_attention_layernorm.weight",), Held.WHOLE),
    "self_attention.q_layernorm.weight": _Param(("self_attn.q_norm.weight",), Held.WHOLE),
    "self_attention.k_layernorm.weight": _Param(("self_attn.k_norm.weight",), Held.WHOLE),
    "self_attention.linear_qkv.weight": _Param(tuple(f"{x}.weight" for x in _QKV), Held.QKV),
    "self_attention.linear_qkv.bias": _Param(tuple(f"{x}.bias" for x in _QKV), Held.QKV),
    "self_attention.linear_proj.weight": _Param(("self_attn.o_proj.weight",), Held.SPLIT_INPUT, _query_size),
    "mlp.linear_fc1.weight": _Param(("mlp.gate_proj.weight", "mlp.up_proj.weight"), Held.GATE_UP, _dense_ffn_size),
    "mlp.linear_fc2.weight": _Param(("mlp.down_proj.weight",), Held.SPLIT_INPUT, _dense_ffn_size),
    "mlp.router.weight": _Param(("{block}.gate.weight",), Held.WHOLE),
    "mlp.shared_experts.gate_weight": _Param(("mlp.shared_expert_gate.weight",), Held.WHOLE),
    "mlp.shared_experts.linear_fc1.weight": _Param(
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), Held.GATE_UP, shared_expert_size),
    "mlp.shared_experts.linear_fc2.weight": _Param(
        ("mlp.shared_expert.down_proj.weight",), Held.SPLIT_INPUT, shared_expert_size),
    "mlp.experts.local_experts.{e}.linear_fc1.weight": _Param(
        ("{block}.experts.{e}.{gate}.weight", "{block}.experts.{e}.{up}.weight"), Held.GATE_UP, expert_ffn_size),
    "mlp.experts.local_experts.{e}.linear_fc2.weight": _Param(
        ("{block}.experts.{e}.{down}.weight",), Held.SPLIT_INPUT, expert_ffn_size),
}
_EXPERT = "mlp.experts.local_experts."


def _lookup(name: str, layer: int | None, model: ModelConfig, first_expert: int, missing: str
            ) -> tuple[_Param, list[str], bool]:
    """(table entry, full HF names, whether a routed expert) of Megatron parameter ``name``; a routed expert's
    index in ``name`` is counted from ``first_expert``. ``missing``: the KeyError's message."""
    if name in _MODEL_PARAMS:
        param = _MODEL_PARAMS[name]
        return param, list(param.hf), False
    if not name.startswith("decoder.layers."):
        raise KeyError(f"{missing} {name!r}")
    local, expert = name.split(".", 3)[3], None  # decoder.layers.<i>.<local>
    if local.startswith(_EXPERT):
        parts = local.split(".")
        expert, parts[3] = first_expert + int(parts[3]), "{e}"
        local = ".".join(parts)
    param = _LAYER_PARAMS.get(local)
    if param is None:
        raise KeyError(f"{missing} {name!r}")
    block, (gate, up, down) = moe_hf_names(model)
    names = [f"model.layers.{layer}." + t.format(block=block, e=expert, gate=gate, up=up, down=down)
             for t in param.hf]
    return param, names, expert is not None


def megatron_tensor(name: str, layer: int | None, full: TensorSource | Callable[[str], torch.Tensor],
                    model: ModelConfig, tp_rank: int, tp_size: int, padded_vocab: int,
                    experts: ExpertRanks = NO_EXPERT_PARALLELISM) -> torch.Tensor:
    """The value of Megatron parameter ``name`` (local name inside a chunk) on this TP rank (and, for routed
    experts, this EP / ETP rank: Megatron's local expert j on EP rank r is expert r * local + j).

    ``layer`` is the global index of the decoder layer the parameter belongs to (None outside layers).
    """
    full = tensor_source(full)
    param, names, routed = _lookup(name, layer, model, experts.ep_rank * ((model.num_experts or 0) // experts.ep_size),
                                   "no Hugging Face source for Megatron parameter")
    rank, size = (experts.etp_rank, experts.etp_size) if routed else (tp_rank, tp_size)
    if param.held is Held.WHOLE:
        return full(names[0])
    if param.held is Held.VOCAB_ROWS:
        # Rows of the padded vocabulary; the padding rows (beyond vocab_size) are zeros.
        h, part = model.hidden_size, padded_vocab // tp_size
        start, stop = tp_rank * part, min((tp_rank + 1) * part, model.vocab_size)
        emb = full.read_slice(names[0], 0, start, stop) if stop > start else torch.zeros(0, h)
        return torch.cat([emb, emb.new_zeros(part - emb.shape[0], h)])
    if param.held is Held.SPLIT_INPUT:
        return _tp_part(full, names[0], 1, param.split(model), rank, size)
    if param.held is Held.GATE_UP:
        return torch.cat([_tp_part(full, n, 0, param.split(model), rank, size) for n in names])
    groups, q0, kv0, hd = _group_rows(model, tp_rank, tp_size)  # Held.QKV
    q_rows = groups * (model.num_attention_heads // model.num_key_value_heads) * hd
    q = full.read_slice(names[0], 0, q0, q0 + q_rows)
    k, v = (full.read_slice(n, 0, kv0, kv0 + groups * hd) for n in names[1:])
    return _fuse_groups(q, k, v, groups, hd)


def hf_from_megatron(name: str, layer: int | None, pieces: list[torch.Tensor],
                     model: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`megatron_tensor`: the full HF tensors held by Megatron parameter ``name``, from
    its value on every TP rank (``pieces``, in TP rank order; for a routed expert: on every ETP rank, and
    ``name`` carries the global expert index)."""
    param, names, _ = _lookup(name, layer, model, 0, "no Hugging Face name for Megatron parameter")
    if param.held is Held.WHOLE:
        return {names[0]: pieces[0]}
    if param.held is Held.VOCAB_ROWS:
        return {names[0]: torch.cat(pieces)[: model.vocab_size]}  # drop the padding rows
    if param.held is Held.SPLIT_INPUT:
        return {names[0]: torch.cat(pieces, dim=1)}
    if param.held is Held.GATE_UP:
        halves = [piece.chunk(2) for piece in pieces]  # each rank: [its gate rows; its up rows]
        return {names[0]: torch.cat([g for g, _ in halves]), names[1]: torch.cat([u for _, u in halves])}
    hd, groups = head_dim(model), model.num_key_value_heads  # Held.QKV
    fused = torch.cat(pieces)  # ranks hold consecutive groups, so this is the TP=1 layout
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, -1, *rest).split([model.num_attention_heads // groups * hd, hd, hd], dim=1)
    return {n: t.reshape(-1, *rest) for n, t in zip(names, (q, k, v))}

def param_layer(chunk: nn.Module, name: str) -> int | None:
    """Global index of the decoder layer that chunk parameter ``name`` belongs to (None outside layers)."""
    if not name.startswith("decoder.layers."):
        return None
    return chunk.decoder.layers[int(name.split(".")[2])].layer_number - 1


@torch.no_grad()
def load_full_weights(chunks: list[nn.Module], full: TensorSource, model: ModelConfig,
                      tp_rank: int, tp_size: int, padded_vocab: int,
                      experts: ExpertRanks = NO_EXPERT_PARALLELISM) -> None:
    """Fill every parameter of this rank's chunks from full Hugging Face-layout tensors."""
    full = tensor_source(full)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            value = megatron_tensor(name, param_layer(chunk, name), full, model, tp_rank, tp_size, padded_vocab,
                                    experts)
            if value.shape != param.shape:
                raise RuntimeError(f"{name}: expected shape {tuple(param.shape)}, built {tuple(value.shape)}")
            param.copy_(value)
