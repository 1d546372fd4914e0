"""Where one critic call spends its time: per-call wall times over several calls, torch.compile
recompilations, a torch profiler table of one call (top kernels by self CUDA time, then by host time), and
(``--sync-sites``) where the call makes the host wait for the GPU: every such wait drains the GPU's queue,
which then idles while the host prepares the next kernels.

    python bench/profile_phase.py [--shape qwen2.5-1.5b] [--phase update|values] [--calls 5] [--trace OUT.json]
        [--sync-sites] [--host] [--no-torch-profile] [KEY=VALUE ...]   # overrides, e.g. model.use_fused_kernels=false

``--host``: where the host's time goes in one call (cProfile: the Python functions by own time, and the
time by library), for steps whose GPU waits on the host to queue kernels.
"""

import argparse
import collections
import cProfile
import pstats
import time
import traceback
import warnings

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from megacritic import CriticWorker, load_config
from megacritic.bench import SHAPES, megacritic_overrides, rollouts
from megacritic.flops import forward_flops, mfu


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
    worker.compute_values(batch)  # one warm-up pair; the timed calls show how soon steady state comes
    worker.update_critic(batch)
    seq_lens = batch["attention_mask"].sum(1).tolist()
    tokens, flops = sum(seq_lens), forward_flops(shape, seq_lens)
    for i in range(args.calls):
        for phase in phases:
            torch.cuda.synchronize()
            start = time.perf_counter()
            calls[phase]()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            frames = dict(counters["stats"]) if "stats" in counters else {}
            used = mfu(flops * (3 if phase == "update" else 1), seconds, 1)
            print(f"call {i} {phase}: {seconds:.3f} s, {tokens / seconds:,.0f} real tokens/s, MFU {used:.3f}, "
                  f"dynamo stats {frames}")
    if not args.no_torch_profile:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        table = prof.key_averages()
        print(table.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
        print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        launches = sum(e.count for e in table if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                           "cudaLaunchKernelExC"))
        print(f"kernel launches in one call: {launches}")
        if args.trace:
            prof.export_chrome_trace(args.trace)
    if args.host:
        print_host_profile(call)
    if args.sync_sites:
        print_sync_sites(call)
    worker.close()


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
