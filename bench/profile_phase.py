"""Where one critic call spends its time: per-call wall times over several calls, torch.compile
recompilations, a torch profiler table of one call (top kernels by self CUDA time, then by host time), and
(``--sync-sites``) where the call makes the host wait for the GPU: every such wait drains the GPU's queue,
which then idles while the host prepares the next kernels.

    python bench/profile_phase.py [--shape qwen2.5-1.5b] [--phase update|values] [--calls 5] [--trace OUT.json]
        [--sync-sites] [--host] [--gaps] [--no-torch-profile] [KEY=VALUE ...]
    # KEY=VALUE: config overrides, e.g. model.use_fused_kernels=false

``--host``: where the host's time goes in one call (cProfile: the Python functions by own time, and the
time by library), for steps whose GPU waits on the host to queue kernels. ``--gaps``: where the GPU idles
inside the profiled call (its longest gaps between kernels, with what the host was doing meanwhile).
"""

import argparse
import collections
import cProfile
import json
import os
import tempfile
import pstats
import re
import time
import traceback
import warnings

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from megacritic import CriticWorker, load_config
from megacritic.bench import SHAPES, megacritic_overrides, rollouts
from megacritic.flops import forward_flops, mfu

from kernels_by_op import device_events, host_ops_by_thread, launches_by_correlation  # bench/, beside this file


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--phase", default="update", choices=("update", "values", "both"),
                        help="both: time the two phases alternately (the profiles are update_critic's)")
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=5, help="timed calls before the profiled one")
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    parser.add_argument("--sync-sites", action="store_true",
                        help="also list the code that synchronises the host with the GPU in one call, by count")
    parser.add_argument("--host", action="store_true", help="also profile one call's host time (cProfile)")
    parser.add_argument("--gaps", action="store_true",
                        help="also list where the GPU idles in the profiled call, with what the host was doing")
    parser.add_argument("--no-torch-profile", action="store_true", help="skip the torch profiler table")
    args, extra = parser.parse_known_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (it measures GPU kernels)")
    shape = SHAPES[args.shape]
    batch = rollouts(args.rollouts, shape["vocab_size"], 1024, 8192)
    config = load_config(megacritic_overrides(shape, batch, True, args.token_budget, micro_batch=1) + extra)
    worker = CriticWorker(config)
    worker.init_model()
    from megacritic.model.layers import attention_impl_of
    print(f"attention kernel: {attention_impl_of(worker.state.model)}")
    calls = {"update": lambda: worker.update_critic(batch), "values": lambda: worker.compute_values(batch)}
    phases = ["values", "update"] if args.phase == "both" else [args.phase]
    call = calls["values" if args.phase == "values" else "update"]
    for phase in ("values", "update"):  # a warm-up of each phase timed (the timed calls show how soon steady
        if phase in phases:               # state comes); values alone fits where an update would not (3B, H100)
            calls[phase]()
    seq_lens = batch["attention_mask"].sum(1).tolist()
    tokens, flops = sum(seq_lens), forward_flops(shape, seq_lens)
    for i in range(args.calls):
        for phase in phases:
            torch.cuda.synchronize()
            before = torch.cuda.memory_stats()
            start = time.perf_counter()
            calls[phase]()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            after = torch.cuda.memory_stats()
            frames = dict(counters["stats"]) if "stats" in counters else {}
            used = mfu(flops * (3 if phase == "update" else 1), seconds, 1)
            # the caching allocator's churn in the call: a retry frees every cached block (a device sync)
            churn = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_alloc_retries", "segment.all.allocated")}
            print(f"call {i} {phase}: {seconds:.3f} s, {tokens / seconds:,.0f} real tokens/s, MFU {used:.3f}, "
                  f"allocator retries +{churn['num_alloc_retries']}, cudaMallocs +{churn['segment.all.allocated']}, "
                  f"dynamo stats {frames}")
    if not args.no_torch_profile:
        for phase in phases:  # with --phase both, each phase's kernels by kind
            torch.cuda.synchronize()
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                calls[phase]()
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
            table = prof.key_averages()
            print(f"profiled {phase} call: {wall:.3f} s of wall time under the profiler")
            print(table.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90))
            if phase == "update":
                print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
            launches = sum(e.count for e in table if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                               "cuLaunchKernelEx", "cudaLaunchKernelExC"))
            print(f"kernel launches in one call: {launches}")
            print_kernel_kinds(prof, phase)
            if args.gaps:
                with tempfile.TemporaryDirectory() as folder:
                    path = os.path.join(folder, "trace.json")
                    prof.export_chrome_trace(path)
                    with open(path) as f:
                        print_gaps(json.load(f)["traceEvents"], phase)
        if args.trace:
            prof.export_chrome_trace(args.trace)
    if args.host:
        print_host_profile(call)
    if args.sync_sites:
        print_sync_sites(call)
    worker.close()


KERNEL_KINDS = (  # first match wins; names of the kernels on the lent machine (cuBLAS, CUTLASS, FA4, Triton)
    ("attention (FlashAttention)", r"flash|fmha|FlashAttn"),
    ("GEMM", r"gemm|nvjet|xmma|cutlass|sm90_|Gemm|splitKreduce"),
    ("SwiGLU (Megatron, Triton)", r"swiglu|glu"),
    ("AdamW (fused)", r"adam|Adam"),
    ("grad norm / scale (foreach)", r"multi_tensor|foreach|norm_kernel|lpnorm"),
    ("compiled kernels (RMSNorm, RoPE: Triton)", r"^triton_"),
    ("RMSNorm (megacritic.model.norm_kernel, Triton)", r"_rms_norm_(forward|backward)"),
    ("QKV split + RoPE (megacritic.model.qkv_kernel, Triton)", r"_qkv_split_(forward|backward)"),
    ("embedding", r"embedding|indexSelect|index_select|indexing_backward|index_put"),
    ("reductions (sum, bias grads)", r"reduce_kernel|Reduce"),
    ("copies, casts", r"copy|Memcpy|memcpy|cast|convert"),
    ("memset / fill", r"Memset|memset|fill"),
    ("elementwise (adds, muls)", r"elementwise|vectorized|unrolled"),
)


def print_kernel_kinds(prof, phase: str) -> None:
    """The phase's GPU time by kind of kernel, and the GPU's busy time against the call's span."""
    from torch.autograd import DeviceType
    kinds, spans = collections.Counter(), []
    examples = {}
    for e in prof.events():
        # a user annotation on the GPU's timeline (the optimizer's step, a compiled graph's call) spans kernels
        # that are counted themselves
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        for kind, pattern in KERNEL_KINDS:
            if re.search(pattern, e.name):
                break
        else:
            kind = "other"
        kinds[kind] += us
        examples.setdefault(kind, collections.Counter())[e.name[:80]] += us
        spans.append((e.time_range.start, e.time_range.end))
    busy = sum(kinds.values()) / 1e6
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e6 if spans else 0.0
    print(f"{phase}: GPU busy {busy:.3f} s over a span of {span:.3f} s (first kernel's start to last's end)")
    for kind, us in kinds.most_common():
        top = ", ".join(f"{n} {t / 1e3:.1f} ms" for n, t in examples[kind].most_common(3))
        print(f"  {us / 1e6:7.3f} s {us / 1e6 / max(busy, 1e-9):6.1%}  {kind}   [{top}]")


def print_gaps(events: list[dict], phase: str, shown: int = 20, least_us: float = 50.0) -> None:
    """The GPU's idle time in a profiled call, from its trace: every gap of at least ``least_us`` between one
    kernel's end and the next one's start, summed by what the host was doing when the next kernel was launched
    (the stack of its ranges and ops at the launch: a gap ends when the host gets the kernel queued), then
    the longest gaps one by one with the host's time spent meanwhile by top-level range."""
    gpu = device_events(events)
    if not gpu:
        print(f"{phase}: no kernels in the trace")
        return
    launches, by_thread = launches_by_correlation(events), host_ops_by_thread(events)

    def stack_at(tid, ts):  # the ranges and ops open on a host thread at ts, outermost first
        open_ = [e for e in by_thread.get(tid, ()) if e["ts"] <= ts <= e["ts"] + e["dur"]]
        return [e["name"][:60] for e in sorted(open_, key=lambda e: (e["ts"], -e["dur"]))]

    def meanwhile(tid, start, end):  # the host's time in [start, end] by outermost range or op
        spent, outer_end = collections.Counter(), float("-inf")
        overlapping = [e for e in by_thread.get(tid, ()) if e["ts"] < end and e["ts"] + e["dur"] > start]
        for e in sorted(overlapping, key=lambda e: (e["ts"], -e["dur"])):
            if e["ts"] + e["dur"] <= outer_end:  # inside the outermost one before it
                continue
            outer_end = e["ts"] + e["dur"]
            spent[e["name"][:60]] += min(end, outer_end) - max(start, e["ts"])
        return spent

    gaps, edge = [], gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        if e["ts"] - edge >= least_us:
            gaps.append((e["ts"] - edge, edge, e))
        edge = max(edge, e["ts"] + e["dur"])
    span = edge - gpu[0]["ts"]
    idle = sum(g for g, _, _ in gaps)
    print(f"{phase}: {len(gaps)} gaps of {least_us:.0f} us or more, {idle / 1e3:.1f} ms of a {span / 1e3:.1f} ms span")
    by_site = collections.Counter()
    count = collections.Counter()
    for length, _, kernel in gaps:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        site = " > ".join(stack_at(launch["tid"], launch["ts"])[-4:]) if launch else "(no launch in the trace)"
        by_site[site] += length
        count[site] += 1
    print("  by the host's ranges and ops at the launch that ended the gap (innermost four):")
    for site, us in by_site.most_common(12):
        print(f"  {us / 1e3:8.1f} ms {count[site]:5d} gaps  {site[:230]}")
    print(f"  the {min(shown, len(gaps))} longest:")
    for length, start, kernel in sorted(gaps, key=lambda g: -g[0])[:shown]:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        where = f"at +{(start - gpu[0]['ts']) / 1e3:.1f} ms"
        if launch is None:
            print(f"  {length / 1e3:7.2f} ms {where}, before {kernel['name'][:50]}")
            continue
        spent = meanwhile(launch["tid"], start, start + length)
        doing = ", ".join(f"{n} {us / 1e3:.1f}" for n, us in spent.most_common(4))
        print(f"  {length / 1e3:7.2f} ms {where}, before {kernel['name'][:50]}; launched in "
              f"{' > '.join(stack_at(launch['tid'], launch['ts'])[-3:])[:150]}; host meanwhile (ms): {doing[:200]}")


def print_host_profile(call) -> None:
    """One call under cProfile (which slows Python, so shares, not seconds, are what to read): the
    functions by own time, then the own time summed by library."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    start = time.perf_counter()
    prof.enable()
    call()
    prof.disable()
    torch.cuda.synchronize()
    print(f"host profile: one call {time.perf_counter() - start:.3f} s under cProfile")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumtime").print_stats(45)
    by_lib = collections.Counter()
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        if filename == "~":  # C functions: torch's ops (their dispatch and kernel launches), builtins
            by_lib["C calls (torch ops, launches, builtins)"] += tottime
            continue
        for lib in ("megacritic", "megatron", "torch/_dynamo", "torch/_inductor", "torch/autograd", "torch/nn",
                    "torch/cuda", "flash_attn", "cutlass", "torch/_functorch", "torch/utils", "torch"):
            if f"/{lib}/" in filename or filename.startswith(lib):
                by_lib[lib] += tottime
                break
        else:
            folder = filename if filename.startswith("<") else ("/" + filename).rsplit("/", 2)[-2]
            by_lib["other: " + folder] += tottime
    total = sum(by_lib.values())
    print(f"own time by library (total {total:.3f} s):")
    for lib, seconds in by_lib.most_common(20):
        print(f"{seconds:8.3f} s {seconds / total:6.1%}  {lib}")


def print_sync_sites(call) -> None:
    """Run ``call`` with CUDA's sync debug mode, which warns at every synchronising operation; group the
    warnings by their innermost project frames."""
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # other warnings raised meanwhile
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if ("megacritic" in f.filename or "megatron" in f.filename) and "profile_phase" not in f.filename]
        sites[" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(frames[-4:]))] += 1

    with warnings.catch_warnings():  # restores warnings.showwarning after
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"host-GPU synchronisations in one call: {sum(sites.values())}")
    for site, count in sites.most_common(25):
        print(f"{count:6d}  {site}")


if __name__ == "__main__":
    main()
