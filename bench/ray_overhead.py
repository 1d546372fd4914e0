"""What the Ray path costs per call: megacritic.ray.CriticGroup (one rank, one actor) against a CriticWorker
in this process, on the same rollouts and config (megacritic bench's packed default).

    python bench/ray_overhead.py [--shape qwen2.5-1.5b] [--rollouts 32] [--repeats 5] [--warmup 2]
        [--out bench/results/ray_overhead.json] [KEY=VALUE ...]   # config overrides

Prints, per phase, the median wall time of each path and the difference: the batch's trip through the
object store (``ray.put`` once, read by the actor), the actor call and the result's way back. Also: the
time to start the group (actors, process group, model) against the worker's ``init_model``, ``ray.put``
of the batch alone, and a call that does nothing (``offload`` without offload switches: the fan-out and
reply round trip). Without CUDA it runs the ``tiny`` shape on CPU ranks, where timings mean nothing.
"""

import argparse
import json
import os
import statistics
import time

import ray
import torch

from megacritic.bench import SHAPES, megacritic_overrides, rollouts, run_megacritic
from megacritic.config.load import load_config
from megacritic.ray import CriticGroup


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--shape", default="qwen2.5-1.5b" if cuda else "tiny", choices=sorted(SHAPES))
    parser.add_argument("--rollouts", type=int, default=32 if cuda else 8)
    parser.add_argument("--token-budget", type=int, default=16384 if cuda else 512)
    parser.add_argument("--repeats", type=int, default=5 if cuda else 2)
    parser.add_argument("--warmup", type=int, default=2 if cuda else 1)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    parser.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE")
    args = parser.parse_args(argv)

    shape = SHAPES[args.shape]
    max_prompt, max_response = (1024, 8192) if cuda else (32, 128)
    batch = rollouts(args.rollouts, shape["vocab_size"], max_prompt, max_response)
    seq_lens = batch["attention_mask"].sum(1).tolist()
    budget = max(args.token_budget, -(-max(seq_lens) // 1024) * 1024)  # every rollout fits one micro-batch
    overrides = megacritic_overrides(shape, batch, True, budget, 2) + args.overrides
    batch_mib = sum(t.numel() * t.element_size() for t in batch.values()) / 2**20

    # 1. CriticWorker in this process (megacritic bench's own measurement: synchronised, after warm-up).
    start = time.perf_counter()
    direct = run_megacritic(shape, batch, True, budget, 2, args.repeats, args.overrides, args.warmup)
    direct_total = time.perf_counter() - start
    if cuda:
        torch.cuda.empty_cache()

    # 2. The same through a one-rank group.
    ray.init(num_cpus=max(2, (os.cpu_count() or 2) // 2), num_gpus=1 if cuda else 0, include_dashboard=False,
             runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0"}})
    try:
        ray.put(batch)  # (the first put also sets up the object store's client)
        put = _median(lambda: ray.put(batch), args.repeats)
        start = time.perf_counter()
        group = CriticGroup(load_config(overrides), num_gpus_per_node=1, num_gpus_per_actor=1 if cuda else 0,
                            master_addr="127.0.0.1", call_timeout_s=1800)
        started = time.perf_counter() - start
        try:
            group.init_model()
            startup = time.perf_counter() - start
            for _ in range(args.warmup):
                group.compute_values(batch)
                group.update_critic(batch)
            t_values = _median(lambda: group.compute_values(batch), args.repeats)
            t_update = _median(lambda: group.update_critic(batch), args.repeats)
            t_noop = _median(group.offload, max(args.repeats, 10))
        finally:
            group.shutdown()
    finally:
        ray.shutdown()

    rows = [
        # run_megacritic returns each timed call's seconds: its median, as for the group
        {"what": "compute_values", "direct_s": statistics.median(direct["values"][0]), "ray_s": t_values},
        {"what": "update_critic", "direct_s": statistics.median(direct["update"][0]), "ray_s": t_update},
        {"what": "empty call (offload, no switches)", "direct_s": 0.0, "ray_s": t_noop},
        {"what": f"ray.put of the batch ({batch_mib:.0f} MiB)", "direct_s": 0.0, "ray_s": put},
        {"what": "start: actors + rendezvous (group ctor)", "direct_s": 0.0, "ray_s": started},
        {"what": "start: to a built model", "direct_s": None, "ray_s": startup},
    ]
    print(f"\n{args.shape}, {args.rollouts} rollouts ({sum(seq_lens)} real tokens, batch {batch_mib:.0f} MiB), "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}; direct run incl. its start {direct_total:.1f} s")
    print(f"{'':42} {'CriticWorker s':>14} {'CriticGroup s':>14} {'overhead s':>11} {'overhead':>9}")
    for row in rows:
        d, r = row["direct_s"], row["ray_s"]
        if d is None:
            print(f"{row['what']:42} {'':>14} {r:14.4f}")
            continue
        share = f"{(r - d) / d:9.1%}" if d > 0 else ""
        print(f"{row['what']:42} {d:14.4f} {r:14.4f} {r - d:11.4f} {share}")
        row["overhead_s"] = r - d
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "rollouts": args.rollouts, "real_tokens": sum(seq_lens),
                       "batch_mib": batch_mib, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
