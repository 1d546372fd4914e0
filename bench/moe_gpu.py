"""Mixture-of-experts critic throughput on one GPU: a Qwen3-MoE-shaped critic (random weights, bf16) through
CriticWorker, on packed long-tailed rollouts; prints real tokens/s and peak memory of both calls.

    python bench/moe_gpu.py [--layers 12] [--experts 64] [--topk 8] [--rollouts 32] [--token-budget 16384]
    torchrun --nproc_per_node 2 bench/moe_gpu.py --ep 2      # experts split over two GPUs
    python bench/moe_gpu.py --cpu-tiny                      # the same path on CPU, tiny shape (timings mean nothing)

The experts are Megatron-Core's SequentialMLP (one matmul pair per local expert, no grouped GEMM: the lent
GPU machine has no Transformer Engine), so this measures the path users of that machine get.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megacritic import CriticWorker, load_config
from megacritic.bench import rollouts


def shape(args) -> dict:
    """Qwen3-MoE-like: QK-norm, no QKV bias, GQA, renormalised top-k over many small experts."""
    if args.cpu_tiny:
        return dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                    vocab_size=512)
    return dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                head_dim=64, intermediate_size=3 * args.hidden, moe_intermediate_size=args.expert_ffn,
                num_experts=args.experts, num_experts_per_tok=args.topk, vocab_size=151936)


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (all MoE)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size")
    parser.add_argument("--experts", type=int, default=64, help="routed experts per layer")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")
    parser.add_argument("--expert-ffn", type=int, default=384, help="FFN size of each expert")
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts per call (4 mini-batches)")
    parser.add_argument("--max-prompt", type=int, default=1024, help="longest prompt")
    parser.add_argument("--max-response", type=int, default=4096, help="longest response (log-normal lengths)")
    parser.add_argument("--token-budget", type=int, default=16384, help="tokens per packed micro-batch")
    parser.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size (run under torchrun)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each kind (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed call pairs first")
    parser.add_argument("--cpu-tiny", action="store_true", help="tiny shape and batch, for a check without a GPU")
    args = parser.parse_args()
    if args.cpu_tiny:
        args.rollouts, args.max_prompt, args.max_response, args.token_budget, args.repeats, args.warmup = 8, 16, 32, 128, 1, 1

    s = shape(args)
    batch = rollouts(args.rollouts, s["vocab_size"], args.max_prompt, args.max_response)
    config = load_config([f"model.{k}={v}" for k, v in s.items()] + [
        "model.model_type=qwen3_moe", "model.qk_layernorm=true", "model.attention_bias=false",
        "model.norm_topk_prob=true", f"model.max_position_embeddings={args.max_prompt + args.max_response}",
        f"megatron.expert_model_parallel_size={args.ep}",
        f"data.rollouts_per_step={args.rollouts}", f"ppo_mini_batch_size={args.rollouts // 4}",
        f"data.prompt_length=[1,{args.max_prompt}]", f"data.response_length=[1,{args.max_response}]",
        "use_dynamic_bsz=true", f"ppo_max_token_len_per_gpu={args.token_budget}", "optim.lr=1e-6"])
    worker = CriticWorker(config)
    worker.init_model()
    try:
        tokens = int(batch["attention_mask"].sum())
        for _ in range(args.warmup):  # to steady state: allocator, compiled kernels' variants per length
            worker.compute_values(batch)
            worker.update_critic(batch)
        results = {}
        for name, call in (("compute_values", lambda: worker.compute_values(batch)),
                           ("update_critic", lambda: worker.update_critic(batch))):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            seconds = statistics.median(timed(call) for _ in range(args.repeats))
            results[name] = (tokens / seconds, peak_gib())
        if not dist.is_initialized() or dist.get_rank() == 0:
            params = sum(p.numel() for chunk in worker.state.model for p in chunk.parameters())
            print(f"shape {s}, ep={args.ep}, {args.rollouts} rollouts, {tokens} real tokens, "
                  f"{params / 1e6:.0f}M parameters on rank 0")
            for name, (rate, peak) in results.items():
                print(f"{name:15s} {rate:12,.0f} real tokens/s   peak {peak:.1f} GiB")
    finally:
        worker.close()


if __name__ == "__main__":
    main()
