"""Generate examples/rollouts.jsonl: 256 synthetic rollouts whose reward a tiny critic can learn.

Vocabulary of 64 token ids; prompts of 4-16 tokens and responses of 4-32 tokens, drawn uniformly. Each
rollout's ``score`` (placed on its last response token by ``megacritic.data.rollout_file``) is the fraction of
its prompt tokens whose id is below 32: the response tokens do not matter, so with gamma = lam = 1 every
response token's return is that fraction, a function of the prompt that the critic sees at every
response position. Deterministic (Python's ``random.Random`` with a fixed seed): running it again
rewrites the same file byte for byte.

    python examples/make_rollouts.py [--out examples/rollouts.jsonl] [--rows 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

VOCAB_SIZE = 64
PROMPT_LENGTH = (4, 16)
RESPONSE_LENGTH = (4, 32)


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*PROMPT_LENGTH))]
        response = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*RESPONSE_LENGTH))]
        score = sum(t < VOCAB_SIZE // 2 for t in prompt) / len(prompt)
        rows.append({"prompt_ids": prompt, "response_ids": response, "score": score})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("rollouts.jsonl")))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in make_rows(args.rows, args.seed):
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
