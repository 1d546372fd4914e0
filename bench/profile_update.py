"""Where update_critic spends its GPU time: torch profiler over one call, top kernels by CUDA time.

    python bench/profile_update.py [--shape qwen2.5-1.5b] [--rollouts 32] [--trace OUT.json]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from megacritic import CriticWorker, load_config
from megacritic.bench import SHAPES, rollouts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--trace", default=None)
    args, extra = parser.parse_known_args()
    shape = SHAPES[args.shape]
    batch = rollouts(args.rollouts, shape["vocab_size"], 1024, 8192)
    config = load_config([f"model.{k}={v}" for k, v in shape.items()] + [
        "model.attention_bias=true", "model.max_position_embeddings=9216", f"data.rollouts_per_step={args.rollouts}",
        f"ppo_mini_batch_size={args.rollouts // 4}", "use_dynamic_bsz=true",
        f"ppo_max_token_len_per_gpu={args.token_budget}", "data.prompt_length=[1,1024]",
        "data.response_length=[1,8192]", "optim.lr=1e-6"] + extra)
    worker = CriticWorker(config)
    worker.init_model()
    worker.update_critic(batch)  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        worker.update_critic(batch)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    worker.close()


if __name__ == "__main__":
    main()
