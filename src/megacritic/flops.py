"""FLOPs of the real (unpadded) tokens, the device's peak, and MFU (:func:`mfu`): the one definition behind
``megacritic train``'s perf/mfu, the verl adapter's perf/mfu/critic and ``megacritic bench``.

Counted as 2 per multiply-add of the matmuls plus causal attention (QK^T and PV over the tokens before each
one); a backward pass counts twice a forward. Mixture-of-experts layers count the experts each token runs
through, not all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from megacritic.config.schema import ModelConfig, expert_ffn_size, moe_layer_pattern, shared_expert_size

# Dense (not sparse) bf16 tensor-core peak FLOP/s of one device, from the vendors' spec sheets, by a part of its
# name as torch reports it (lower case; the first match wins, so "h200" comes before "h20", "h100 pcie" before
# "h100"). SXM parts unless the name says otherwise.
PEAK_FLOPS = (
    ("h200", 989e12), ("h100 nvl", 835e12), ("h100 pcie", 756e12), ("h100", 989e12),
    ("h800 pcie", 756e12), ("h800", 989e12), ("h20", 148e12),
    ("gb200", 2.5e15), ("b200", 2.25e15),
    ("a100", 312e12), ("a800", 312e12), ("l40s", 362e12),
    ("mi300x", 1307e12), ("mi325x", 1307e12),
)


def machine_kind() -> str:
    """The device this process computes on, as a short name (the key of bench results)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return "nvidia-h200" if "h200" in name else name.replace(" ", "-")


def peak_flops(device_name: str | None = None) -> float:
    """Dense bf16 peak FLOP/s of a device named ``device_name`` (default: this process's CUDA device); NaN where
    unknown (the CPU, a GPU not in PEAK_FLOPS), so an MFU of such a device is NaN rather than a guess."""
    if device_name is None:
        if not torch.cuda.is_available():
            return float("nan")
        device_name = torch.cuda.get_device_name()
    name = device_name.lower()
    return next((peak for part, peak in PEAK_FLOPS if part in name), float("nan"))


def mfu(flops: float, seconds: float, world_size: int, peak: float | None = None) -> float:
    """Model FLOPs utilisation: ``flops`` (all ranks' work together, e.g. 3 x forward FLOPs of a global batch's
    real tokens for an update) done in ``seconds`` by ``world_size`` devices, over their summed dense bf16
    peak. ``peak``: one device's FLOP/s (default this device's, :func:`peak_flops`); NaN where unknown."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: MFU needs at least one device")
    peak = peak_flops() if peak is None else peak
    return flops / max(seconds, 1e-12) / (peak * world_size)


def forward_flops(shape: Mapping, seq_lens: list[int]) -> float:
    """Forward FLOPs of the real tokens of a dense model of ``shape`` (ModelConfig's field names): matmuls
    (2 per multiply-add) plus causal attention (QK^T, PV)."""
    h, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape.get("head_dim") or h // heads
    q_dim, kv_dim = heads * d, kv * d
    per_token = 2 * (h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * shape["intermediate_size"] + h)
    tokens = sum(seq_lens)
    attention = sum(2 * 2 * q_dim * s * (s + 1) / 2 for s in seq_lens)
    return shape["num_hidden_layers"] * (per_token * tokens + attention)


def active_shape(model: ModelConfig) -> dict:
    """``model`` as forward_flops counts it. With experts, a token's FFN in an MoE layer is its top-k
    experts, the shared expert and the router (one [h, E] matmul, a third of an FFN of width E); the FFN
    width given is the mean of that over the layers, so the count stays exact."""
    shape = dataclasses.asdict(model)
    pattern = moe_layer_pattern(model)
    if any(pattern):
        moe = (model.num_experts_per_tok * expert_ffn_size(model) + shared_expert_size(model)
               + model.num_experts / 3)
        shape["intermediate_size"] = sum(moe if p else model.intermediate_size for p in pattern) / len(pattern)
    return shape


def model_forward_flops(model: ModelConfig, seq_lens: list[int]) -> float:
    """Forward FLOPs of the real tokens through ``model``, dense or mixture-of-experts."""
    return forward_flops(active_shape(model), seq_lens)
