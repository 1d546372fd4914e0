"""What the bench measures: model shapes, systems, the seeded rollouts and each system's config.

Every figure of ``bench/results`` comes from these rollouts: 32 seeded verl-layout rollouts of prompts
64-1024 tokens and log-normal responses 16-8192 (median ~1024), 74,078 real tokens on the GPU shapes.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from megacritic.data.rollouts import verl_batch

# Qwen2.5 shapes (random weights): hidden, layers, heads, kv heads, FFN; vocab 151936, QKV bias.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936),
    "qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       intermediate_size=11008, vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
GPU_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")
SYSTEMS = ("megacritic-packed", "megacritic-offload", "megacritic-padded", "hf-sdpa-padded")
PACKED = ("megacritic-packed", "megacritic-offload")  # the systems with a token budget
# The systems whose rows are the targets' figures run in --processes processes; the others in
# --baseline-processes (the full bench must fit the device's time).
HEADLINE = ("megacritic-packed",)
# What a colocated RL job runs: the packed default with its whole state in host memory between calls.
OFFLOAD = [f"megatron.{part}_offload=true" for part in ("param", "grad", "optimizer")]

# Token budgets (ppo_max_token_len_per_gpu) of the packed systems: the first is every system's; the others
# add megacritic-packed rows (in --baseline-processes processes). 32,768 is verl's default critic budget.
TOKEN_BUDGETS = {"qwen2.5-1.5b": (16384, 32768)}
DEFAULT_TOKEN_BUDGET = 16384
CPU_TOKEN_BUDGET = 512

# Switches a shape needs to fit one H200 at a 16k token budget, and the systems it runs. 7B (7.07 G
# parameters) with the optimizer on the GPU: its default training state, 18 bytes per parameter (bf16
# weights 2, float32 gradient buffer 4, float32 main weights 4, Adam moments 8), is 118.5 GiB of the
# 139 GiB; with the Adam moments in bf16 (optim.exp_avg_dtype / exp_avg_sq_dtype) it is 14 bytes, 92.2 GiB.
# Activations at 16k tokens per micro-batch, scaled from the 3B row (101.0 GiB peak = 51.8 GiB of state +
# 49.2 GiB for 36 layers of hidden 2048) to 28 layers of hidden 3584: 67 GiB without recompute; recomputing
# the MLPs drops their saved fc1 and SwiGLU outputs (6 x FFN bytes per token and layer, 48.6 GiB), leaving
# 18.4 GiB, plus ~2.9 GiB to recompute one layer's MLP in backward: ~113.5 GiB predicted at the peak. Full
# recompute (the fallback: --set megatron.recompute_granularity=full --set megatron.recompute_method=uniform
# --set megatron.recompute_num_layers=1) would keep ~3.3 GiB of layer inputs. Segments that grow in place
# (megatron.expandable_segments) leave no reserved memory that no allocation fits: out of memory without.
# HF's bf16 AdamW with padded micro-batches is not run at 7B.
SHAPE_SWITCHES = {"qwen2.5-7b": ["optim.exp_avg_dtype=bfloat16", "optim.exp_avg_sq_dtype=bfloat16",
                                 "megatron.recompute_granularity=selective", "megatron.recompute_modules=[mlp]",
                                 "megatron.expandable_segments=true"]}
SHAPE_SYSTEMS = {"qwen2.5-7b": ("megacritic-packed",)}
# megacritic-packed's own switches at a shape: at 0.5B the eager step is bound by the host (~1 s of host time
# for ~0.46 s of GPU time per update), and the decoder replayed as CUDA graphs over packs padded to a multiple
# of 1,024 tokens measured 0.53 s against 0.92-1.01 s per update; packs padded to a multiple of 128 instead
# (0.4% padding instead of 5%, 128 lengths captured at the first call) took 2% less per update and 4% less
# per compute_values (bench/NOTES.md). At 1.5B the graphs measured the same as eager at either multiple (the
# step is bound by the GPU there); at 3B they are not measured.
PACKED_SWITCHES = {"qwen2.5-0.5b": ["model.cuda_graphs=true", "model.cuda_graph_pack_multiple=128"]}
# Untimed warm-up pairs and timed calls of a shape whose calls take tens of seconds (none since 7B's optimizer
# runs on the GPU: every shape has the default 3 and 3).
SHAPE_CALLS: dict[str, tuple[int, int]] = {}


def widths(cuda: bool) -> tuple[int, int]:
    """Prompt and response widths of the rollouts: the GPU run's, or small ones for the CPU's tiny shape."""
    return (1024, 8192) if cuda else (32, 128)


def token_budgets(shape_name: str, cuda: bool, given: list[int] | None = None) -> tuple[int, ...]:
    """The packed systems' token budgets at ``shape_name`` (``given``: --token-budget, for every shape)."""
    if given:
        return tuple(given)
    return TOKEN_BUDGETS.get(shape_name, (DEFAULT_TOKEN_BUDGET,)) if cuda else (CPU_TOKEN_BUDGET,)


def rollouts(n: int, vocab: int, max_prompt: int, max_response: int, seed: int = 0) -> TensorDict:
    """``n`` seeded rollouts: prompts of 64-``max_prompt`` tokens, responses log-normal around
    ``max_response`` / 8 (clamped to 16-``max_response``), random token ids, returns and old values."""
    gen = torch.Generator().manual_seed(seed)
    p_len = torch.randint(min(64, max_prompt), max_prompt + 1, (n,), generator=gen)
    median = max_response / 8
    r_len = (torch.randn(n, generator=gen) * 0.9 + math.log(median)).exp().round().long()
    r_len = r_len.clamp(min(16, max_response), max_response)
    tokens = torch.randint(0, vocab, (n, max_prompt + max_response), generator=gen)
    response_mask = (torch.arange(max_response)[None] < r_len[:, None]).float()
    returns = torch.randn(n, max_response, generator=gen) * response_mask
    values = returns + 0.1 * torch.randn(n, max_response, generator=gen) * response_mask
    return verl_batch(tokens, p_len, r_len, prompt_width=max_prompt, returns=returns, values=values)


def megacritic_overrides(shape: dict, batch: TensorDict, packed: bool, token_budget: int,
                         micro_batch: int) -> list[str]:
    """The config of a megacritic system for ``shape`` on ``batch``: four mini-batches per call, token-budget
    packed micro-batches (``packed``) or fixed padded ones of ``micro_batch`` rollouts."""
    n = len(batch)
    prompt_width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    overrides = [f"model.{k}={v}" for k, v in shape.items()] + [
        "model.attention_bias=true", "model.rope_theta=1000000.0",
        f"model.max_position_embeddings={batch['input_ids'].shape[1]}",
        f"data.rollouts_per_step={n}", f"ppo_mini_batch_size={n // 4}", "optim.lr=1e-6",
        f"data.prompt_length=[1,{prompt_width}]", f"data.response_length=[1,{batch['responses'].shape[1]}]",
        f"model.use_remove_padding={str(packed).lower()}"]
    if packed:
        overrides += ["use_dynamic_bsz=true", f"ppo_max_token_len_per_gpu={token_budget}"]
    else:
        overrides += ["use_dynamic_bsz=false", f"ppo_micro_batch_size_per_gpu={micro_batch}"]
    return overrides


def system_switches(shape_name: str, system: str, extra: list[str]) -> list[str]:
    """Config overrides of ``system`` at ``shape_name`` beyond megacritic_overrides: the shape's switches,
    megacritic-packed's switches at the shape, the run's --set, and the offload switches of megacritic-offload."""
    own = PACKED_SWITCHES.get(shape_name, []) if system == "megacritic-packed" else []
    return (SHAPE_SWITCHES.get(shape_name, []) + own + list(extra)
            + (OFFLOAD if system == "megacritic-offload" else []))
