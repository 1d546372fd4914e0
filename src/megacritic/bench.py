"""``megacritic bench``: critic throughput on seeded long-tailed rollouts, against what users run today.

    python -m megacritic bench [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--systems ...] [--rollouts 32]

Systems, on the same rollouts (prompts 64-1024 tokens, responses log-normal 16-8192, median ~1024):

* ``megacritic-packed``: our default, token-budget micro-batches packed without padding (THD);
* ``megacritic-offload``: the packed default with parameters, gradient buffers and optimizer state in host
  memory between calls (``megatron.*_offload``), as a job that shares its GPUs with a rollout engine runs;
* ``megacritic-padded``: our code with fixed-size micro-batches padded to their longest rollout;
* ``hf-sdpa-padded``: ``transformers`` AutoModelForTokenClassification (num_labels=1, SDPA attention),
  fused torch AdamW, the same clipped value loss, verl-layout padded micro-batches of the largest size
  that fits (halved on out-of-memory).

For ``update_critic`` (forward + backward + optimizer step, all mini-batches) and ``compute_values``
(forward): real (unpadded) tokens/s, MFU on real tokens against the device's dense bf16 peak, peak memory.

Each system runs in fresh processes, one after another (each one as a training job starts: its own CUDA
context, allocator and compilation): ``--processes`` of them for megacritic-packed, whose rows are the
targets' figures, ``--baseline-processes`` for the others. A row reports the median of the processes'
median call times, with the min / max over every timed call, each process' median and per-process
probes (SM clock, host launch cost), so that one slow or fast process cannot make the figure
(bench/NOTES.md: the spread between processes). Rows name the kernels in
use (attention, norm, SwiGLU) and the results file the git commit: it holds one run of one commit; a run
of some shapes (``--shapes``) at the commit of the file replaces those shapes' rows and keeps the others,
at any other commit it starts the file afresh. Without CUDA it runs the ``tiny`` shape (so the script
itself stays tested); timings there mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from tensordict import TensorDict

from megacritic.data.rollouts import verl_batch
from megacritic.flops import PEAK_FLOPS, forward_flops, machine_kind

# Qwen2.5 shapes (random weights): hidden, layers, heads, kv heads, FFN; vocab 151936, QKV bias.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936),
    "qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       intermediate_size=11008, vocab_size=151936),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
SYSTEMS = ("megacritic-packed", "megacritic-offload", "megacritic-padded", "hf-sdpa-padded")
# What a colocated RL job runs: the packed default with its whole state in host memory between calls.
OFFLOAD = [f"megatron.{part}_offload=true" for part in ("param", "grad", "optimizer")]
# Switches a shape needs to fit one H200 at a 16k token budget, and the systems it runs. 7B (7.07 G
# parameters): 18 bytes per parameter of resident training state (127 GB) leave no room for activations in
# 139 GiB, so half of the parameters' optimizer (float32 main weights and Adam moments) runs on the host:
# 6 + 12 / 2 bytes per parameter stay on the GPU (79 GiB); the host holds ~18-24 bytes per offloaded
# parameter (64-85 GB of the machine's 128 GiB; pinned buffers are rounded up), so the fraction cannot
# be 1. Whole layers are recomputed in backward (only each layer's input is kept, ~3 GiB at 16k tokens):
# with the MLPs alone recomputed (~26 GiB of activations predicted) the device's memory reached 138.5 of
# 139 GiB in the warm-up (bench/NOTES.md). HF's bf16 AdamW with padded micro-batches is not run at 7B.
SHAPE_SWITCHES = {"qwen2.5-7b": ["megatron.optimizer_cpu_offload=true", "megatron.optimizer_offload_fraction=0.5",
                                 "megatron.recompute_granularity=full", "megatron.recompute_method=uniform",
                                 "megatron.recompute_num_layers=1"]}
SHAPE_SYSTEMS = {"qwen2.5-7b": ("megacritic-packed",)}
# Untimed warm-up pairs and timed calls where a call takes tens of seconds (the host steps the optimizer).
SHAPE_CALLS = {"qwen2.5-7b": (1, 2)}
# The systems whose rows are the targets' figures run in --processes processes; the others in
# --baseline-processes (the full bench must fit the device's time).
HEADLINE = ("megacritic-packed",)



def rollouts(n: int, vocab: int, max_prompt: int, max_response: int, seed: int = 0) -> TensorDict:
    """verl-layout rollouts: left-padded prompts, right-padded responses, random returns."""
    gen = torch.Generator().manual_seed(seed)
    p_len = torch.randint(min(64, max_prompt), max_prompt + 1, (n,), generator=gen)
    median = max_response / 8
    r_len = (torch.randn(n, generator=gen) * 0.9 + math.log(median)).exp().round().long()
    r_len = r_len.clamp(min(16, max_response), max_response)
    tokens = torch.randint(0, vocab, (n, max_prompt + max_response), generator=gen)
    response_mask = (torch.arange(max_response)[None] < r_len[:, None]).float()
    returns = torch.randn(n, max_response, generator=gen) * response_mask
    values = returns + 0.1 * torch.randn(n, max_response, generator=gen) * response_mask
    return verl_batch(tokens, p_len, r_len, prompt_width=max_prompt, returns=returns, values=values)


class _Timer:
    def __init__(self):
        self.cuda = torch.cuda.is_available()

    def __call__(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - start


def _reset_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def megacritic_overrides(shape: dict, batch: TensorDict, packed: bool, token_budget: int,
                         micro_batch: int) -> list[str]:
    """The config of a megacritic system for ``shape`` on ``batch``: four mini-batches per call, token-budget
    packed micro-batches (``packed``) or fixed padded ones of ``micro_batch`` rollouts."""
    n = len(batch)
    prompt_width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    overrides = [f"model.{k}={v}" for k, v in shape.items()] + [
        "model.attention_bias=true", "model.rope_theta=1000000.0",
        f"model.max_position_embeddings={batch['input_ids'].shape[1]}",
        f"data.rollouts_per_step={n}", f"ppo_mini_batch_size={n // 4}", "optim.lr=1e-6",
        f"data.prompt_length=[1,{prompt_width}]", f"data.response_length=[1,{batch['responses'].shape[1]}]",
        f"model.use_remove_padding={str(packed).lower()}"]
    if packed:
        overrides += ["use_dynamic_bsz=true", f"ppo_max_token_len_per_gpu={token_budget}"]
    else:
        overrides += ["use_dynamic_bsz=false", f"ppo_micro_batch_size_per_gpu={micro_batch}"]
    return overrides


def run_megacritic(shape: dict, batch: TensorDict, packed: bool, token_budget: int, micro_batch: int,
                   repeats: int, extra: list[str] = (), warmup: int = 1) -> dict[str, tuple[float, float]]:
    from megacritic import CriticWorker, load_config

    overrides = megacritic_overrides(shape, batch, packed, token_budget, micro_batch)
    # Each model starts with empty torch.compile caches, as its own training job would: compiled kernels of
    # earlier shapes in this process would otherwise use up the recompilation limit and fall back to eager.
    torch._dynamo.reset()
    worker = CriticWorker(load_config(overrides + list(extra)))
    worker.init_model()
    timer = _Timer()
    try:
        # Steady state, as in a training job of thousands of steps: the first calls after compilation still
        # build Triton variants for new pack lengths (no dynamo recompiles; ~0.8 s each at 0.5B).
        for _ in range(warmup):
            worker.compute_values(batch)
            worker.update_critic(batch)
        _reset_memory()
        t_values = [timer(lambda: worker.compute_values(batch))[1] for _ in range(repeats)]
        values_peak = _peak_gib()
        _reset_memory()
        t_update = [timer(lambda: worker.update_critic(batch))[1] for _ in range(repeats)]
        update_peak = _peak_gib()
        kernels = megacritic_kernels(worker)
    finally:
        worker.close()
        worker = None  # free the critic before the next system is built
        _reset_memory()
    return {"values": (t_values, values_peak), "update": (t_update, update_peak), "kernels": kernels}


def megacritic_kernels(worker) -> dict:
    """The kernels a built critic runs: attention of packed micro-batches, RMSNorm, SwiGLU, optimizer."""
    from megacritic.model.layers import RMSNorm, attention_impl_of

    chunks = worker.state.model
    config = chunks[0].config
    norms = {m.fused and m.weight.is_cuda for chunk in chunks for m in chunk.modules() if isinstance(m, RMSNorm)}
    mg = worker.config.megatron
    return {"attention": attention_impl_of(chunks) if worker.config.model.use_remove_padding else "sdpa (padded)",
            "norm": "compiled" if norms == {True} else "eager",
            "swiglu": "megatron-fused" if config.bias_activation_fusion else "eager",
            "recompute": config.recompute_granularity and (
                f"{config.recompute_granularity}:{','.join(config.recompute_modules)}"
                if config.recompute_granularity == "selective" else
                f"full:{config.recompute_method}:{config.recompute_num_layers}"),
            "optimizer": f"cpu-offload:{mg.optimizer_offload_fraction:g}" if mg.optimizer_cpu_offload else "gpu"}


def run_hf(shape: dict, batch: TensorDict, repeats: int, cliprange_value: float = 0.5) -> dict:
    """What a user runs instead: HF token classification, SDPA, fused AdamW, padded micro-batches."""
    from transformers import AutoModelForTokenClassification, Qwen2Config

    from megacritic.losses import clipped_value_loss

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = Qwen2Config(**shape, num_labels=1, max_position_embeddings=batch["input_ids"].shape[1],
                         rope_theta=1000000.0, tie_word_embeddings=False)
    model = AutoModelForTokenClassification.from_config(config, attn_implementation="sdpa").to(device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
    n, r = len(batch), batch["responses"].shape[1]
    mini = n // 4
    data = batch.to(device)
    resp_mask = data["attention_mask"][:, -r:].float()

    def values_pass(micro: int):
        with torch.no_grad():
            for start in range(0, n, micro):
                sl = slice(start, start + micro)
                model(input_ids=data["input_ids"][sl], attention_mask=data["attention_mask"][sl],
                      position_ids=data["position_ids"][sl]).logits[:, -r - 1:-1, 0].float()

    def update_pass(micro: int):
        for m0 in range(0, n, mini):
            optimizer.zero_grad(set_to_none=True)
            tokens = resp_mask[m0:m0 + mini].sum()
            for start in range(m0, m0 + mini, micro):
                sl = slice(start, start + micro)
                vpreds = model(input_ids=data["input_ids"][sl], attention_mask=data["attention_mask"][sl],
                               position_ids=data["position_ids"][sl]).logits[:, -r - 1:-1, 0].float()
                loss_mat, _ = clipped_value_loss(vpreds, data["values"][sl], data["returns"][sl], cliprange_value)
                ((loss_mat * resp_mask[sl]).sum() / tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

    timer, out, micros = _Timer(), {}, {}
    # Both phases warm up (and find their micro-batch) before either is timed, as for megacritic: values are
    # then measured with the optimizer state of earlier updates resident, as in an RL loop.
    for phase, fn in (("values", values_pass), ("update", update_pass)):
        micro = mini
        while True:
            try:
                fn(micro)  # warm-up, and the fit test
                break
            except torch.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                _reset_memory()
                if micro == 1:
                    raise
                micro //= 2
        micros[phase] = micro
    for phase, fn in (("values", values_pass), ("update", update_pass)):
        _reset_memory()
        t = [timer(lambda: fn(micros[phase]))[1] for _ in range(repeats)]
        out[phase] = (t, _peak_gib())
        out[phase + "_micro_batch"] = micros[phase]
    model = optimizer = None  # the closures above hold them too
    _reset_memory()
    out["kernels"] = {"attention": "sdpa (padded)", "norm": "eager (Qwen2RMSNorm)", "swiglu": "eager",
                      "recompute": None, "optimizer": "gpu (torch fused AdamW, bf16 state)"}
    return out


def git_commit() -> dict:
    """The commit of the code being measured (and whether the tree differs from it), from the package's
    checkout; None outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=30)

    head = git("rev-parse", "--short=12", "HEAD")
    if head.returncode:
        return {"commit": None, "dirty": None}
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "../..")
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _probe_host() -> dict:
    """What else varies between processes: the GPU's SM clock (MHz, read by NVML right after the timed
    calls), and the host's speed at the work it does in a step (Python and kernel launches)."""
    out = {}
    if torch.cuda.is_available():
        try:
            out["sm_clock_mhz"] = torch.cuda.clock_rate()
            out["power_w"] = torch.cuda.power_draw() / 1000
            out["temperature_c"] = torch.cuda.temperature()
        except Exception as e:  # noqa: BLE001 - NVML missing: reported, not fatal
            out["nvml"] = str(e)
        stats = torch.cuda.memory_stats()  # cumulative over the process: cudaMalloc retries, i.e. allocator churn
        out["alloc_retries"] = stats.get("num_alloc_retries", 0)
        out["device_mallocs"] = stats.get("segment.all.allocated", 0)
        x = torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20000):
            x.add_(1)  # launch-bound: ~the host's cost per kernel
        torch.cuda.synchronize()
        out["launch_us"] = (time.perf_counter() - start) / 20000 * 1e6
    start = time.perf_counter()
    sum(i * i for i in range(2_000_000))
    out["python_ms"] = (time.perf_counter() - start) * 1e3
    return out


def measure(shape_name: str, system: str, args) -> dict:
    """One process' measurement of one system: call times, peak memory, kernels (the child of main)."""
    cuda = torch.cuda.is_available()
    shape = SHAPES[shape_name]
    max_prompt, max_response = (1024, 8192) if cuda else (32, 128)
    batch = rollouts(args.rollouts, shape["vocab_size"], max_prompt, max_response)
    seq_lens = batch["attention_mask"].sum(1).tolist()
    budget = args.token_budget or (16384 if cuda else 512)
    budget = max(budget, -(-max(seq_lens) // 1024) * 1024)  # every rollout must fit one micro-batch
    warmup, repeats = SHAPE_CALLS.get(shape_name, (args.warmup, args.repeats)) if args.calls_default else (
        args.warmup, args.repeats)
    try:
        if system == "hf-sdpa-padded":
            result = run_hf(shape, batch, repeats)
        else:
            extra = SHAPE_SWITCHES.get(shape_name, []) + args.set + (OFFLOAD if system == "megacritic-offload" else [])
            result = run_megacritic(shape, batch, system != "megacritic-padded", budget, args.micro_batch, repeats,
                                    extra, warmup)
    except torch.OutOfMemoryError:
        _reset_memory()
        return {"error": "out of memory"}
    result["probe"] = _probe_host()
    result["token_budget"] = budget
    result["switches"] = [] if system == "hf-sdpa-padded" else SHAPE_SWITCHES.get(shape_name, []) + args.set
    return result


def _child(shape_name: str, system: str, argv: list[str]) -> dict:
    """measure() in a fresh Python process (its own CUDA context, allocator and compile state)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "one.json")
        cmd = [sys.executable, "-m", "megacritic", "bench", *argv, "--shapes", shape_name, "--systems", system,
               "--one-process", out]
        proc = subprocess.run(cmd, stdout=sys.stderr)  # its log goes to ours; the result comes in the file
        if proc.returncode or not os.path.exists(out):
            return {"error": f"process failed (exit {proc.returncode})"}
        with open(out) as f:
            return json.load(f)


def summarise(shape_name: str, system: str, results: list[dict], peak: float, real: int, fwd: float,
              run: dict) -> list[dict]:
    """The two rows (update_critic, compute_values) of one system from its processes' results."""
    rows = []
    ok = [r for r in results if "error" not in r]
    for phase, key, flops in (("update_critic", "update", 3 * fwd), ("compute_values", "values", fwd)):
        row = {"system": system, "model": shape_name, "phase": phase, "real_tokens": real,
               "machine": run["machine"], "device": run["device"], "commit": run["commit"],
               "processes": len(results)}
        if not ok:
            row.update(real_tokens_per_s=None, mfu=None, peak_mem_gib=None,
                       error="; ".join(sorted({r["error"] for r in results})))
            rows.append(row)
            continue
        medians = [statistics.median(r[key][0]) for r in ok]
        calls = [t for r in ok for t in r[key][0]]
        t = statistics.median(medians)
        row.update(real_tokens_per_s=real / t, mfu=flops / t / peak, peak_mem_gib=max(r[key][1] for r in ok),
                   seconds=t, seconds_min=min(calls), seconds_max=max(calls),
                   process_medians=medians, calls_per_process=len(ok[0][key][0]),
                   kernels=ok[0]["kernels"], switches=ok[0]["switches"], probes=[r["probe"] for r in ok])
        if len(ok) < len(results):
            row["failed_processes"] = len(results) - len(ok)
        if system in ("megacritic-packed", "megacritic-offload"):
            row["token_budget"] = ok[0]["token_budget"]
        elif system == "megacritic-padded":
            row["micro_batch"] = run["micro_batch"]
        else:
            row["micro_batch"] = ok[0][key + "_micro_batch"]
        rows.append(row)
    return rows


def _write(run: dict, rows: list[dict], path: str) -> None:
    """The results file: this run's rows, and those of other shapes measured at the same commit (a run in
    parts); rows of another commit, or of a tree with uncommitted changes, are never kept."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    kept = []
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = None
    if (isinstance(old, dict) and old.get("commit") == run["commit"] and run["commit"] is not None
            and not old.get("dirty") and not run["dirty"] and old.get("machine") == run["machine"]):
        mine = {(r["model"], r["system"]) for r in rows}
        kept = [r for r in old["rows"] if (r["model"], r["system"]) not in mine]
    with open(path, "w") as f:
        json.dump({**run, "rows": kept + rows}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megacritic bench", description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b" if cuda else "tiny",
                        help="comma-separated shapes: " + ", ".join(SHAPES))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ", ".join(SYSTEMS)
                        + " (a shape listed in SHAPE_SYSTEMS runs only those)")
    parser.add_argument("--rollouts", type=int, default=32 if cuda else 16, help="rollouts per call")
    parser.add_argument("--token-budget", type=int, default=None,
                        help="megacritic-packed: ppo_max_token_len_per_gpu (default 16384)")
    parser.add_argument("--micro-batch", type=int, default=2, help="megacritic-padded: micro-batch size")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per phase (default 3; 7B: 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="megacritic systems: untimed compute_values + update_critic pairs before timing "
                             "(default 3; 7B: 1)")
    parser.add_argument("--processes", type=int, default=3 if cuda else 1,
                        help="fresh processes for megacritic-packed (the row reports the median of their "
                             "medians); 1 measures in this process")
    parser.add_argument("--baseline-processes", type=int, default=1,
                        help="fresh processes for the other systems (default 1)")
    parser.add_argument("--out", default=None, help="results file (default bench/results/<machine-kind>.json)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the megacritic systems (repeatable), e.g. "
                             "--set model.use_fused_kernels=false; recorded in each row")
    parser.add_argument("--commit", default=None,
                        help="the commit measured, for a copy of the tree without git metadata (recorded in "
                             "the results file instead of what git says)")
    parser.add_argument("--one-process", default=None, help=argparse.SUPPRESS)  # internal: a child's result file
    args = parser.parse_args(argv)
    args.calls_default = args.warmup is None and args.repeats is None
    args.warmup = (3 if cuda else 1) if args.warmup is None else args.warmup
    args.repeats = (3 if cuda else 1) if args.repeats is None else args.repeats
    if args.processes < 1 or args.baseline_processes < 1:
        parser.error("--processes and --baseline-processes must be at least 1")
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"--shapes: unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    for name in args.systems.split(","):
        if name not in SYSTEMS:
            parser.error(f"--systems: unknown system {name!r}; choose from {', '.join(SYSTEMS)}")

    if args.one_process:
        (shape_name,), (system,) = args.shapes.split(","), args.systems.split(",")
        result = measure(shape_name, system, args)
        with open(args.one_process, "w") as f:
            json.dump(result, f)
        return 0

    # FlashAttention-4 compiles its kernels at the first call of a process (~5 s each); cached on disk, as a
    # training job on a machine would keep them, later processes load them.
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    kind = machine_kind()
    peak = PEAK_FLOPS.get(kind, float("nan"))
    child_argv = [a for a in (argv if argv is not None else sys.argv[2:])]
    commit = {"commit": args.commit, "dirty": None} if args.commit else git_commit()
    run = {"machine": kind, "device": torch.cuda.get_device_name() if cuda else "cpu", **commit,
           "torch": torch.__version__, "command": "megacritic bench " + " ".join(child_argv),
           "micro_batch": args.micro_batch, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = args.out or os.path.join("bench", "results", f"{kind}.json")
    rows = []
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        batch = rollouts(args.rollouts, shape["vocab_size"], *((1024, 8192) if cuda else (32, 128)))
        seq_lens = batch["attention_mask"].sum(1).tolist()
        real, fwd = sum(seq_lens), forward_flops(shape, seq_lens)
        for system in args.systems.split(","):
            if system not in SHAPE_SYSTEMS.get(shape_name, SYSTEMS):
                print(f"{shape_name}: {system} not run at this shape (SHAPE_SYSTEMS)", file=sys.stderr)
                continue
            processes = args.processes if system in HEADLINE else args.baseline_processes
            if processes == 1 and args.processes == 1:
                results = [measure(shape_name, system, args)]
            else:
                results = [_child(shape_name, system, child_argv) for _ in range(processes)]
            rows += summarise(shape_name, system, results, peak, real, fwd, run)
            print(json.dumps(rows[-2:]), flush=True)
            _write(run, rows, out)  # after every system, so a crash later in the run keeps what was measured

    print(f"\ncommit {run['commit']}{' (uncommitted changes)' if run['dirty'] else ''}, {run['device']}")
    print(f"{'model':13} {'phase':15} {'system':18} {'real tok/s':>11} {'MFU':>6} {'peak GiB':>9} "
          f"{'s min/med/max':>20} {'process medians':>24} kernels")
    for row in rows:
        if row["real_tokens_per_s"] is None:
            print(f"{row['model']:13} {row['phase']:15} {row['system']:18} {row['error']:>28}")
            continue
        spread = f"{row['seconds_min']:.3f}/{row['seconds']:.3f}/{row['seconds_max']:.3f}"
        medians = ",".join(f"{m:.3f}" for m in row["process_medians"])
        k = row["kernels"]
        print(f"{row['model']:13} {row['phase']:15} {row['system']:18} {row['real_tokens_per_s']:11.0f} "
              f"{row['mfu']:6.3f} {row['peak_mem_gib']:9.1f} {spread:>20} {medians:>24} "
              f"{k['attention']}/{k['norm']}/{k['swiglu']}" + (f" {k['recompute']}" if k["recompute"] else "")
              + (f" {k['optimizer']}" if k["optimizer"] != "gpu" and system != "hf-sdpa-padded" else ""))
    print(f"results: {out}")
    return 0
