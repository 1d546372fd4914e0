"""Sum quack's autotuning printouts (``QUACK_PRINT_AUTOTUNING=1``) over the packs of a probe log: for each
tuned function, every configuration's L2-cold time summed over the token counts it was tuned at, against the
heuristic tile (128 x 192 pingpong, cluster 2 x 1) and against the best per pack.

    python bench/quack_autotune_table.py results/probes-session14/mlpbwd-qwen2.5-1.5b-3217f08.log
"""

import re
import sys
from collections import defaultdict

HEURISTIC = "128x192 pingpong 2x1"


def blocks(path: str) -> dict[str, list[dict[str, float]]]:
    """Per tuned function, one {config: ms} per tuning key (a pack's token count), in the log's order."""
    out, current = defaultdict(list), {}
    for line in open(path, errors="replace"):
        if m := re.match(r"\[config: GemmConfig\((.*?)\)\] -> ([0-9.inf]+)ms", line):
            c = dict(kv.split("=") for kv in m.group(1).split(", "))
            name = (f"{c['tile_m']}x{c['tile_n']} {'pingpong' if c['pingpong'] == 'True' else 'coop'} "
                    f"{c['cluster_m']}x{c['cluster_n']}{' swap' if c['swap_ab'] == 'True' else ''}")
            current[name] = float(m.group(2))
        elif m := re.match(r"quack autotuning for function (\S+) finished", line):
            if current:
                out[m.group(1)].append(current)
            current = {}
    return out


def main():
    for path in sys.argv[1:]:
        print(path)
        for fn, keys in blocks(path).items():
            names = set.intersection(*(set(k) for k in keys))
            total = {n: sum(k[n] for k in keys) for n in names}
            base = total.get(HEURISTIC, float("nan"))
            print(f"  {fn}: {len(keys)} packs, heuristic {base:.3f} ms, best per pack "
                  f"{sum(min(k.values()) for k in keys):.3f} ms")
            for name, t in sorted(total.items(), key=lambda nt: nt[1])[:5]:
                print(f"    {name:26} {t:8.3f} {t / base - 1:+7.1%}")


if __name__ == "__main__":
    main()
