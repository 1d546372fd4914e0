"""GPU time of a profiled call by the host op that launched each kernel, from a torch profiler Chrome trace
(``bench/profile_phase.py --trace OUT.json``): which autograd node and which aten op a memory-bound kernel
(an add, a fill, a reduction) belongs to, which the profiler's own tables do not say.

    python bench/kernels_by_op.py TRACE.json[.gz] [--top 40]

Each kernel, memset and copy is joined to its launch (the runtime call with the same correlation id), and
the launch to the host ops open around it on its thread: the innermost aten op and the innermost autograd
node or ``*Function`` (an autograd Function's forward) or named range.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def device_events(events: list[dict]) -> list[dict]:
    """The trace's kernels, memsets and copies on the GPU, by start time."""
    device = ("kernel", "gpu_memcpy", "gpu_memset")
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in device), key=lambda e: e["ts"])


def launches_by_correlation(events: list[dict]) -> dict:
    """The host's launch (runtime or driver call) of each device event, by their shared correlation id."""
    return {e["args"]["correlation"]: e for e in events if e.get("ph") == "X"
            and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}


def host_ops_by_thread(events: list[dict]) -> dict[int, list[dict]]:
    """The host's ops and named ranges per thread, by start (an outer one before an inner one starting with it)."""
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ops[e["tid"]].append(e)
    for evs in ops.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    return ops


def _context(stack: list[dict]) -> tuple[str, str]:
    """(innermost aten op, innermost autograd node / Function / range) of the ops open at a launch."""
    op = next((e["name"] for e in reversed(stack) if e["name"].startswith("aten::")), "-")
    node = next((e["name"] for e in reversed(stack)
                 if e["name"].startswith("autograd::engine::evaluate_function")
                 or e["name"].endswith(("Function", "Backward", "Backward0"))
                 or e.get("cat") == "user_annotation"), "-")
    return op, node.replace("autograd::engine::evaluate_function: ", "bwd: ")


def by_op(events: list[dict]) -> collections.Counter:
    """Device microseconds by (autograd node or range, aten op, kernel) of each device event's launch."""
    launches, ops = launches_by_correlation(events), host_ops_by_thread(events)
    starts = {tid: [e["ts"] for e in evs] for tid, evs in ops.items()}
    totals = collections.Counter()
    for k in device_events(events):
        launch = launches.get(k.get("args", {}).get("correlation"))
        context = ("-", "-")
        if launch is not None:
            evs, ts = ops.get(launch["tid"], []), launch["ts"]
            i = bisect.bisect_right(starts.get(launch["tid"], []), ts)
            # ops are nested on a thread, so those open at ts are found walking back from the last start
            # before it; a bounded walk keeps this linear enough for one call's trace
            stack = [e for e in evs[max(0, i - 400):i] if e["ts"] + e["dur"] >= ts]
            context = _context(stack)
        totals[(context[1][:60], context[0][:40], k["name"][:70])] += k["dur"]
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    totals = by_op(load(args.trace))
    all_us = sum(totals.values())
    print(f"{all_us / 1e3:.1f} ms of device time in {len(totals)} (node, op, kernel) groups")
    print(f"{'ms':>8} {'share':>6}  node | op | kernel")
    for (node, op, kernel), us in totals.most_common(args.top):
        print(f"{us / 1e3:8.2f} {us / all_us:6.1%}  {node} | {op} | {kernel}")
    nodes = collections.Counter()
    for (node, _, _), us in totals.items():
        nodes[node] += us
    print("\nby node:")
    for node, us in nodes.most_common(args.top):
        print(f"{us / 1e3:8.2f} {us / all_us:6.1%}  {node}")


if __name__ == "__main__":
    main()
