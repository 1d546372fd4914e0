"""Is a grouped-GEMM expert path worth building? One MoE layer's experts (SwiGLU FFN per expert), forward +
backward in bf16 on one GPU, two ways on the same routed tokens:

* ``sequential``: what Megatron-Core's SequentialMLP does without grouped GEMM: split the permuted tokens by
  expert and run each expert's two matmuls in a Python loop;
* ``grouped``: the experts' weights stacked (``torch.stack``, as separate per-expert parameters would need
  every step) and one ``torch._grouped_mm`` per projection.

    python bench/moe_experts_probe.py [--tokens 16384] [--topk 8] [--experts 64] [--hidden 1024] [--ffn 384]
"""

import argparse
import time

import torch
import torch.nn.functional as F


def sequential(x, counts, w1, w2):
    outs = []
    for e, xe in enumerate(torch.split(x, counts)):
        gate, up = (xe @ w1[e].t()).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w2[e].t())
    return torch.cat(outs)


def grouped(x, offs, w1, w2):
    h = torch._grouped_mm(x, torch.stack(w1).transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, torch.stack(w2).transpose(1, 2), offs=offs)


def timed(fn, repeats=10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of one packed micro-batch")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=384)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (it measures GPU kernels)")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    routed = args.tokens * args.topk
    # Uneven load, as a router gives: Dirichlet shares over the experts.
    shares = torch.distributions.Dirichlet(torch.full((args.experts,), 2.0)).sample()
    counts = (shares * routed).long()
    counts[-1] += routed - counts.sum()
    counts = counts.tolist()
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(routed, args.hidden, device=dev, dtype=dt, requires_grad=True)
    w1 = [torch.nn.Parameter(torch.randn(2 * args.ffn, args.hidden, device=dev, dtype=dt) * 0.02)
          for _ in range(args.experts)]
    w2 = [torch.nn.Parameter(torch.randn(args.hidden, args.ffn, device=dev, dtype=dt) * 0.02)
          for _ in range(args.experts)]
    grad = torch.randn(routed, args.hidden, device=dev, dtype=dt)

    ref, out = sequential(x, counts, w1, w2), grouped(x, offs, w1, w2)
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    flops = 3 * 2 * routed * args.hidden * 3 * args.ffn  # fwd + bwd of both projections
    print(f"{args.experts} experts, {routed} routed tokens (min {min(counts)}, max {max(counts)} per expert), "
          f"grouped vs sequential forward rel. difference {err:.1e}")
    for name, fn in (("sequential", lambda: sequential(x, counts, w1, w2).backward(grad)),
                     ("grouped", lambda: grouped(x, offs, w1, w2).backward(grad))):
        t = timed(fn)
        print(f"{name:11} fwd+bwd {t * 1e3:7.2f} ms per layer per micro-batch, {flops / t / 1e12:6.1f} TFLOP/s")


if __name__ == "__main__":
    main()
