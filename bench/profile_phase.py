"""Where one critic call spends its time: per-call wall times over several calls, torch.compile
recompilations, and a torch profiler table of one call (top kernels by self CUDA time, then by host time).

    python bench/profile_phase.py [--shape qwen2.5-1.5b] [--phase update|values] [--calls 5] [--trace OUT.json]
        [KEY=VALUE ...]   # config overrides, e.g. model.use_fused_kernels=false
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from megacritic import CriticWorker, load_config
from megacritic.bench import SHAPES, rollouts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--phase", default="update", choices=("update", "values"))
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=5, help="timed calls before the profiled one")
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    args, extra = parser.parse_known_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (it measures GPU kernels)")
    shape = SHAPES[args.shape]
    batch = rollouts(args.rollouts, shape["vocab_size"], 1024, 8192)
    config = load_config([f"model.{k}={v}" for k, v in shape.items()] + [
        "model.attention_bias=true", "model.rope_theta=1000000.0", "model.max_position_embeddings=9216",
        f"data.rollouts_per_step={args.rollouts}", f"ppo_mini_batch_size={args.rollouts // 4}",
        "use_dynamic_bsz=true", f"ppo_max_token_len_per_gpu={args.token_budget}", "data.prompt_length=[1,1024]",
        "data.response_length=[1,8192]", "optim.lr=1e-6"] + extra)
    worker = CriticWorker(config)
    worker.init_model()
    call = (lambda: worker.update_critic(batch)) if args.phase == "update" else (lambda: worker.compute_values(batch))
    worker.compute_values(batch)  # warm-up of both phases, as the benchmark does
    worker.update_critic(batch)
    tokens = int(batch["attention_mask"].sum())
    from torch._dynamo.utils import counters
    for i in range(args.calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        frames = dict(counters["stats"]) if "stats" in counters else {}
        print(f"call {i}: {seconds:.3f} s, {tokens / seconds:,.0f} real tokens/s, dynamo stats {frames}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    worker.close()


if __name__ == "__main__":
    main()
