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
Writes ``bench/results/<machine-kind>.json`` and prints a table. Without CUDA it runs the ``tiny`` shape
(so the script itself stays tested); timings there mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time

import torch
from tensordict import TensorDict

from megacritic.flops import PEAK_FLOPS, forward_flops, machine_kind

# Qwen2.5 shapes (random weights): hidden, layers, heads, kv heads, FFN; vocab 151936, QKV bias.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936),
    "qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       intermediate_size=11008, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
SYSTEMS = ("megacritic-packed", "megacritic-offload", "megacritic-padded", "hf-sdpa-padded")
# What a colocated RL job runs: the packed default with its whole state in host memory between calls.
OFFLOAD = [f"megatron.{part}_offload=true" for part in ("param", "grad", "optimizer")]


def rollouts(n: int, vocab: int, max_prompt: int, max_response: int, seed: int = 0) -> TensorDict:
    """verl-layout rollouts: left-padded prompts, right-padded responses, random returns."""
    gen = torch.Generator().manual_seed(seed)
    p_len = torch.randint(min(64, max_prompt), max_prompt + 1, (n,), generator=gen)
    median = max_response / 8
    r_len = (torch.randn(n, generator=gen) * 0.9 + math.log(median)).exp().round().long()
    r_len = r_len.clamp(min(16, max_response), max_response)
    cols_p, cols_r = torch.arange(max_prompt), torch.arange(max_response)
    mask = torch.cat([cols_p[None] >= (max_prompt - p_len)[:, None], cols_r[None] < r_len[:, None]], 1).long()
    ids = torch.randint(0, vocab, mask.shape, generator=gen) * mask
    returns = torch.randn(n, max_response, generator=gen) * mask[:, max_prompt:]
    values = returns + 0.1 * torch.randn(n, max_response, generator=gen) * mask[:, max_prompt:]
    return TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
                       "responses": ids[:, max_prompt:], "returns": returns, "values": values}, batch_size=[n])


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
        t_values = statistics.median(timer(lambda: worker.compute_values(batch))[1] for _ in range(repeats))
        values_peak = _peak_gib()
        _reset_memory()
        t_update = statistics.median(timer(lambda: worker.update_critic(batch))[1] for _ in range(repeats))
        update_peak = _peak_gib()
    finally:
        worker.close()
        del worker
        _reset_memory()
    return {"values": (t_values, values_peak), "update": (t_update, update_peak)}


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
        t = statistics.median(timer(lambda: fn(micros[phase]))[1] for _ in range(repeats))
        out[phase] = (t, _peak_gib())
        out[phase + "_micro_batch"] = micros[phase]
    del model, optimizer
    _reset_memory()
    return out


def _write(rows: list[dict], path: str) -> None:
    """Rewritten after every system, so a crash later in the run keeps what was measured."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megacritic bench", description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b" if cuda else "tiny",
                        help="comma-separated shapes: " + ", ".join(SHAPES))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ", ".join(SYSTEMS))
    parser.add_argument("--rollouts", type=int, default=32 if cuda else 16, help="rollouts per call")
    parser.add_argument("--token-budget", type=int, default=None,
                        help="megacritic-packed: ppo_max_token_len_per_gpu (default 16384)")
    parser.add_argument("--micro-batch", type=int, default=2, help="megacritic-padded: micro-batch size")
    parser.add_argument("--repeats", type=int, default=3 if cuda else 1, help="timed calls per phase (median)")
    parser.add_argument("--warmup", type=int, default=3 if cuda else 1,
                        help="megacritic systems: untimed compute_values + update_critic pairs before timing")
    parser.add_argument("--out", default=None, help="results file (default bench/results/<machine-kind>.json)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the megacritic systems (repeatable), e.g. "
                             "--set model.use_fused_kernels=false; recorded in each row")
    args = parser.parse_args(argv)

    kind = machine_kind()
    max_prompt, max_response = (1024, 8192) if cuda else (32, 128)
    peak = PEAK_FLOPS.get(kind, float("nan"))
    rows = []
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        batch = rollouts(args.rollouts, shape["vocab_size"], max_prompt, max_response)
        seq_lens = batch["attention_mask"].sum(1).tolist()
        real = sum(seq_lens)
        fwd = forward_flops(shape, seq_lens)
        budget = args.token_budget or (16384 if cuda else 512)
        budget = max(budget, -(-max(seq_lens) // 1024) * 1024)  # every rollout must fit one micro-batch
        for system in args.systems.split(","):
            error = None
            try:
                if system == "hf-sdpa-padded":
                    result = run_hf(shape, batch, args.repeats)
                else:
                    extra = args.set + (OFFLOAD if system == "megacritic-offload" else [])
                    result = run_megacritic(shape, batch, system != "megacritic-padded", budget,
                                            args.micro_batch, args.repeats, extra, args.warmup)
            except torch.OutOfMemoryError:
                result, error = None, "out of memory"
                _reset_memory()
            for phase, flops in (("update_critic", 3 * fwd), ("compute_values", fwd)):  # backward = 2x forward
                row = {"system": system, "model": shape_name, "phase": phase, "real_tokens": real,
                       "machine": kind, "device": torch.cuda.get_device_name() if cuda else "cpu"}
                if result is None:
                    row.update(real_tokens_per_s=None, mfu=None, peak_mem_gib=None, error=error)
                else:
                    t, mem = result["update" if phase == "update_critic" else "values"]
                    row.update(real_tokens_per_s=real / t, mfu=flops / t / peak, peak_mem_gib=mem, seconds=t)
                    if system != "hf-sdpa-padded" and args.set:
                        row["overrides"] = args.set
                    if system in ("megacritic-packed", "megacritic-offload"):
                        row["token_budget"] = budget
                    elif system == "megacritic-padded":
                        row["micro_batch"] = args.micro_batch
                    else:
                        row["micro_batch"] = result[("update" if phase == "update_critic" else "values") + "_micro_batch"]
                rows.append(row)
            print(json.dumps(rows[-2:]), flush=True)
            _write(rows, args.out or os.path.join("bench", "results", f"{kind}.json"))

    out = args.out or os.path.join("bench", "results", f"{kind}.json")
    print(f"\n{'model':14} {'phase':15} {'system':18} {'real tok/s':>11} {'MFU':>6} {'peak GiB':>9}")
    for row in rows:
        if row["real_tokens_per_s"] is None:
            print(f"{row['model']:14} {row['phase']:15} {row['system']:18} {row['error']:>28}")
            continue
        print(f"{row['model']:14} {row['phase']:15} {row['system']:18} {row['real_tokens_per_s']:11.0f} "
              f"{row['mfu']:6.3f} {row['peak_mem_gib']:9.1f}")
    print(f"results: {out}")
    return 0
