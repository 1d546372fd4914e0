"""Do liger-kernel's or quack's RMSNorm / SwiGLU beat the ones the critic runs? Forward + backward over one
16,384-token micro-batch of a shape, bf16, median of 20 after 5 warm-ups, with the largest difference
from the critic's kernel (same inputs):

* RMSNorm [t, hidden]: ours (torch.compile of the float32 RMSNorm, layers._compiled_rms_norm) against
  liger's LigerRMSNormFunction (casting_mode="llama", Qwen2's) and quack's rmsnorm (CuTe DSL);
* SwiGLU [t, 2 * ffn] -> [t, ffn]: Megatron's fused bias_swiglu (the critic's, compiled) against liger's
  LigerSiLUMulFunction and an eager silu(a) * b.

    python bench/swiglu_norm_probe.py [--shape qwen2.5-1.5b] [--tokens 16384]
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from megacritic.bench import SHAPES


def timed(fn, repeats=20) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fwd_bwd(fn, inputs, grad):
    def run():
        leaves = [x.detach().requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(grad)
        return out, [x.grad for x in leaves]
    return run


def report(name, variants, inputs, grad):
    ref_out, ref_grads = None, None
    for label, fn in variants:
        try:
            run = fwd_bwd(fn, inputs, grad)
            out, grads = run()
            ms = timed(run)
        except Exception as e:  # noqa: BLE001 - a library that fails here is reported, not fatal
            print(f"{name:8} {label:34} failed: {type(e).__name__}: {str(e)[:160]}")
            continue
        if ref_out is None:
            ref_out, ref_grads = out.float(), [g.float() for g in grads]
        diff = max([float((out.float() - ref_out).abs().max())]
                   + [float((g.float() - r).abs().max()) for g, r in zip(grads, ref_grads)])
        print(f"{name:8} {label:34} {ms:8.3f} ms   max |diff| vs first {diff:.3e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=[s for s in SHAPES if s != "tiny"])
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    shape, t = SHAPES[args.shape], args.tokens
    h, ffn = shape["hidden_size"], shape["intermediate_size"]
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16

    from megacritic.model.layers import _compiled_rms_norm
    x = torch.randn(t, h, device=dev, dtype=bf16)
    w = (1 + 0.1 * torch.randn(h, device=dev)).to(bf16)
    variants = [("ours (torch.compile, float32 inside)", lambda x, w: _compiled_rms_norm()(x, w, 1e-6))]
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        variants.append(("liger LigerRMSNormFunction (llama)",
                         lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)))
    except ImportError as e:
        print("liger-kernel:", e)
    try:
        from quack.rmsnorm import rmsnorm
        variants.append(("quack rmsnorm", lambda x, w: rmsnorm(x, w, eps=1e-6)))
    except ImportError as e:
        print("quack:", e)
    report("rmsnorm", variants, [x, w], torch.randn_like(x))

    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    y = torch.randn(t, 2 * ffn, device=dev, dtype=bf16)
    variants = [("megatron fused bias_swiglu", lambda y: bias_swiglu_impl(y, None)),
                ("eager silu(a) * b", lambda y: (lambda a, b: F.silu(a) * b)(*y.chunk(2, -1)))]
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        variants.append(("liger LigerSiLUMulFunction",
                         lambda y: LigerSiLUMulFunction.apply(*y.chunk(2, -1))))
    except ImportError as e:
        print("liger-kernel:", e)
    report("swiglu", variants, [y], torch.randn(t, ffn, device=dev, dtype=bf16))


if __name__ == "__main__":
    main()
