"""Which of the remaining non-GEMM costs of update_critic are worth replacing? Four probes on one GPU, on the
bench's packed micro-batches (the 32 seeded rollouts, packed into 16,384-token micro-batches), bf16:

* attention: FlashAttention-2 (``varlen_attn``, today's path) against cuDNN's fused attention on the same
  packs (nested-tensor SDPA, keys and values expanded to the query heads, the expansion timed too);
* RoPE: Megatron's unfused ``apply_rotary_pos_emb`` on q and k against one compiled kernel with cos / sin
  computed once per micro-batch;
* weight-gradient accumulation: ``mm`` to bf16 then ``main_grad.add_`` (Megatron without apex) against one
  ``addmm`` that accumulates into the float32 ``main_grad`` (cuBLAS, bf16 inputs, float32 output);
* the MLP: cuBLAS GEMMs around Megatron's fused SwiGLU against quack's GEMMs with the SwiGLU (and in the
  backward its derivative) in the GEMM's epilogue.
* the fused MLP's backward GEMMs one by one (``--only mlpbwd``): heuristic tile configuration, autotuned per pack,
  each of quack's Hopper configurations pinned for every pack, cuBLAS.

Each row: forward (+ backward) over all packs of one layer, median of 10 after 3 warm-ups, and the largest
difference from the reference path.

    python bench/kernel_probe.py [--shape qwen2.5-1.5b] [--budget 16384]
"""

import argparse
import statistics
import time
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from megacritic.bench import SHAPES, rollouts


def packs(budget: int) -> list[list[int]]:
    """The bench's rollout lengths, packed greedily in order into micro-batches of at most ``budget`` tokens."""
    lens = rollouts(32, 1000, 1024, 8192)["attention_mask"].sum(1).tolist()
    out, cur = [], []
    for n in lens:
        if cur and sum(cur) + n > budget:
            out.append(cur)
            cur = []
        cur.append(n)
    return out + [cur]


def timed(fn, repeats=10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_seconds(fn, repeats=3) -> float:
    """The GPU's own time in ``fn``'s kernels (their durations summed, per call). A pack's norm or split is
    ~10-50 us of GPU work, less than the host takes to launch it, so ``timed`` (wall time) measures the
    launch path; in a step the GPU is busy with other layers meanwhile, and what it pays is this."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.events()
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)) / repeats / 1e6


def timed_pair(what: str, name: str, run, diff: float) -> list[tuple]:
    """Forward alone (``run(False)``) and forward + backward (``run(True)``) of one path: wall time (the host's
    launches included) and the kernels' GPU time, printed."""
    rows = []
    for label, backward in ((f"{what}, forward", False), (f"{what}, fwd + bwd", True)):
        wall, gpu = timed(lambda: run(backward)), kernel_seconds(lambda: run(backward))
        rows.append((label, name, wall, diff))
        print(f"{label:30} {name:45} {wall * 1e3:9.3f} {gpu * 1e3:9.3f} {diff:9.2e}", flush=True)
    return rows


def attention_rows(shape, micro, with_cudnn: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn
    heads, groups = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape["hidden_size"] // heads
    data = []
    for lens in micro:
        t = sum(lens)
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        q = torch.randn(t, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(t, groups, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(t, groups, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        data.append((q, k, v, cu, max(lens), torch.randn(t, heads, d, device="cuda", dtype=torch.bfloat16)))

    def fa2():
        outs = []
        for q, k, v, cu, m, g in data:
            o = varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0))
            o.backward(g)
            outs.append(o.detach())
        return outs

    def cudnn():
        outs = []
        for q, k, v, cu, m, g in data:
            rep = heads // groups
            ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            offs = cu.long()
            nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x, offs, max_seqlen=m).transpose(1, 2)
                          for x in (q, ke, ve))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(nq, nk, nv, is_causal=True).transpose(1, 2).values()
            o.backward(g)
            outs.append(o.detach())
        return outs

    ref = fa2()
    rows = [("attention", "FlashAttention-2 varlen", timed(fa2), 0.0)]
    if not with_cudnn:
        return rows
    try:
        out = cudnn()
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, out))
        rows.append(("attention", "cuDNN (nested SDPA, KV expanded)", timed(cudnn), diff))
    except Exception as e:  # noqa: BLE001 - a probe reports what is unavailable
        rows.append(("attention", f"cuDNN unavailable: {type(e).__name__}: {str(e)[:120]}", float("nan"), float("nan")))
    return rows


def rope_rows(shape, micro):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    heads, groups = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape["hidden_size"] // heads
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    data = []
    for lens in micro:
        t = sum(lens)
        pos = torch.cat([torch.arange(n, device="cuda") for n in lens]).float()
        freqs = torch.outer(pos, inv)
        freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]  # [t, 1, 1, d] as Megatron builds it
        q = torch.randn(t, 1, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(t, 1, groups, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        data.append((q, k, freqs, torch.randn_like(q), torch.randn_like(k)))

    def megatron():
        outs = []
        for q, k, freqs, gq, gk in data:
            qo, ko = _apply_rotary_pos_emb_bshd(q, freqs), _apply_rotary_pos_emb_bshd(k, freqs)
            torch.autograd.backward([qo, ko], [gq, gk])
            outs.append(qo.detach())
        return outs

    def rotate(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return (x.float() * cos + torch.cat([-x2, x1], dim=-1).float() * sin).to(x.dtype)

    def both(q, k, cos, sin):
        return rotate(q, cos, sin), rotate(k, cos, sin)

    compiled = torch.compile(both, dynamic=True)

    def fused():
        outs = []
        for q, k, freqs, gq, gk in data:
            cos, sin = freqs.cos(), freqs.sin()  # once per micro-batch in the model
            qo, ko = compiled(q, k, cos, sin)
            torch.autograd.backward([qo, ko], [gq, gk])
            outs.append(qo.detach())
        return outs

    ref = megatron()
    out = fused()
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, out))
    return [("rope (q and k)", "Megatron unfused", timed(megatron), 0.0),
            ("rope (q and k)", "compiled, cos/sin per micro-batch", timed(fused), diff)]


def wgrad_rows(shape, micro):
    h, ffn, heads, groups = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                 "num_key_value_heads"))
    d = h // heads
    linears = [(h, (heads + 2 * groups) * d), (heads * d, h), (h, 2 * ffn), (ffn, h)]  # qkv, proj, fc1, fc2
    data = []
    for lens in micro:
        t = sum(lens)
        for n_in, n_out in linears:
            data.append((torch.randn(t, n_in, device="cuda", dtype=torch.bfloat16),
                         torch.randn(t, n_out, device="cuda", dtype=torch.bfloat16)))
    mains = [torch.zeros(n_out, n_in, device="cuda") for n_in, n_out in linears]

    def unfused():
        for i, (x, g) in enumerate(data):
            mains[i % len(linears)].add_(g.t() @ x)

    def fused():
        for i, (x, g) in enumerate(data):
            m = mains[i % len(linears)]
            torch.addmm(m, g.t(), x, out_dtype=torch.float32, out=m)

    for m in mains:
        m.zero_()
    unfused()
    ref = [m.clone() for m in mains]
    for m in mains:
        m.zero_()
    try:
        fused()
        diff = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(ref, mains))
        row = ("wgrad accumulate (4 linears)", "addmm into fp32 main_grad", timed(fused), diff)
    except Exception as e:  # noqa: BLE001
        row = ("wgrad accumulate (4 linears)", f"addmm out_dtype unavailable: {str(e)[:120]}", float("nan"),
               float("nan"))
    return [("wgrad accumulate (4 linears)", "mm to bf16 + main_grad.add_", timed(unfused), 0.0), row]


def mlp_rows(shape, micro):
    """One layer's MLP (fc1, SwiGLU, fc2), forward + backward with both weight gradients accumulated into
    float32 buffers, over all packs: today's path (cuBLAS GEMMs, Megatron's fused SwiGLU, ``addmm`` into
    float32) against quack's Hopper GEMMs with the SwiGLU in fc1's epilogue (``gemm_act``) and its derivative
    in the backward GEMM's (``gemm_dact``). quack wants fc1's gate and up rows interleaved: its weight is the
    same matrix with rows reordered (a one-time layout change), so both paths compute the same function."""
    from megatron.core.fusions.fused_bias_swiglu import swiglu, swiglu_back

    h, ffn = shape["hidden_size"], shape["intermediate_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(2 * ffn, h, device="cuda", generator=gen) / h ** 0.5).bfloat16()  # [gate; up]
    w2 = (torch.randn(h, ffn, device="cuda", generator=gen) / ffn ** 0.5).bfloat16()
    w1i = torch.stack([w1[:ffn], w1[ffn:]], dim=1).reshape(2 * ffn, h)  # rows gate_0, up_0, gate_1, ...
    data = [(torch.randn(sum(lens), h, device="cuda", generator=gen).bfloat16(),
             torch.randn(sum(lens), h, device="cuda", generator=gen).bfloat16()) for lens in micro]
    g1, g2 = torch.zeros(2 * ffn, h, device="cuda"), torch.zeros(h, ffn, device="cuda")

    def today():
        outs = []
        for x, dout in data:
            y = x @ w1.t()
            a = swiglu(y)
            outs.append(a @ w2.t())
            da = dout @ w2
            torch.addmm(g2, dout.t(), a, out_dtype=torch.float32, out=g2)
            dy = swiglu_back(da, y)
            outs.append(dy @ w1)
            torch.addmm(g1, dy.t(), x, out_dtype=torch.float32, out=g1)
        return outs

    def today_forward():
        return [swiglu(x @ w1.t()) @ w2.t() for x, _ in data]

    rows = [("MLP fwd (fc1, SwiGLU, fc2)", "cuBLAS + Megatron fused SwiGLU", timed(today_forward), 0.0),
            ("MLP fwd + bwd (fc1, SwiGLU, fc2)", "cuBLAS + Megatron fused SwiGLU", timed(today), 0.0)]
    for row in rows:
        print(*row, flush=True)
    try:
        from quack.gemm_interface import gemm, gemm_act, gemm_dact
    except Exception as e:  # noqa: BLE001 - a probe: report why the candidate did not run
        return rows + [("MLP", f"quack unavailable: {type(e).__name__}: {str(e)[:90]}", float("nan"), float("nan"))]

    def relative(ref, got):
        return max(((r.float() - g.float()).abs().max() / r.float().abs().max()).item() for r, g in zip(ref, got))

    # tuned=False: quack's heuristic config (its autotuner keys on the full shape, so every new pack length
    # would tune again); tuned=True last: the autotuned best per pack length, the kernels' ceiling.
    for tuned in (False, True):
        def forward():
            return [gemm(gemm_act(x, w1i.t(), activation="swiglu", store_preact=False, tuned=tuned)[1], w2.t(),
                         tuned=tuned) for x, _ in data]

        def fused():
            outs = []
            for x, dout in data:
                preact, a = gemm_act(x, w1i.t(), activation="swiglu", tuned=tuned)
                outs.append(gemm(a, w2.t(), tuned=tuned))
                dpreact, a_again = gemm_dact(dout, w2, preact, activation="swiglu", tuned=tuned)
                torch.addmm(g2, dout.t(), a_again, out_dtype=torch.float32, out=g2)
                outs.append(gemm(dpreact, w1i, tuned=tuned))
                torch.addmm(g1, dpreact.t(), x, out_dtype=torch.float32, out=g1)
            return outs

        try:
            name = "autotuned" if tuned else "heuristic config"
            rows.append(("MLP fwd (fc1, SwiGLU, fc2)", f"quack gemm_act + gemm, {name}", timed(forward),
                         relative(today_forward(), forward())))
            print(*rows[-1], flush=True)
            rows.append(("MLP fwd + bwd (fc1, SwiGLU, fc2)", f"quack gemm_act / gemm_dact, {name}", timed(fused),
                         relative(today(), fused())))
            print(*rows[-1], flush=True)
        except Exception as e:  # noqa: BLE001
            rows.append(("MLP", f"quack failed: {type(e).__name__}: {str(e)[:90]}", float("nan"), float("nan")))
    # the plain GEMMs alone: quack against cuBLAS on fc1's and fc2's forward shapes
    x = data[0][0]
    a = torch.randn(x.shape[0], ffn, device="cuda", generator=gen).bfloat16()
    rows += [("GEMM fc1 fwd [M, h] x [h, 2F]", "cuBLAS", timed(lambda: [x @ w1.t() for x, _ in data]), 0.0),
             ("GEMM fc1 fwd [M, h] x [h, 2F]", "quack heuristic",
              timed(lambda: [gemm(x, w1.t(), tuned=False) for x, _ in data]), 0.0),
             ("GEMM fc2 fwd [M, F] x [F, h]", "cuBLAS (first pack)", timed(lambda: a @ w2.t()), 0.0),
             ("GEMM fc2 fwd [M, F] x [F, h]", "quack heuristic (first pack)",
              timed(lambda: gemm(a, w2.t(), tuned=False)), 0.0)]
    return rows


def mlp_backward_rows(shape, micro):
    """The fused MLP's backward GEMMs one by one, as ``megacritic.model.mlp_kernel`` runs them (quack, heuristic
    tile configuration), against the same GEMM autotuned per pack (``QUACK_PRINT_AUTOTUNING=1`` prints every
    configuration's time), each configuration pinned for all packs, cuBLAS on Megatron's ``[gate | up]``
    layout, and ``gemm_dact`` without its second output (were the activation kept from the forward: is its
    epilogue what bounds it?). GPU time of one layer over all packs (``kernel_seconds``): the update is bound
    by the GPU at 1.5B and 3B, so this is what a call pays."""
    from quack.gemm_interface import gemm_dact

    w1, w2, g1, packs_ = mlp_packs(shape, micro)
    today = package_calls(w1, w2, g1)
    first = packs_[0]  # both layouts hold one gradient: quack's alternates gate and up columns
    halves = torch.cat([first.dpre[:, 0::2], first.dpre[:, 1::2]], dim=1).float()
    print(f"first pack, pre-activation gradient, quack against cuBLAS + kernel: relative difference "
          f"{((halves - first.dy.float()).abs().max() / first.dy.float().abs().max()).item():.2e}", flush=True)

    def quack(name, call):  # call(pack, tuned): the package's heuristic tile, then the autotuner's winner
        return [(f"{name}, heuristic (today)", lambda p: call(p, False)),
                (f"{name}, autotuned", lambda p: call(p, True))]

    dpre_alone = today["dact, no activation out"]
    try:
        alone = dpre_alone(first, False)
        print(f"first pack, pre-activation gradient, the epilogue without the activation against gemm_dact: "
              f"{'equal' if torch.equal(alone, first.dpre) else 'NOT equal'}", flush=True)
    except Exception as e:  # noqa: BLE001 - a probe: its rows below report the failure too
        print(f"the epilogue without the activation did not run: {type(e).__name__}: {str(e)[:200]}", flush=True)

    candidates = {
        "dact: dout @ W2, SwiGLU'": quack(
            "quack gemm_dact", lambda p, tuned: gemm_dact(p.dout, w2, p.pre, activation="swiglu", tuned=tuned)) + [
            # the activation kept from the forward instead: 2 of the epilogue's 10 bytes per element not written
            ("quack, no activation out, heuristic", lambda p: dpre_alone(p, False)),
            ("quack, no activation out, autotuned", lambda p: dpre_alone(p, True)),
            ("cuBLAS + SwiGLU backward kernel",
             lambda p: torch.autograd.grad(p.act, p.y, p.dout @ w2, retain_graph=True))],
        "fc1 input grad: dpre @ W1": quack("quack, concat layout", today["fc1 input grad: dpre @ W1"]) + [
            ("cuBLAS, [gate | up]", lambda p: p.dy @ w1)],
        "fc1 weight grad into float32": quack("quack add in place, concat", today["fc1 weight grad into float32"]) + [
            ("cuBLAS addmm, [gate | up]", lambda p: torch.addmm(g1, p.dy.t(), p.x, out_dtype=torch.float32, out=g1))],
    }
    rows = []
    for what, paths in candidates.items():
        for name, fn in paths:
            try:
                gpu = kernel_seconds(lambda: [fn(p) for p in packs_])
            except Exception as e:  # noqa: BLE001 - a probe: report why the candidate did not run
                print(f"{what:30} {name:45} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                gpu = float("nan")
            rows.append((what, name, gpu, float("nan")))
            print(f"{what:30} {name:45} {'':>9} {gpu * 1e3:9.3f}", flush=True)

    # One configuration for every pack: what a pin (``config=``) would give. The autotuned rows above pick a
    # winner per token count (each pack's); the package needs one that holds for all. After the autotuned
    # rows, so their sweep has compiled these kernels.
    heuristic = {what: t for what, name, t, _ in rows if name.endswith("heuristic (today)")}
    return rows + pinned_sweeps(pinned_calls(shape, w1, w2, g1, packs_), packs_, heuristic)


def mlp_packs(shape, micro):
    """fc1 / fc2 weights of one layer (random, seeded), fc1's float32 gradient buffer, and per pack the MLP's
    input, output gradient, quack's interleaved pre-activation and its gradient, and the same on cuBLAS's
    ``[gate | up]`` layout."""
    from quack.gemm_interface import gemm_act, gemm_dact

    from megacritic.model.swiglu_kernel import swiglu

    h, ffn = shape["hidden_size"], shape["intermediate_size"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(2 * ffn, h, device="cuda", generator=gen) / h ** 0.5).bfloat16()  # [gate; up]
    w2 = (torch.randn(h, ffn, device="cuda", generator=gen) / ffn ** 0.5).bfloat16()
    g1 = torch.zeros(2 * ffn, h, device="cuda")
    packs_ = []
    for lens in micro:
        x = torch.randn(sum(lens), h, device="cuda", generator=gen).bfloat16()
        dout = torch.randn(sum(lens), h, device="cuda", generator=gen).bfloat16()
        pre, _ = gemm_act(x, w1.t(), activation="swiglu", tuned=False, concat_layout=("B",))  # interleaved
        dpre, _ = gemm_dact(dout, w2, pre, activation="swiglu", tuned=False)
        y = (x @ w1.t()).requires_grad_()  # cuBLAS's pre-activation, [gate | up]
        act = swiglu(y)
        dy = torch.autograd.grad(act, y, dout @ w2, retain_graph=True)[0]
        packs_.append(SimpleNamespace(x=x, dout=dout, pre=pre, dpre=dpre, y=y, act=act, dy=dy))
    return w1, w2, g1, packs_


def package_calls(w1, w2, g1) -> dict:
    """The fused MLP's backward GEMMs as ``megacritic.model.mlp_kernel`` calls them, each call(pack, tuned):
    tuned=False is the package's heuristic tile, tuned=True quack's autotuner (a winner per token count)."""
    from quack.gemm_interface import gemm, gemm_add_inplace

    from megacritic.model.mlp_kernel import dswiglu_epilogue

    return {
        "dact, no activation out": lambda p, tuned: dswiglu_epilogue()(
            p.dout, w2, p.pre, out={"D": torch.empty_like(p.pre)}, tuned=tuned, dynamic_scheduler=True)["D"],
        "fc1 input grad: dpre @ W1": lambda p, tuned: gemm(p.dpre, w1, dynamic_scheduler=True, tuned=tuned,
                                                           concat_layout=("B",)),
        "fc1 weight grad into float32": lambda p, tuned: gemm_add_inplace(
            p.dpre.t(), p.x, g1, dynamic_scheduler=True, tuned=tuned, concat_layout=("C", "out")),
    }


def pinned_calls(shape, w1, w2, g1, packs_) -> dict:
    """Per backward GEMM of the fused MLP: quack's Hopper configurations for it, and call(pack, config)."""
    from quack.gemm_config import get_all_configs
    from quack.gemm_interface import gemm_dact, gemm_tuned

    sm90 = [c for c in get_all_configs() if c.device_capacity == 9 and not c.swap_ab]
    gated = [c for c in get_all_configs(epilogue="gated") if c.device_capacity == 9 and not c.swap_ab]
    dx = torch.empty(max(p.x.shape[0] for p in packs_), shape["hidden_size"], device="cuda", dtype=torch.bfloat16)
    return {
        "dact: dout @ W2, SwiGLU'": (gated, lambda p, c: gemm_dact(p.dout, w2, p.pre, activation="swiglu",
                                                                   config=c)),
        "fc1 input grad: dpre @ W1": (sm90, lambda p, c: gemm_tuned.fn(
            p.dpre, w1, dx[:p.x.shape[0]], None, dynamic_scheduler=True, config=c, concat_layout=("B",))),
        "fc1 weight grad into float32": (sm90, lambda p, c: gemm_tuned.fn(
            p.dpre.t(), p.x, g1, None, add_to_output=True, dynamic_scheduler=True, config=c,
            concat_layout=("C", "out"))),
    }


def pinned_sweeps(calls: dict, packs_, heuristic: dict, today: dict | None = None) -> list[tuple]:
    """Each GEMM of ``calls`` with each of its configurations pinned for every pack (what ``config=`` in the
    package would give; autotuning picks a winner per token count, a pin has to hold for all), its table
    printed against the heuristic tile's GPU time. With ``today`` (what: call(pack)), the package's call and
    the fastest pin are timed again in turns, five each: the GPU's clock drifts over a sweep."""
    rows = []
    for what, (configs, call) in calls.items():
        if what not in heuristic:
            continue
        timings = config_sweep(configs, lambda c: kernel_seconds(lambda: [call(p, c) for p in packs_]))
        rows += [(what, f"pinned {tile_name(c)}", t, float("nan")) for c, t in timings]
        print(config_table(what, timings, heuristic[what]), flush=True)
        if today and what in today and timings:
            best = timings[0][0]
            turns = {"today": [], "pinned": []}
            for _ in range(5):
                turns["today"].append(kernel_seconds(lambda: [today[what](p) for p in packs_]))
                turns["pinned"].append(kernel_seconds(lambda: [call(p, best) for p in packs_]))
            a, b = (statistics.median(turns[k]) for k in ("today", "pinned"))
            print(f"{what}: in turns, today {a * 1e3:.3f} ms, pinned {tile_name(best)} {b * 1e3:.3f} ms "
                  f"({b / a - 1:+.1%})", flush=True)
    return rows


def fc1_pin_rows(shape, micro):
    """fc1's two backward GEMMs of the fused MLP (``--only fc1pins``): the heuristic tile, then every Hopper
    configuration pinned for all packs. The kernels are compiled first by one autotuned call on the largest
    pack (quack's pool compiles them in parallel); the sweep then only runs them."""
    w1, w2, g1, packs_ = mlp_packs(shape, micro)
    calls = {what: call for what, call in pinned_calls(shape, w1, w2, g1, packs_).items() if what.startswith("fc1")}
    today = {what: call for what, call in package_calls(w1, w2, g1).items() if what in calls}
    largest = max(packs_, key=lambda p: p.x.shape[0])
    heuristic = {}
    for what, call in today.items():
        heuristic[what] = kernel_seconds(lambda: [call(p, False) for p in packs_])
        print(f"{what:30} {'heuristic (today)':45} {'':>9} {heuristic[what] * 1e3:9.3f}", flush=True)
        call(largest, True)  # compiles every configuration
    return pinned_sweeps(calls, packs_, heuristic, {what: partial(call, tuned=False) for what, call in today.items()})


def tile_name(c) -> str:
    """A GemmConfig in a table's width: tile, schedule, cluster."""
    return (f"{c.tile_m}x{c.tile_n} {'pingpong' if c.pingpong else 'coop'} "
            f"cluster {c.cluster_m}x{c.cluster_n}")


def config_sweep(configs, seconds) -> list[tuple]:
    """(config, seconds) for every config ``seconds(config)`` ran, fastest first; failures are printed and
    left out (a tile the epilogue's shared memory does not fit, say)."""
    timings = []
    for c in configs:
        try:
            timings.append((c, seconds(c)))
        except Exception as e:  # noqa: BLE001 - a probe: report why the configuration did not run
            print(f"  {tile_name(c)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    return sorted(timings, key=lambda ct: ct[1])


def config_table(what: str, timings: list[tuple], heuristic: float) -> str:
    """The sweep of one GEMM against the heuristic tile's GPU time, and the fastest config in full (to pin)."""
    lines = [f"{what}: one configuration for every pack ({len(timings)} ran), GPU ms, against the heuristic "
             f"tile's {heuristic * 1e3:.3f}"]
    lines += [f"  {tile_name(c):38} {t * 1e3:9.3f} {t / heuristic - 1:+7.1%}" for c, t in timings]
    if timings:
        lines.append(f"  fastest: {timings[0][0]!r}")
    return "\n".join(lines)


def qkv_rows(shape, micro):
    """The QKV projection's output to rotated q / k and v (FusedQKVSelfAttention): Megatron's passes (bias
    add, split, query copy, RoPE) against our Triton kernels (several block shapes) and the compiled function
    they replaced; forward alone and forward + backward over all packs of one layer."""
    from megacritic.model import layers
    heads, groups = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape["hidden_size"] // heads
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    data = []
    for lens in micro:
        t = sum(lens)
        pos = torch.cat([torch.arange(n, device="cuda") for n in lens]).float()
        freqs = torch.outer(pos, inv).repeat(1, 2)[:, None, :]  # [t, 1, d]
        mixed = torch.randn(t, (heads + 2 * groups) * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        data.append((mixed, (freqs.cos().bfloat16(), freqs.sin().bfloat16())))
    bias = torch.randn(data[0][0].shape[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def variant(fn):
        grads = {}

        def run(backward):
            outs = []
            for mixed, rotary in data:
                q, k, v = fn(mixed, bias, rotary)
                if backward:
                    key = q.shape[0]
                    if key not in grads:
                        grads[key] = [torch.randn_like(x) for x in (q, k, v)]
                    torch.autograd.backward([q, k, v], grads[key])
                outs.append(q.detach())
            return outs
        return run

    def formulation(options=None):  # the split as one compiled function, token count dynamic (14b7c37)
        def split(mixed, b, cos, sin):
            x = (mixed.float() + b.float()).view(mixed.shape[0], groups, -1)
            q, k, v = x.split([x.shape[-1] - 2 * d, d, d], dim=-1)
            q = q.reshape(q.shape[0], -1, d)
            c, s = cos.float(), sin.float()
            return (layers._rotate(q, c, s).to(mixed.dtype), layers._rotate(k, c, s).to(mixed.dtype),
                    v.to(mixed.dtype))
        compiled = torch.compile(split, options=options)

        def call(mixed, b, rotary):
            for x in (mixed, *rotary):
                torch._dynamo.maybe_mark_dynamic(x, 0)
            return compiled(mixed, b, *rotary)
        return call

    from megacritic.model import qkv_kernel
    today = (qkv_kernel.BLOCK_T, qkv_kernel.NUM_WARPS)
    triton = lambda m, b, r: layers.split_qkv(m, b, groups, d, r, fused=True)  # noqa: E731
    paths = [
        ("Megatron's passes (eager)", lambda m, b, r: layers.split_qkv(m, b, groups, d, r), None),
        (f"Triton kernels, {today[0]} tokens, {today[1]} warps (today)", triton, today),
        *((f"Triton kernels, {blk} tokens, {warps} warps", triton, (blk, warps))
          for blk, warps in [(32, 4), (64, 4), (128, 8)] if (blk, warps) != today),
        ("compiled, tuned configs (14b7c37)", formulation({"coordinate_descent_tuning": True}), None),
        ("compiled, default launch configs", formulation(), None),
    ]
    ref = variant(paths[0][1])(False)
    rows = []
    for name, fn, config in paths:
        qkv_kernel.BLOCK_T, qkv_kernel.NUM_WARPS = config or today  # read at each launch, forward and backward
        run = variant(fn)
        try:
            out = run(True)
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, out))
            rows += timed_pair("qkv split + RoPE", name, run, diff)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    qkv_kernel.BLOCK_T, qkv_kernel.NUM_WARPS = today
    return rows


def pack_runner(call, data, grads):
    """``run(backward)`` for :func:`timed_pair`: ``call`` on every pack of ``data``, then (``backward``) the
    packs' gradients ``grads`` through autograd; returns the outputs."""
    def run(backward):
        outs = [call(x) for x in data]
        if backward:
            torch.autograd.backward(outs, grads)
        return outs
    return run


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def norm_rows(shape, micro):
    """RMSNorm of the hidden states (two per layer), forward and forward + backward over all packs of one
    layer: eager, compiled (every size symbolic; the token count dynamic, with and without tuned launch
    configs), layers.RMSNorm's fused path (megacritic.model.norm_kernel, at other tiles and warps too),
    liger's Triton kernel and quack's CuTe kernel where they import
    (quack scales in float32 before rounding, eager rounds the normalised value first: not the same
    arithmetic)."""
    from megacritic.model import layers
    h = shape["hidden_size"]
    data = [torch.randn(sum(lens), h, device="cuda", dtype=torch.bfloat16, requires_grad=True) for lens in micro]
    weight = (1 + 0.1 * torch.randn(h, device="cuda")).bfloat16().requires_grad_()
    symbolic = torch.compile(layers._rms_norm, dynamic=True)

    def token_dynamic(options):
        compiled = torch.compile(layers._rms_norm, options=options)

        def call(x, w, eps):
            torch._dynamo.maybe_mark_dynamic(x, 0)
            return compiled(x, w, eps)
        return call
    paths = [("eager", layers._rms_norm), ("compiled, all sizes symbolic (5c719b6)", symbolic),
             ("compiled, tokens dynamic", token_dynamic(None)),
             ("compiled, tokens dynamic, tuned", token_dynamic({"coordinate_descent_tuning": True}))]
    paths.append(("layers.fused_rms_norm (what the layer runs here)", layers.fused_rms_norm))
    # norm_kernel's tile (elements), tiles per backward program and warps: each read at every launch
    from megacritic.model import norm_kernel
    today = (norm_kernel.TILE, norm_kernel.ROW_BLOCKS, norm_kernel.NUM_WARPS)
    configs = {}
    for config in [(8192, 4, 8), (8192, 1, 8), (4096, 1, 4), (2048, 4, 4), (2048, 8, 4), (16384, 2, 16)]:
        name = f"norm_kernel, tile {config[0]}, {config[1]} a backward program, {config[2]} warps"
        configs[name] = config
        paths.append((name, layers.fused_rms_norm))
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        paths.append(("liger, llama casting",
                      lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)))
    except Exception as e:  # noqa: BLE001 - not in this environment
        print(f"liger rms_norm: {type(e).__name__}: {str(e)[:200]}")
    try:
        from quack.rmsnorm import rmsnorm as quack_rmsnorm
        paths.append(("quack (float32 scale, one rounding)", lambda x, w, eps: quack_rmsnorm(x, w, eps=eps)))
    except Exception as e:  # noqa: BLE001 - not in this environment
        print(f"quack rmsnorm: {type(e).__name__}: {str(e)[:200]}")
    grads = [torch.randn_like(x) for x in data]
    ref = [layers._rms_norm(x, weight, 1e-6).detach() for x in data]
    torch.autograd.backward([layers._rms_norm(x, weight, 1e-6) for x in data], grads)
    ref_grads = [x.grad.clone() for x in data] + [weight.grad.clone()]

    rows = []
    for name, fn in paths:
        norm_kernel.TILE, norm_kernel.ROW_BLOCKS, norm_kernel.NUM_WARPS = configs.get(name, today)
        run = pack_runner(lambda x, fn=fn: fn(x, weight, 1e-6), data, grads)
        try:
            for x in (*data, weight):
                x.grad = None
            outs = run(True)
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, outs))
            same = sum(torch.equal(a, b) for a, b in zip(ref, outs))
            got = [x.grad for x in data] + [weight.grad]
            print(f"{name}: outputs equal to eager's in {same} of {len(ref)} packs; input / weight gradient "
                  f"rel. diff {max(_rel(a, b) for a, b in zip(got[:-1], ref_grads[:-1])):.2e} / "
                  f"{_rel(got[-1], ref_grads[-1]):.2e}", flush=True)
            rows += timed_pair("RMSNorm", name, run, diff)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    norm_kernel.TILE, norm_kernel.ROW_BLOCKS, norm_kernel.NUM_WARPS = today
    return rows


def swiglu_rows(shape, micro):
    """The MLP's SwiGLU over all packs of one layer, forward and forward + backward: Megatron's compiled
    ``bias_swiglu_impl`` (what runs with model.use_fused_kernels), eager, and megacritic.model.swiglu_kernel
    at several tiles and warps; outputs and input gradients compared with the compiled path's."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    from megacritic.model import swiglu_kernel
    n = shape["intermediate_size"]
    data = [torch.randn(sum(lens), 1, 2 * n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for lens in micro]
    grads = [torch.randn(x.shape[0], 1, n, device="cuda", dtype=torch.bfloat16) for x in data]

    def eager(x):
        a, b = x.chunk(2, -1)
        return F.silu(a) * b
    today = (swiglu_kernel.BLOCK_M, swiglu_kernel.BLOCK_N, swiglu_kernel.NUM_WARPS)
    paths = [("Megatron's compiled swiglu", lambda x: bias_swiglu_impl(x, None, False, False)), ("eager", eager)]
    configs = {}
    for config in [today, (8, 256, 4), (32, 256, 8), (16, 512, 8), (4, 1024, 4), (64, 128, 8)]:
        name = f"swiglu_kernel, {config[0]} x {config[1]} tile, {config[2]} warps"
        configs[name] = config
        paths.append((name, swiglu_kernel.swiglu))
    ref = [paths[0][1](x).detach() for x in data]
    torch.autograd.backward([paths[0][1](x) for x in data], grads)
    ref_grads = [x.grad.clone() for x in data]
    rows = []
    for name, fn in paths:
        swiglu_kernel.BLOCK_M, swiglu_kernel.BLOCK_N, swiglu_kernel.NUM_WARPS = configs.get(name, today)
        run = pack_runner(fn, data, grads)
        try:
            for x in data:
                x.grad = None
            outs = run(True)
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, outs))
            same = sum(torch.equal(a, b) for a, b in zip(ref, outs))
            same_grads = sum(torch.equal(x.grad, g) for x, g in zip(data, ref_grads))
            print(f"{name}: outputs / input gradients equal to the compiled path's in {same} / {same_grads} of "
                  f"{len(ref)} packs; gradient rel. diff "
                  f"{max(_rel(x.grad, g) for x, g in zip(data, ref_grads)):.2e}", flush=True)
            rows += timed_pair("SwiGLU", name, run, diff)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    swiglu_kernel.BLOCK_M, swiglu_kernel.BLOCK_N, swiglu_kernel.NUM_WARPS = today
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=[s for s in SHAPES if s != "tiny"])
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--only", help="only these rows, comma-separated: qkv, norm, swiglu, mlp, mlpbwd, fc1pins")
    parser.add_argument("--cudnn", action="store_true",
                        help="also cuDNN attention (its ragged path is experimental in PyTorch: run it apart)")
    args = parser.parse_args()
    shape, micro = SHAPES[args.shape], packs(args.budget)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}; "
          f"{args.shape}: {len(micro)} packs, {sum(map(sum, micro))} tokens")
    if args.only:
        print(f"{'what':30} {'path':45} {'wall ms':>9} {'GPU ms':>9} {'max diff':>9}")
        for part in args.only.split(","):
            rows = {"qkv": qkv_rows, "norm": norm_rows, "swiglu": swiglu_rows, "mlp": mlp_rows,
                    "mlpbwd": mlp_backward_rows, "fc1pins": fc1_pin_rows}[part](shape, micro)
            if part == "mlp":  # its rows, failures included, in one table (ms per layer over all packs)
                for what, path, t, diff in rows:
                    print(f"{what:30} {path:45} {t * 1e3:9.3f} {'':>9} {diff:9.2e}")
        return
    rows = mlp_rows(shape, micro) + rope_rows(shape, micro) + wgrad_rows(shape, micro) + attention_rows(
        shape, micro, args.cudnn)
    print(f"{'what':30} {'path':45} {'ms/layer':>9} {'max diff':>9}")
    for what, path, t, diff in rows:
        print(f"{what:30} {path:45} {t * 1e3:9.3f} {diff:9.2e}")


if __name__ == "__main__":
    main()
