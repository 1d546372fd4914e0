"""A few critic steps of a real-sized model: tokens/s and peak memory of compute_values and update_critic.

    python bench/gpu_smoke.py                 # Qwen2.5-0.5B shape, bf16, on the GPU
    python bench/gpu_smoke.py --shape tiny    # the same script on CPU, in seconds

Rollouts are seeded: prompts 64-1024 tokens, responses long-tailed 16-8192 (median ~1024). Dynamic
micro-batches under a token budget; one warm-up call of each phase, then timed calls.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tensordict import TensorDict

from megacritic import CriticWorker, load_config

SHAPES = {
    # Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads / 2 kv heads, FFN 4864, vocab 151936, QKV bias.
    "0.5b": ["model.hidden_size=896", "model.num_hidden_layers=24", "model.num_attention_heads=14",
             "model.num_key_value_heads=2", "model.intermediate_size=4864", "model.vocab_size=151936",
             "model.max_position_embeddings=16384", "model.rope_theta=1000000.0", "model.attention_bias=true"],
    "tiny": ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_attention_heads=4",
             "model.num_key_value_heads=2", "model.intermediate_size=128", "model.vocab_size=256",
             "model.max_position_embeddings=2048"],
}


def rollouts(n: int, vocab: int, max_prompt: int, max_response: int, seed: int = 0) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    p_len = torch.randint(min(64, max_prompt), max_prompt + 1, (n,), generator=gen)
    # log-normal response lengths, median ~1024 at full scale, clipped to [16, max_response]
    r_len = (torch.randn(n, generator=gen) * 0.9 + torch.log(torch.tensor(max_response / 8.0))).exp()
    r_len = r_len.round().long().clamp(min(16, max_response), max_response)
    cols_p, cols_r = torch.arange(max_prompt), torch.arange(max_response)
    mask = torch.cat([cols_p[None] >= (max_prompt - p_len)[:, None], cols_r[None] < r_len[:, None]], 1).long()
    ids = torch.randint(0, vocab, mask.shape, generator=gen) * mask
    returns = torch.randn(n, max_response, generator=gen) * (cols_r[None] < r_len[:, None])
    return TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
                       "responses": ids[:, max_prompt:], "returns": returns}, batch_size=[n])


def flops_per_token(cfg, seq_len: float) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), attention at the mean causal length."""
    m = cfg.model
    hd = m.head_dim or m.hidden_size // m.num_attention_heads
    q, kv = m.num_attention_heads * hd, m.num_key_value_heads * hd
    per_layer = 2 * m.hidden_size * (q + 2 * kv) + 2 * q * m.hidden_size + 3 * 2 * m.hidden_size * m.intermediate_size
    attention = 2 * 2 * q * seq_len / 2  # QK^T and PV over the causal half
    return 3 * m.num_hidden_layers * (per_layer + attention)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.5b" if torch.cuda.is_available() else "tiny", choices=SHAPES)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--out", default=None)
    args, extra = parser.parse_known_args()
    full = args.shape != "tiny"
    max_prompt, max_response = (1024, 8192) if full else (32, 128)
    budget = args.token_budget if full else 512
    config = load_config(SHAPES[args.shape] + [
        f"data.rollouts_per_step={args.rollouts}", f"ppo_mini_batch_size={args.rollouts // 4}",
        "use_dynamic_bsz=true", f"ppo_max_token_len_per_gpu={budget}", f"data.prompt_length=[1,{max_prompt}]",
        f"data.response_length=[1,{max_response}]", "optim.lr=1e-5", "trainer.steps=4"] + extra)
    worker = CriticWorker(config)
    worker.init_model()
    batch = rollouts(args.rollouts, config.model.vocab_size, max_prompt, max_response)
    real_tokens = int(batch["attention_mask"].sum())
    mean_len = real_tokens / args.rollouts
    cuda = torch.cuda.is_available()

    def timed(fn):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - start

    rows = []
    batch["values"] = worker.compute_values(batch)  # warm-up
    worker.update_critic(batch)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for call in range(args.calls):
        values, t_values = timed(lambda: worker.compute_values(batch))
        batch["values"] = values
        metrics, t_update = timed(lambda: worker.update_critic(batch))
        assert torch.isfinite(values).all() and all(map(lambda x: x == x, metrics["critic/vf_loss"]))
        rows.append({"call": call, "values_s": t_values, "update_s": t_update,
                     "vf_loss": metrics["critic/vf_loss"], "grad_norm": metrics["critic/grad_norm"]})
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    t_values = min(r["values_s"] for r in rows)
    t_update = min(r["update_s"] for r in rows)
    fpt = flops_per_token(config, mean_len)
    summary = {
        "shape": args.shape, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "rollouts": args.rollouts, "real_tokens": real_tokens, "token_budget": budget,
        "values_tokens_per_s": real_tokens / t_values, "update_tokens_per_s": real_tokens / t_update,
        "update_tflops": fpt * real_tokens / t_update / 1e12, "values_tflops": fpt / 3 * real_tokens / t_values / 1e12,
        "peak_mem_gib": peak, "calls": rows,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    worker.close()


if __name__ == "__main__":
    main()
