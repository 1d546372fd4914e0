"""The bench's run: each system in fresh processes, their calls timed, rows written (``megacritic bench``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from tensordict import TensorDict

from megacritic.bench import results
from megacritic.bench.timing import Timer, peak_gib, probe_host, reset_memory
from megacritic.bench.workloads import (
    GPU_SHAPES,
    HEADLINE,
    PACKED,
    SHAPE_CALLS,
    SHAPE_SYSTEMS,
    SHAPES,
    SYSTEMS,
    megacritic_overrides,
    rollouts,
    system_switches,
    token_budgets,
    widths,
)
from megacritic.flops import forward_flops, machine_kind, peak_flops


def run_megacritic(shape: dict, batch: TensorDict, packed: bool, token_budget: int, micro_batch: int,
                   repeats: int, extra: list[str] = (), warmup: int = 1) -> dict:
    """Times of ``repeats`` compute_values and update_critic calls of a megacritic critic after ``warmup``
    untimed pairs, each phase's peak memory, and the kernels the critic runs."""
    from megacritic import CriticWorker, load_config

    overrides = megacritic_overrides(shape, batch, packed, token_budget, micro_batch)
    # Each model starts with empty torch.compile caches, as its own training job would: compiled kernels of
    # earlier shapes in this process would otherwise use up the recompilation limit and fall back to eager.
    torch._dynamo.reset()
    worker = CriticWorker(load_config(overrides + list(extra)))
    worker.init_model()
    timer = Timer()
    try:
        # Steady state, as in a training job of thousands of steps: the first calls after compilation still
        # build Triton variants for new pack lengths (no dynamo recompiles; ~0.8 s each at 0.5B).
        for _ in range(warmup):
            worker.compute_values(batch)
            worker.update_critic(batch)
        reset_memory()
        t_values = [timer(lambda: worker.compute_values(batch))[1] for _ in range(repeats)]
        values_peak = peak_gib()
        reset_memory()
        t_update = [timer(lambda: worker.update_critic(batch))[1] for _ in range(repeats)]
        update_peak = peak_gib()
        kernels = megacritic_kernels(worker)
    finally:
        worker.close()
        worker = None  # free the critic before the next system is built
        reset_memory()
    return {"values": (t_values, values_peak), "update": (t_update, update_peak), "kernels": kernels}


def megacritic_kernels(worker) -> dict:
    """The kernels a built critic runs: attention of packed micro-batches, RMSNorm, SwiGLU, optimizer."""
    from megacritic.compat.kernels import triton_swiglu_installed
    from megacritic.model.layers import RMSNorm, attention_impl_of
    from megacritic.model.mlp_kernel import FusedSwiGLUMLP

    chunks = worker.state.model
    config = chunks[0].config
    norms = {m.fused and m.weight.is_cuda for chunk in chunks for m in chunk.modules() if isinstance(m, RMSNorm)}
    fused_mlps = [m for chunk in chunks for m in chunk.modules() if isinstance(m, FusedSwiGLUMLP)]
    mg, o = worker.config.megatron, worker.config.optim
    moments = "" if (o.exp_avg_dtype, o.exp_avg_sq_dtype) == ("float32", "float32") else (
        f":moments-{o.exp_avg_dtype}-{o.exp_avg_sq_dtype}")
    return {"attention": attention_impl_of(chunks) if worker.config.model.use_remove_padding else "sdpa (padded)",
            "norm": "compiled" if norms == {True} else "eager",
            "swiglu": ("quack-gemm-epilogue" + (":kept-activation" if fused_mlps[0].keep_activation else "")
                       if fused_mlps  # model.fused_mlp: inside the MLP's GEMMs
                       else "eager" if not config.bias_activation_fusion
                       else "megacritic-triton" if triton_swiglu_installed() else "megatron-fused"),
            "recompute": config.recompute_granularity and (
                f"{config.recompute_granularity}:{','.join(config.recompute_modules)}"
                if config.recompute_granularity == "selective" else
                f"full:{config.recompute_method}:{config.recompute_num_layers}"),
            "optimizer": (f"cpu-offload:{mg.optimizer_offload_fraction:g}" if mg.optimizer_cpu_offload
                          else "gpu") + moments}


def measure(shape_name: str, system: str, token_budget: int, args) -> dict:
    """One process' measurement of one system: call times, peak memory, kernels (the child of main)."""
    from megacritic.bench.hf_baseline import run_hf

    cuda = torch.cuda.is_available()
    shape = SHAPES[shape_name]
    batch = rollouts(args.rollouts, shape["vocab_size"], *widths(cuda))
    longest = int(batch["attention_mask"].sum(1).max())
    budget = max(token_budget, -(-longest // 1024) * 1024)  # every rollout must fit one micro-batch
    warmup, repeats = SHAPE_CALLS.get(shape_name, (args.warmup, args.repeats)) if args.calls_default else (
        args.warmup, args.repeats)
    try:
        if system == "hf-sdpa-padded":
            result = run_hf(shape, batch, repeats)
        else:
            result = run_megacritic(shape, batch, system != "megacritic-padded", budget, args.micro_batch, repeats,
                                    system_switches(shape_name, system, args.set), warmup)
    except torch.OutOfMemoryError as exc:
        # where it ran out (the allocation asked for, what was held) tells which setting to change
        print(f"{shape_name} {system}: {str(exc).splitlines()[0][:400]}", file=sys.stderr)
        reset_memory()
        return {"error": "out of memory"}
    result["probe"] = probe_host()
    result["token_budget"] = budget
    result["switches"] = [] if system == "hf-sdpa-padded" else system_switches(shape_name, system, args.set)
    return result


def _child(shape_name: str, system: str, token_budget: int, argv: list[str]) -> dict:
    """measure() in a fresh Python process (its own CUDA context, allocator and compile state)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "one.json")
        cmd = [sys.executable, "-m", "megacritic", "bench", *argv, "--shapes", shape_name, "--systems", system,
               "--token-budget", str(token_budget), "--one-process", out]
        proc = subprocess.run(cmd, stdout=sys.stderr)  # its log goes to ours; the result comes in the file
        if proc.returncode or not os.path.exists(out):
            return {"error": f"process failed (exit {proc.returncode})"}
        with open(out) as f:
            return json.load(f)


def _budgets(text: str) -> list[int]:
    try:
        budgets = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated token counts, e.g. 16384,32768") from None
    if any(b < 1 for b in budgets):
        raise argparse.ArgumentTypeError(f"{text!r}: token budgets must be positive")
    return budgets


def parser() -> argparse.ArgumentParser:
    from megacritic.bench import __doc__ as doc

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="megacritic bench", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(GPU_SHAPES) if cuda else "tiny",
                   help="comma-separated shapes: " + ", ".join(SHAPES))
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ", ".join(SYSTEMS)
                   + " (a shape listed in SHAPE_SYSTEMS runs only those)")
    p.add_argument("--rollouts", type=int, default=32 if cuda else 16, help="rollouts per call")
    p.add_argument("--token-budget", type=_budgets, default=None, metavar="N[,M...]",
                   help="packed systems: ppo_max_token_len_per_gpu, for every shape (default 16384, and at 1.5B "
                        "also 32768, verl's default: an extra megacritic-packed row)")
    p.add_argument("--micro-batch", type=int, default=2, help="megacritic-padded: micro-batch size")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per phase (default 3, or SHAPE_CALLS)")
    p.add_argument("--warmup", type=int, default=None,
                   help="megacritic systems: untimed compute_values + update_critic pairs before timing "
                        "(default 3, or SHAPE_CALLS)")
    p.add_argument("--processes", type=int, default=3 if cuda else 1,
                   help="fresh processes for megacritic-packed at a shape's first token budget (the row reports "
                        "the median of their medians); 1 measures in this process")
    p.add_argument("--baseline-processes", type=int, default=1,
                   help="fresh processes for the other systems and budgets (default 1)")
    p.add_argument("--out", default=None, help="results file (default bench/results/<machine-kind>.json)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for the megacritic systems (repeatable), e.g. "
                        "--set model.use_fused_kernels=false; recorded in each row")
    p.add_argument("--commit", default=None,
                   help="the commit measured, for a copy of the tree without git metadata (recorded in "
                        "the results file instead of what git says)")
    p.add_argument("--merge", nargs="+", default=None, metavar="PART.json",
                   help="instead of measuring: join these results files (parts of one run: same commit, "
                        "machine and environment, no row twice) into --out")
    p.add_argument("--markdown", default=None, metavar="RESULTS.json",
                   help="instead of measuring: print README's table of this results file")
    p.add_argument("--one-process", default=None, help=argparse.SUPPRESS)  # internal: a child's result file
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    kind = machine_kind()
    out = args.out or os.path.join("bench", "results", f"{kind}.json")
    if args.markdown:
        with open(args.markdown) as f:
            print(results.markdown(json.load(f)))
        return 0
    if args.merge:
        try:
            merged = results.merge(args.merge, out)
        except results.ResultsError as exc:
            print(f"megacritic bench --merge: {exc}", file=sys.stderr)
            return 2
        print(results.table(merged["rows"]))
        print(f"merged {len(args.merge)} parts of commit {merged['commit']}: {out}")
        return 0
    args.calls_default = args.warmup is None and args.repeats is None
    args.warmup = (3 if cuda else 1) if args.warmup is None else args.warmup
    args.repeats = (3 if cuda else 1) if args.repeats is None else args.repeats
    if args.processes < 1 or args.baseline_processes < 1:
        p.error("--processes and --baseline-processes must be at least 1")
    for name in args.shapes.split(","):
        if name not in SHAPES:
            p.error(f"--shapes: unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    for name in args.systems.split(","):
        if name not in SYSTEMS:
            p.error(f"--systems: unknown system {name!r}; choose from {', '.join(SYSTEMS)}")

    if args.one_process:
        (shape_name,), (system,) = args.shapes.split(","), args.systems.split(",")
        result = measure(shape_name, system, args.token_budget[0], args)
        with open(args.one_process, "w") as f:
            json.dump(result, f)
        return 0

    # FlashAttention-4 compiles its kernels at the first call of a process (~5 s each); cached on disk, as a
    # training job on a machine would keep them, later processes load them.
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    peak = peak_flops()
    child_argv = _child_argv(argv if argv is not None else sys.argv[2:])
    commit = {"commit": args.commit, "dirty": None} if args.commit else results.git_commit()
    command = "megacritic bench " + " ".join(argv if argv is not None else sys.argv[2:])
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run = {"machine": kind, "device": torch.cuda.get_device_name() if cuda else "cpu", **commit,
           "torch": torch.__version__, "environment": results.environment(), "micro_batch": args.micro_batch,
           "command": command, "started": started, "parts": [{"command": command, "started": started}]}
    rows = []
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        batch = rollouts(args.rollouts, shape["vocab_size"], *widths(cuda))
        seq_lens = batch["attention_mask"].sum(1).tolist()
        real, fwd = sum(seq_lens), forward_flops(shape, seq_lens)
        budgets = token_budgets(shape_name, cuda, args.token_budget)
        for system in args.systems.split(","):
            if system not in SHAPE_SYSTEMS.get(shape_name, SYSTEMS):
                print(f"{shape_name}: {system} not run at this shape (SHAPE_SYSTEMS)", file=sys.stderr)
                continue
            for i, budget in enumerate(budgets if system == "megacritic-packed" else budgets[:1]):
                processes = args.processes if system in HEADLINE and i == 0 else args.baseline_processes
                if processes == 1 and args.processes == 1:
                    found = [measure(shape_name, system, budget, args)]
                else:
                    found = [_child(shape_name, system, budget, child_argv) for _ in range(processes)]
                rows += results.summarise(shape_name, system, found, peak, real, fwd, run,
                                          token_budget=budget if system in PACKED else None)
                print(json.dumps(rows[-2:]), flush=True)
                results.write(run, rows, out)  # after every system, so a crash later in the run keeps the rest

    print(f"\ncommit {run['commit']}{' (uncommitted changes)' if run['dirty'] else ''}, {run['device']}")
    print(results.table(rows))
    print(f"results: {out}")
    return 0


def _child_argv(argv: list[str]) -> list[str]:
    """The run's arguments for a child process, less those the child is given itself."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--out", "--token-budget", "--shapes", "--systems"):
            skip = True
            continue
        if a.split("=", 1)[0] in ("--out", "--token-budget", "--shapes", "--systems"):
            continue
        out.append(a)
    return out


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
