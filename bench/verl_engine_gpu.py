"""verl's engine path on one GPU: megacritic's plugin engine, driven the way verl's TrainingWorker drives it
(``BaseEngine.infer_batch`` / ``train_batch`` with verl's ``value_loss``, batches in verl's no-padding
layout), against megacritic's own ``CriticWorker`` on the same rollouts and weights.

    python bench/verl_engine_gpu.py --shape qwen2.5-1.5b --commit $(git rev-parse --short HEAD) \
        --out bench/results/verl-engine-h200.json

Checks: values from the engine equal ``CriticWorker.compute_values`` (bf16, FA2 for determinism: rel. diff
printed, must be 0 up to the bf16 kernels' own noise), and the per-call overhead of the engine path over
``CriticWorker`` alone (median of timed calls, target <= 5%). The worker is the engine's own (the same
settings and weights) and its calls alternate with the engine's. The engine call is timed alone: verl's own
conversions around it (``left_right_2_no_padding`` before, ``no_padding_2_padding`` after), which verl's
trainer runs for any engine, are timed and reported apart. Every timed call is recorded, with min / median /
max per kind; one more call of each kind, untimed, counts its host-device synchronisations (CUDA's sync
debug mode on a GPU; on the CPU, what would synchronise on a GPU: ``bench/host_syncs.py``) and its
torch.distributed collectives.

One process, a world of one; Ray's dispatch is not part of the measurement (verl's worker group adds the
same object-store hop to any engine). Needs verl 0.9.1 importable and megacritic installed (its
``verl.plugins`` entry point registers the engine): ``bench/verl_gpu_wheels.sh`` fetches what the GPU image
lacks and says how to install it. Without a GPU it runs on CPU (gloo, float32), e.g.
``--shape tiny --rollouts 16 --max-prompt 32 --max-response 256 --calls 5`` to check the path.
"""

import argparse
import collections
import contextlib
import cProfile
import importlib.util
import json
import os
import statistics
import time
import traceback
import warnings
from functools import partial

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "broadcast_object_list", "barrier", "all_to_all_single", "gather", "scatter")


def spread(seconds: list[float]) -> dict:
    return {"calls_s": seconds, "min_s": min(seconds), "median_s": statistics.median(seconds),
            "max_s": max(seconds)}


@contextlib.contextmanager
def count_collectives(counts: collections.Counter):
    """Count torch.distributed collectives by name (callers look them up on the module at call time)."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    for name, fn in saved.items():
        setattr(dist, name, counting(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def cuda_syncs(make_input, call, host) -> collections.Counter:
    """Sites of the host-GPU synchronisations of ``call(make_input())`` (CUDA's sync debug mode warns at each,
    in the call alone)."""
    inputs = make_input()
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "site-packages" in f.filename or "src" in f.filename]
        sites[" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(frames[-3:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call(inputs)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def cpu_syncs(make_input, call, host) -> collections.Counter:
    """What would synchronise on a GPU in ``call(make_input())``, counted on the CPU (bench/host_syncs.py):
    tensors alive before count as on the device (model, optimizer state), except ``host``'s; the input is
    built after, on the host, as verl's trainer hands it over."""
    spec = importlib.util.spec_from_file_location("host_syncs", os.path.join(os.path.dirname(__file__),
                                                                             "host_syncs.py"))
    host_syncs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_syncs)
    host_syncs._gpu_copies()
    from megacritic.integrations.verl import engine
    from megacritic.packing import micro_batches
    engine.to_device = micro_batches.to_device  # imported by name there: its copies counted as on a GPU too
    mode = host_syncs.WouldSync()
    host_syncs._count_synchronize(mode)
    host_syncs._mark_existing(dict(enumerate(host)))
    for t in host:  # marked by an earlier count
        setattr(t, host_syncs._MARK, False)
    inputs = make_input()
    with mode:
        call(inputs)
    return mode.sites


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b", help="a bench shape (megacritic.bench.SHAPES)")
    ap.add_argument("--calls", type=int, default=3, help="timed calls of each kind (after one untimed)")
    ap.add_argument("--rollouts", type=int, default=32, help="rollouts per call")
    ap.add_argument("--max-prompt", type=int, default=1024, help="longest prompt (tokens)")
    ap.add_argument("--max-response", type=int, default=8192, help="longest response (tokens)")
    ap.add_argument("--token-budget", type=int, default=16384,
                    help="critic.ppo_max_token_len_per_gpu and its forward twin (tokens per micro-batch)")
    ap.add_argument("--commit", default=None,
                    help="the commit measured, recorded in the figures (default: git rev-parse --short HEAD)")
    ap.add_argument("--no-syncs", action="store_true",
                    help="skip the untimed calls that count host syncs and collectives")
    ap.add_argument("--profile", default=None,
                    help="also write a cProfile of one call of each kind to PREFIX-<kind>.prof")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    from megacritic.bench.results import git_commit
    commit = args.commit or git_commit()["commit"] or "unknown"
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(0)

    from omegaconf import OmegaConf
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    # registered by megacritic's verl.plugins entry point when verl imported its engines, as in verl's workers
    if "megacritic" not in EngineRegistry._engines.get("value_model", {}):
        raise SystemExit("verl has no 'megacritic' engine: install megacritic (pip install --no-deps .) so that "
                         "verl finds its verl.plugins entry point")
    from verl.workers.utils.losses import value_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from megacritic.bench import SHAPES, rollouts
    from megacritic.cli import init_hf

    shape = SHAPES[args.shape]
    model_dir = f"/tmp/verl-engine-{args.shape}-{args.max_prompt + args.max_response}"
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        init_hf(model_dir, [f"model.{k}={v}" for k, v in shape.items()]
                + [f"model.max_position_embeddings={args.max_prompt + args.max_response}"], None)
    # the bench's rollouts (by default 32, prompts 64-1024, responses 16-8192 tokens), in verl's padded layout
    batch = rollouts(args.rollouts, shape["vocab_size"], args.max_prompt, args.max_response)
    batch["prompts"] = batch["input_ids"][:, :args.max_prompt]

    shipped = os.path.join(os.path.dirname(__import__("verl").__file__), "trainer", "config",
                           "_generated_ppo_megatron_trainer.yaml")
    critic = OmegaConf.load(shipped).critic
    critic._target_ = "megacritic.integrations.verl.MegacriticCriticConfig"
    critic.model.path, critic.model.load_tokenizer = model_dir, False
    critic.rollout_n, critic.ppo_mini_batch_size = 1, len(batch)
    critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu = True, args.token_budget
    critic.ppo_infer_max_token_len_per_gpu = critic.forward_max_token_len_per_gpu = args.token_budget
    critic.optim.lr = 1e-6
    own = {"model": {"attention_impl": "fa2"}} if cuda else {"model": {"dtype": "float32"}}
    OmegaConf.update(critic, "megacritic", own, force_add=True)
    cfg = omega_conf_to_dataclass(critic)
    engine = EngineRegistry.new("value_model", "megacritic", model_config=cfg.model, engine_config=cfg.engine,
                                optimizer_config=cfg.optim, checkpoint_config=cfg.checkpoint)
    engine.initialize()
    loss_fn = partial(value_loss, config=cfg)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn, *a):
        sync()
        start = time.perf_counter()
        out = fn(*a)
        sync()
        return time.perf_counter() - start, out

    # verl's trainer converts the padded batch and reads the values back for any engine: timed apart
    def values_input():
        td = left_right_2_no_padding(batch.clone())
        tu.assign_non_tensor(td, compute_loss=False)
        return td

    def update_input(values):
        td = batch.clone()
        td["values"] = values
        td = left_right_2_no_padding(td)
        tu.assign_non_tensor(td, global_batch_size=len(batch))
        return td

    def engine_values(td):
        with engine.eval_mode():
            return engine.infer_batch(td, loss_function=None)

    def values_output(out, td):
        return no_padding_2_padding(out["model_output"]["values"], td).float()

    def engine_update(td):
        with engine.train_mode():
            engine.train_batch(td, loss_fn)
        engine.lr_scheduler_step()

    # megacritic alone: the engine's own CriticWorker (the same settings and weights), its calls interleaved
    # with the engine's so that both see the same machine state
    worker = engine.worker
    td = values_input()
    values = values_output(engine_values(td), td)
    reference = worker.compute_values(batch)
    batch_t = batch.clone()
    batch_t["values"] = reference
    engine_update(update_input(values))
    worker.update_critic(batch_t)
    times = collections.defaultdict(list)
    for _ in range(args.calls):
        t, td = timed(values_input)
        times["verl_left_right_2_no_padding_values"].append(t)
        t, out = timed(engine_values, td)
        times["engine_compute_values"].append(t)
        t, _ = timed(values_output, out, td)
        times["verl_no_padding_2_padding_values"].append(t)
        times["worker_compute_values"].append(timed(worker.compute_values, batch)[0])
    for _ in range(args.calls):
        t, td = timed(update_input, values)
        times["verl_left_right_2_no_padding_update"].append(t)
        times["engine_update"].append(timed(engine_update, td)[0])
        times["worker_update"].append(timed(worker.update_critic, batch_t)[0])

    syncs, collectives = {}, {}

    def count(kind, make_input, call, host):
        counts = collections.Counter()
        with count_collectives(counts):
            sites = (cuda_syncs if cuda else cpu_syncs)(make_input, call, host)
        syncs[kind], collectives[kind] = sum(sites.values()), dict(counts)
        print(f"{kind}: {syncs[kind]} host syncs, collectives {dict(counts)}")
        for site, n in sites.most_common(8):
            print(f"  {n:5d}  {site}")

    if not args.no_syncs:
        count("engine_compute_values", values_input, engine_values, [*batch.values(), values])
        count("worker_compute_values", lambda: batch, worker.compute_values, [*batch.values()])
        count("engine_update", partial(update_input, values), engine_update, [*batch.values(), values])
        count("worker_update", lambda: batch_t, worker.update_critic, [*batch_t.values()])
    if args.profile:
        for kind, call in (("engine_compute_values", partial(engine_values, values_input())),
                           ("worker_compute_values", partial(worker.compute_values, batch)),
                           ("engine_update", partial(engine_update, update_input(values))),
                           ("worker_update", partial(worker.update_critic, batch_t))):
            cProfile.runctx("call()", {}, {"call": call}, f"{args.profile}-{kind}.prof")
    td = values_input()
    engine_after = values_output(engine_values(td), td)
    worker.close()

    diff = float((values - reference).abs().max() / reference.abs().max())
    calls = {kind: spread(seconds) for kind, seconds in times.items()}
    median = {kind: c["median_s"] for kind, c in calls.items()}
    result = {"commit": commit, "shape": args.shape, "rollouts": len(batch),
              "tokens": int(batch["attention_mask"].sum()),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "values_rel_diff": diff,
              "engine_compute_values_s": median["engine_compute_values"],
              "worker_compute_values_s": median["worker_compute_values"],
              "engine_update_s": median["engine_update"], "worker_update_s": median["worker_update"],
              "overhead_compute_values": median["engine_compute_values"] / median["worker_compute_values"] - 1,
              "overhead_update": median["engine_update"] / median["worker_update"] - 1,
              # verl's conversions around the engine call, which its trainer runs for any engine
              "verl_conversions_values_s": (median["verl_left_right_2_no_padding_values"]
                                            + median["verl_no_padding_2_padding_values"]),
              "verl_conversions_update_s": median["verl_left_right_2_no_padding_update"],
              "host_syncs_per_call": syncs, "collectives_per_call": collectives,
              "calls": calls, "engine_after_mean": float(engine_after.mean())}
    print(json.dumps(result, indent=1))
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
