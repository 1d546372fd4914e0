"""What a dead rank costs a megacritic.ray.CriticGroup, and whether the recovered run is the uninterrupted one.

    python bench/ray_recovery.py [--shape qwen2.5-1.5b] [--rollouts 32] [--calls 3] [--snapshot-every 1]
        [--kill-at 0.5] [--out bench/results/ray_recovery.json] [KEY=VALUE ...]   # config overrides

Two runs of one-rank groups (NCCL on one GPU; random weights of the shape, megacritic bench's rollouts and
packed config, bf16, FlashAttention-2, megatron.full_determinism) over the same PPO iterations: ``compute_values`` on a batch, then
``update_critic`` on it with those values as the old ones, ``--calls`` times, then the values of the first batch
again. The first run is left alone; in the second, this process SIGKILLs the rank's actor during the 2nd
``update_critic`` (``--kill-at`` of that update's duration in the first run, counted from its snapshot).
Prints the time of each phase in both runs, the recovery (new actor, model built, snapshot loaded, the update
sent again), the snapshot's cost (its time before the 2nd update, the host memory it takes) and whether every
value and metric of the recovered run equals the uninterrupted one bit for bit. Without CUDA it runs the ``tiny`` shape on a CPU rank (timings mean
nothing there).

On the GPU machine Ray comes as bench/ray_bundle.sh's bundle (carry .raywhl):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .raywhl/*.whl \\
      && tar -xJf .raywhl/ray-site.tar.xz -C /tmp/site
    PYTHONPATH=$PWD/src:/tmp/site RAY_AUTH_MODE=disabled python3 bench/ray_recovery.py --out $OUT/ray_recovery.json
"""

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

import ray
import torch

from megacritic.bench import SHAPES, megacritic_overrides, rollouts
from megacritic.bench.results import git_commit
from megacritic.config.load import load_config
from megacritic.ray import CriticGroup


# Where the group's snapshots appear, complete (renamed into place when written): /dev/shm of rank 0's node,
# this machine (CriticGroup's default snapshot_dir).
SNAPSHOTS = "/dev/shm/megacritic-critic-*/step_*"


def _reproducible(key: str) -> bool:
    """Metrics that do not measure wall time or the recovery itself."""
    return not (key.startswith("timing_s/") or key == "perf/tokens_per_s"
                or key in ("critic/restarts", "critic/recovery_s"))


def _run(config, batches, group_options, kill_after_s=None) -> dict:
    """The PPO iterations on a fresh one-rank group; with ``kill_after_s``, its actor is SIGKILLed that long
    into the 2nd update call."""
    out = {"values": [], "metrics": [], "t": {}}
    t = out["t"]
    start = time.perf_counter()
    group = CriticGroup(config, num_gpus_per_node=1, **group_options)
    try:
        group.init_model()
        t["start + init_model"] = time.perf_counter() - start
        for i, batch in enumerate(batches):
            batch = batch.clone()
            start = time.perf_counter()
            out["values"].append(group.compute_values(batch))
            t[f"compute_values {i + 1}"] = time.perf_counter() - start
            batch["values"] = out["values"][-1]
            start = time.perf_counter()
            snapshots = set(glob.glob(SNAPSHOTS))
            future = group.update_critic_async(batch)
            if i == 1:
                if group_options["snapshot_every"] == 1:  # the update itself starts once its snapshot is written
                    while not (new := set(glob.glob(SNAPSHOTS)) - snapshots) and not future.done():
                        time.sleep(0.02)
                    if new and kill_after_s is None:  # the snapshot's size: the host memory it takes
                        du = subprocess.run(["du", "-sb", *new], capture_output=True, text=True).stdout.split()
                        out["snapshot_gib"] = int(du[0]) / 2**30 if du else float("nan")
                update_start = time.perf_counter()
                if kill_after_s is not None:
                    time.sleep(kill_after_s)
                    out["kill_missed"] = future.done()  # (over before the kill: no recovery measured)
                    os.kill(group.placements[0].pid, signal.SIGKILL)
            out["metrics"].append(future.get())
            t[f"update_critic {i + 1}"] = time.perf_counter() - start
            print(f"  {'killed' if kill_after_s is not None else 'uninterrupted'} run, iteration {i + 1}: "
                  + ", ".join(f"{k} {v:.1f} s" for k, v in t.items()), file=sys.stderr, flush=True)
            if i == 1:
                t["update_critic 2 after its snapshot"] = time.perf_counter() - update_start
        start = time.perf_counter()
        out["values"].append(group.compute_values(batches[0]))
        t["compute_values (1st batch again)"] = time.perf_counter() - start
        out["recoveries"] = list(group.recoveries)
    finally:
        group.shutdown()
    return out


def _equal(a, b) -> tuple[bool, float]:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    same = torch.equal(a.nan_to_num(nan=1e300), b.nan_to_num(nan=1e300))
    return same, float((a - b).abs().nan_to_num(0).max()) if a.numel() else 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--shape", default="qwen2.5-1.5b" if cuda else "tiny", choices=sorted(SHAPES))
    parser.add_argument("--rollouts", type=int, default=32 if cuda else 8)
    parser.add_argument("--token-budget", type=int, default=16384 if cuda else 512)
    parser.add_argument("--calls", type=int, default=3, help="PPO iterations (>= 2: the 2nd update is killed)")
    parser.add_argument("--snapshot-every", type=int, default=1,
                        help="CriticGroup(snapshot_every=...): 1 restores the killed update from the snapshot taken "
                             "just before it; 0 rebuilds the model and replays the updates before it")
    parser.add_argument("--kill-at", type=float, default=0.5, help="when to kill, as a fraction of the 2nd update's duration")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD, where there is one)")
    parser.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE")
    args = parser.parse_args(argv)
    if args.calls < 2:
        parser.error("--calls must be at least 2")

    shape = SHAPES[args.shape]
    max_prompt, max_response = (1024, 8192) if cuda else (32, 128)
    batches = [rollouts(args.rollouts, shape["vocab_size"], max_prompt, max_response, seed=i) for i in range(args.calls)]
    budget = max(args.token_budget, -(-max(int(b["attention_mask"].sum(1).max()) for b in batches) // 1024) * 1024)
    # bit-identical runs on a GPU need the deterministic kernels (FA2's backward, the embedding's, cuBLAS')
    attention = ["model.attention_impl=fa2", "megatron.full_determinism=true"] if cuda else []
    overrides = (megacritic_overrides(shape, batches[0], True, budget, 2) + ["model.dtype=bfloat16"] * cuda
                 + attention + args.overrides)
    config = load_config(overrides)
    options = dict(num_gpus_per_actor=1 if cuda else 0, master_addr="127.0.0.1", call_timeout_s=900,
                   snapshot_every=args.snapshot_every)

    # The object store shares /dev/shm with the snapshots: keep it small (the batches are a few MiB).
    ray.init(num_cpus=max(2, (os.cpu_count() or 2) // 2), num_gpus=1 if cuda else 0, include_dashboard=False,
             object_store_memory=2 * 2**30, runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0"}})
    try:
        plain = _run(config, batches, options)
        # a fraction of the 2nd update's own duration (its snapshot written) in the uninterrupted run
        killed = _run(config, batches, options,
                      kill_after_s=args.kill_at * plain["t"]["update_critic 2 after its snapshot"])
    finally:
        ray.shutdown()

    same_values = [_equal(a, b) for a, b in zip(plain["values"], killed["values"])]
    same_metrics = {}
    for i, (a, b) in enumerate(zip(plain["metrics"], killed["metrics"])):
        for key in filter(_reproducible, a):
            same_metrics[f"{key} (update {i + 1})"] = _equal(a[key], b[key])
    device = torch.cuda.get_device_name() if cuda else "cpu"
    commit = args.commit or git_commit()["commit"] or "?"
    print(f"\n{args.shape}, {args.rollouts} rollouts x {args.calls} PPO iterations, one rank on {device}, "
          f"snapshot_every={args.snapshot_every}; commit {commit}")
    print(f"{'phase':48} {'uninterrupted s':>16} {'killed run s':>13}")
    for key in plain["t"]:
        k = killed["t"].get(key)
        print(f"{key:48} {plain['t'][key]:16.2f} {'' if k is None else f'{k:13.2f}'}")
    for r in killed["recoveries"]:
        print(f"recovery {r.restart}: {r.seconds:.2f} s (restore {r.restore_s:.2f} s: "
              f"{'snapshot ' + os.path.basename(r.snapshot) if r.snapshot else 'init_model'} + {r.replayed} "
              f"replayed) after: {'; '.join(str(f) for f in r.failures)}")
    if killed.get("kill_missed"):
        print("the kill came after the 2nd update had finished: lower --kill-at")
    if "snapshot_gib" in plain:
        snapshot_s = plain["t"]["update_critic 2"] - plain["t"]["update_critic 2 after its snapshot"]
        print(f"snapshot before the 2nd update: {snapshot_s:.2f} s, {plain['snapshot_gib']:.3f} GiB in host memory")
    print(f"values bit-identical: {all(s for s, _ in same_values)} (max abs diff "
          f"{max(d for _, d in same_values):.3g}); metrics bit-identical: {all(s for s, _ in same_metrics.values())}")
    for key, (same, diff) in same_metrics.items():
        if not same:
            print(f"  {key}: max abs diff {diff:.3g}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "rollouts": args.rollouts, "calls": args.calls, "device": device,
                       "snapshot_every": args.snapshot_every, "commit": commit, "uninterrupted_s": plain["t"],
                       "killed_s": killed["t"], "kill_missed": killed.get("kill_missed"),
                       "recoveries": [{"seconds": r.seconds, "restore_s": r.restore_s, "replayed": r.replayed,
                                       "failures": [str(f) for f in r.failures]} for r in killed["recoveries"]],
                       "snapshot_gib": plain.get("snapshot_gib"),
                       "values_identical": [s for s, _ in same_values],
                       "metrics_differing": {k: d for k, (s, d) in same_metrics.items() if not s}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
