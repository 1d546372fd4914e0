"""Where one critic call spends its time: per-call wall times over several calls, torch.compile
recompilations, a torch profiler table of one call (top kernels by self CUDA time, then by host time), and
(``--sync-sites``) where the call makes the host wait for the GPU: every such wait drains the GPU's queue,
which then idles while the host prepares the next kernels.

    python bench/profile_phase.py [--shape qwen2.5-1.5b] [--phase update|values] [--calls 5] [--trace OUT.json]
        [--sync-sites] [KEY=VALUE ...]   # config overrides, e.g. model.use_fused_kernels=false
"""

import argparse
import collections
import time
import traceback
import warnings

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from megacritic import CriticWorker, load_config
from megacritic.bench import SHAPES, megacritic_overrides, rollouts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--phase", default="update", choices=("update", "values"))
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=5, help="timed calls before the profiled one")
    parser.add_argument("--trace", default=None, help="also write a Chrome trace here")
    parser.add_argument("--sync-sites", action="store_true",
                        help="also list the code that synchronises the host with the GPU in one call, by count")
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
    call = (lambda: worker.update_critic(batch)) if args.phase == "update" else (lambda: worker.compute_values(batch))
    worker.compute_values(batch)  # one warm-up pair; the timed calls show how soon steady state comes
    worker.update_critic(batch)
    tokens = int(batch["attention_mask"].sum())
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
    if args.sync_sites:
        print_sync_sites(call)
    worker.close()


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
