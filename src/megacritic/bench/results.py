"""The results file: rows of one commit, written by a run, merged from parts, printed as tables.

A run (``megacritic bench ...``) writes one file. Where a device command has less time than the whole
bench needs, the bench runs in parts (``--shapes``, ``--systems``, ``--out``), each its own file, and
``megacritic bench --merge PART.json ... --out FILE`` joins them into one file. Parts are refused unless they
measured the same commit (known, and without uncommitted changes), on the same machine kind, with the same
environment (torch, megatron-core and FlashAttention-4 versions, the attention kernel the GPU gets), and no
two parts hold the same row.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess

from megacritic.flops import mfu


class ResultsError(ValueError):
    """Parts that cannot be merged into one results file (the message says which and why)."""


def git_commit() -> dict:
    """The commit of the code being measured (and whether the tree differs from it), from the package's
    checkout; None outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=30)

    head = git("rev-parse", "--short=12", "HEAD")
    if head.returncode:
        return {"commit": None, "dirty": None}
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "../../..")
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def environment() -> dict:
    """What decides the kernels a run gets, beside the code: package versions and the attention kernel that
    ``model.attention_impl=auto`` picks for bf16 packs on this device."""
    from importlib import metadata

    import torch

    from megacritic.model.layers import resolve_attention_impl

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    fa4 = version("flash-attn-4")
    if fa4 is None:  # the bundle carried to the GPU machine has no installed metadata: the module says it
        try:
            import flash_attn.cute as cute
            fa4 = getattr(cute, "__version__", "present")
        except ImportError:
            fa4 = None
    return {"torch": torch.__version__, "megatron_core": version("megatron-core"), "flash_attn_4": fa4,
            "triton": version("triton"), "liger_kernel": version("liger-kernel"),
            "attention_auto": resolve_attention_impl("auto", torch.bfloat16, on_gpu=torch.cuda.is_available())}


def row_key(row: dict) -> tuple:
    """What a row measures: one phase of one system at one shape (and token budget)."""
    return row["model"], row["system"], row["phase"], row.get("token_budget")


def summarise(shape_name: str, system: str, results: list[dict], peak: float, real: int, fwd: float,
              run: dict, token_budget: int | None = None) -> list[dict]:
    """The two rows (update_critic, compute_values) of one system from its processes' results
    (``token_budget``: the packed systems' ppo_max_token_len_per_gpu, part of the row's key)."""
    rows = []
    ok = [r for r in results if "error" not in r]
    for phase, key, flops in (("update_critic", "update", 3 * fwd), ("compute_values", "values", fwd)):
        row = {"system": system, "model": shape_name, "phase": phase, "real_tokens": real,
               "machine": run["machine"], "device": run["device"], "commit": run["commit"],
               "processes": len(results)}
        if token_budget is not None:
            row["token_budget"] = next((r["token_budget"] for r in ok), token_budget)
        if not ok:
            row.update(real_tokens_per_s=None, mfu=None, peak_mem_gib=None,
                       error="; ".join(sorted({r["error"] for r in results})))
            rows.append(row)
            continue
        medians = [statistics.median(r[key][0]) for r in ok]
        calls = [t for r in ok for t in r[key][0]]
        t = statistics.median(medians)
        row.update(real_tokens_per_s=real / t, mfu=mfu(flops, t, 1, peak), peak_mem_gib=max(r[key][1] for r in ok),
                   seconds=t, seconds_min=min(calls), seconds_max=max(calls),
                   process_medians=medians, calls_per_process=len(ok[0][key][0]),
                   kernels=ok[0]["kernels"], switches=ok[0]["switches"], probes=[r["probe"] for r in ok])
        if len(ok) < len(results):
            row["failed_processes"] = len(results) - len(ok)
        if system == "megacritic-padded":
            row["micro_batch"] = run["micro_batch"]
        elif system == "hf-sdpa-padded":
            row["micro_batch"] = ok[0][key + "_micro_batch"]
        rows.append(row)
    return rows


def write(run: dict, rows: list[dict], path: str) -> None:
    """One run's results file (rewritten after every system, so a crash keeps what was measured)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({**run, "rows": rows}, f, indent=1)


def _parts_of(results: dict) -> list[dict]:
    """The runs a results file holds: its parts (a merged file), or the run itself."""
    return results.get("parts") or [{k: results.get(k) for k in ("command", "started")}]


def merge(paths: list[str], out: str) -> dict:
    """Join the results files ``paths`` (parts of one bench run) into ``out``; raises ResultsError (naming
    the part) where they are not of one commit, machine and environment, or two of them hold the same row."""
    if not paths:
        raise ResultsError("--merge needs at least one results file")
    loaded = []
    for path in paths:
        try:
            with open(path) as f:
                loaded.append((path, json.load(f)))
        except (OSError, ValueError) as exc:
            raise ResultsError(f"{path}: not a results file ({exc})") from None
    first_path, first = loaded[0]
    for path, part in loaded:
        if part.get("commit") is None:
            raise ResultsError(f"{path}: no commit recorded (run the bench from a git checkout, or give --commit)")
        if part.get("dirty"):
            raise ResultsError(f"{path}: measured a tree with uncommitted changes (commit {part['commit']}); "
                               "commit them and run that part again")
        for key in ("commit", "machine", "environment"):
            if part.get(key) != first.get(key):
                raise ResultsError(f"{path}: {key} {part.get(key)!r} differs from {first_path}'s "
                                   f"{first.get(key)!r}; every part must measure the same code with the same "
                                   "kernels: run that part again")
    rows, seen = [], {}
    for path, part in loaded:
        for row in part["rows"]:
            key = row_key(row)
            if key in seen:
                raise ResultsError(f"{path} and {seen[key]} both hold the row {key}: merge parts that measured "
                                   "different shapes or systems")
            seen[key] = path
            rows.append(row)
    merged = {k: first.get(k) for k in ("machine", "device", "commit", "dirty", "torch", "environment")}
    merged["micro_batch"] = first.get("micro_batch")
    merged["parts"] = [p for _, part in loaded for p in _parts_of(part)]
    write(merged, rows, out)
    return {**merged, "rows": rows}


def _k(n: float) -> str:
    return f"{n / 1000:.1f}k"


def table(rows: list[dict]) -> str:
    """The rows as a plain-text table (the end of a run's output)."""
    lines = [f"{'model':13} {'phase':15} {'system':18} {'budget':>6} {'real tok/s':>11} {'MFU':>6} {'peak GiB':>9} "
             f"{'s min/med/max':>20} {'process medians':>24} kernels"]
    for row in rows:
        budget = str(row.get("token_budget") or "")
        if row["real_tokens_per_s"] is None:
            lines.append(f"{row['model']:13} {row['phase']:15} {row['system']:18} {budget:>6} {row['error']:>28}")
            continue
        spread = f"{row['seconds_min']:.3f}/{row['seconds']:.3f}/{row['seconds_max']:.3f}"
        medians = ",".join(f"{m:.3f}" for m in row["process_medians"])
        k = row["kernels"]
        lines.append(
            f"{row['model']:13} {row['phase']:15} {row['system']:18} {budget:>6} {row['real_tokens_per_s']:11.0f} "
            f"{row['mfu']:6.3f} {row['peak_mem_gib']:9.1f} {spread:>20} {medians:>24} "
            f"{k['attention']}/{k['norm']}/{k['swiglu']}" + (f" {k['recompute']}" if k.get("recompute") else "")
            + (f" {k['optimizer']}" if k.get("optimizer") != "gpu" and row["system"] != "hf-sdpa-padded" else ""))
    return "\n".join(lines)


def markdown(results: dict) -> str:
    """README's "Measured" table from a results file: one line per (model, phase, budget) of the packed
    default, with the other systems' tokens/s and packed's speed-up over HF where both ran."""
    rows = [r for r in results["rows"] if r.get("real_tokens_per_s")]
    by_key = {row_key(r): r for r in rows}
    systems = [s for s in ("megacritic-offload", "megacritic-padded", "hf-sdpa-padded")
               if any(r["system"] == s for r in rows)]
    head = ["model", "phase", "budget", "packed tok/s", "MFU", "peak GiB", "s min / median / max",
            "process medians"] + [f"{s} tok/s" for s in systems] + (["packed / HF"] if "hf-sdpa-padded" in systems
                                                                     else [])
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in (r for r in rows if r["system"] == "megacritic-packed"):
        model, phase, budget = r["model"], r["phase"], r.get("token_budget")
        cells = [model.removeprefix("qwen2.5-").upper(), phase, f"{budget:,}" if budget else "",
                 _k(r["real_tokens_per_s"]), f"{r['mfu']:.3f}", f"{r['peak_mem_gib']:.1f}",
                 f"{r['seconds_min']:.3f} / {r['seconds']:.3f} / {r['seconds_max']:.3f}",
                 ", ".join(f"{m:.3f}" for m in r["process_medians"])]
        for s in systems:  # the baselines ran at the shape's first budget
            other = next((o for k, o in by_key.items() if k[:3] == (model, s, phase)
                          and k[3] in (None, budget)), None)
            cells.append(_k(other["real_tokens_per_s"]) if other else "")
        if "hf-sdpa-padded" in systems:
            hf = by_key.get((model, "hf-sdpa-padded", phase, None))
            cells.append(f"{r['real_tokens_per_s'] / hf['real_tokens_per_s']:.1f}x" if hf else "")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
