"""Rollouts from a file (Parquet or JSONL), turned into verl-layout batches for the critic.

One rollout per row (a JSON object per line, or a Parquet row) with the fields

- ``prompt_ids``: list of int token ids, at least one;
- ``response_ids``: list of int token ids, at least one;
- exactly one of ``token_rewards`` (list of float, one per response token) and ``score`` (one float, the
  response's reward, placed on its last token); a null counts as absent;
- optionally ``values``: list of float, old values, one per response token (null: absent).

Other fields are kept as they are. A bad row raises :class:`megacritic.data.rollouts.BatchError` naming the row
(numbered from 0 in file order, plus the line number for JSONL) and the field.

Typical use::

    rows = read_rollouts("examples/rollouts.jsonl")
    for batch in iterate_batches(rows, batch_size=64, seed=1, epoch=0):
        batch["values"] = worker.compute_values(batch)
        adv, batch["returns"] = compute_gae(batch["token_level_rewards"], batch["values"],
                                            batch["response_mask"], gamma=1.0, lam=1.0)
        worker.update_critic(batch)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tensordict import TensorDict

from megacritic.data.rollouts import BatchError, seeded_permutation, verl_batch

__all__ = ["read_rollouts", "write_rollouts", "validate_row", "to_batch", "batch_indices", "iterate_batches"]

PARQUET_SUFFIXES = (".parquet", ".pq")


def _where(index: int, line: int | None) -> str:
    return f"row {index}" + (f" (line {line})" if line is not None else "")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_ids(row: dict, field: str, where: str) -> list[int]:
    ids = row.get(field)
    if ids is None:
        raise BatchError(f"{where}: missing field {field!r}")
    if not isinstance(ids, (list, tuple)):
        raise BatchError(f"{where}: {field!r} must be a list of int token ids, got {type(ids).__name__}")
    for j, x in enumerate(ids):
        if not _is_int(x):
            raise BatchError(f"{where}: {field!r}[{j}] must be an int token id, got {type(x).__name__} {x!r}")
        if x < 0:
            raise BatchError(f"{where}: {field!r}[{j}] is a negative token id ({x})")
    if not ids:
        raise BatchError(f"{where}: {field!r} is empty; every rollout needs at least one token there")
    return list(ids)


def _floats(row: dict, field: str, length: int, where: str) -> list[float]:
    xs = row[field]
    if not isinstance(xs, (list, tuple)):
        raise BatchError(f"{where}: {field!r} must be a list of numbers, got {type(xs).__name__}")
    if len(xs) != length:
        raise BatchError(f"{where}: {field!r} has {len(xs)} entries but response_ids has {length}; "
                         f"they must have one per response token")
    for j, x in enumerate(xs):
        if not _is_number(x):
            raise BatchError(f"{where}: {field!r}[{j}] must be a number, got {type(x).__name__} {x!r}")
        if not math.isfinite(x):
            raise BatchError(f"{where}: {field!r}[{j}] is not finite ({x})")
    return [float(x) for x in xs]


def validate_row(row, index: int = 0, line: int | None = None) -> dict:
    """Check one rollout and return it normalised: ``prompt_ids`` and ``response_ids`` (lists of int),
    ``token_rewards`` (list of float; a ``score`` is replaced by rewards that are 0 except the score on the
    last response token), ``values`` (list of float) only when present, and every other field unchanged.
    Normalising is idempotent. Raises BatchError naming ``row index`` (and ``line``) and the field."""
    where = _where(index, line)
    if not isinstance(row, dict):
        raise BatchError(f"{where}: expected an object with prompt_ids, response_ids and token_rewards or "
                         f"score, got {type(row).__name__}")
    prompt = _token_ids(row, "prompt_ids", where)
    response = _token_ids(row, "response_ids", where)
    has_rewards, has_score = row.get("token_rewards") is not None, row.get("score") is not None
    if has_rewards and has_score:
        raise BatchError(f"{where}: has both 'token_rewards' and 'score'; give exactly one")
    if not has_rewards and not has_score:
        raise BatchError(f"{where}: missing field 'token_rewards' or 'score' (give exactly one)")
    if has_rewards:
        rewards = _floats(row, "token_rewards", len(response), where)
    else:
        score = row["score"]
        if not _is_number(score):
            raise BatchError(f"{where}: 'score' must be a number, got {type(score).__name__} {score!r}")
        if not math.isfinite(score):
            raise BatchError(f"{where}: 'score' is not finite ({score})")
        rewards = [0.0] * (len(response) - 1) + [float(score)]
    out = {k: v for k, v in row.items() if k not in ("values", "token_rewards", "score")}
    out.update(prompt_ids=prompt, response_ids=response, token_rewards=rewards)
    if row.get("values") is not None:
        out["values"] = _floats(row, "values", len(response), where)
    return out


def read_rollouts(path: str | Path) -> list[dict]:
    """Read and check every rollout of a ``.parquet`` / ``.pq`` file (pyarrow) or a JSONL file (any other
    name; blank lines are skipped). Returns the rows normalised by :func:`validate_row`, in file order.
    Raises BatchError for an unreadable or empty file or a bad row (naming the row and the field)."""
    path = Path(path)
    if not path.is_file():
        raise BatchError(f"rollout file {str(path)!r} does not exist")
    rows: list[dict] = []
    if path.suffix.lower() in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise BatchError(f"{path}: not a readable Parquet file ({exc})") from exc
        for i, row in enumerate(table.to_pylist()):
            rows.append(_checked(path, row, i, None))
    else:
        with path.open(encoding="utf-8") as f:
            for lineno, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise BatchError(f"{path}: {_where(len(rows), lineno)}: not valid JSON ({exc.msg})") from exc
                rows.append(_checked(path, row, len(rows), lineno))
    if not rows:
        raise BatchError(f"{path}: holds no rollout")
    return rows


def _checked(path: Path, row, index: int, line: int | None) -> dict:
    try:
        return validate_row(row, index, line)
    except BatchError as exc:
        raise BatchError(f"{path}: {exc}") from None


def write_rollouts(rows: Sequence[dict], path: str | Path) -> None:
    """Write rollouts as Parquet (``.parquet`` / ``.pq``) or JSONL (any other name), one per row/line.

    Rows are written as given (no validation), so ``read_rollouts(path)`` returns what ``validate_row``
    makes of them. Parquet gets a column per field seen in any row (null where a row lacks it)."""
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        import pyarrow as pa
        import pyarrow.parquet as pq
        keys = list(dict.fromkeys(k for row in rows for k in row))   # every field of any row, first-seen order
        pq.write_table(pa.Table.from_pydict({k: [row.get(k) for row in rows] for k in keys}), path)
    else:
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")


def to_batch(rows: Sequence[dict], prompt_width: int | None = None, response_width: int | None = None,
             pad_id: int = 0) -> TensorDict:
    """Stack rollouts into one verl-layout batch (B rows, P = prompt width, R = response width).

    Rows are checked with :func:`validate_row` (so hand-built rows work too). Prompts are left-padded to
    ``prompt_width`` (default: the longest prompt), responses right-padded to ``response_width`` (default:
    the longest response); a width shorter than some row is a BatchError (nothing is truncated). Keys:

    - ``input_ids`` [B, P+R] int64, padding = ``pad_id``; ``attention_mask`` [B, P+R] int64;
      ``position_ids`` [B, P+R] int64 = ``clamp(cumsum(attention_mask) - 1, 0)``;
      ``responses`` [B, R] int64 = the last R columns of ``input_ids``;
    - ``response_mask`` [B, R] float32 (the response part of ``attention_mask``);
    - ``token_level_rewards`` [B, R] float32 (0 on padding);
    - ``values`` [B, R] float32 (0 on padding), only when every row has ``values``.
    """
    if not rows:
        raise BatchError("to_batch needs at least one rollout")
    rows = [validate_row(row, i) for i, row in enumerate(rows)]
    p = max(len(row["prompt_ids"]) for row in rows)
    r = max(len(row["response_ids"]) for row in rows)
    for name, width, longest, field in (("prompt_width", prompt_width, p, "prompt_ids"),
                                        ("response_width", response_width, r, "response_ids")):
        if width is not None and width < longest:
            i = max(range(len(rows)), key=lambda k: len(rows[k][field]))
            raise BatchError(f"{name}={width} is shorter than row {i}'s {field} ({longest} tokens)")
    p = prompt_width if prompt_width is not None else p
    r = response_width if response_width is not None else r
    b = len(rows)
    tokens = torch.full((b, p + r), pad_id, dtype=torch.int64)
    rewards = torch.zeros(b, r, dtype=torch.float32)
    with_values = all("values" in row for row in rows)
    values = torch.zeros(b, r, dtype=torch.float32)
    for i, row in enumerate(rows):
        prompt, response = row["prompt_ids"], row["response_ids"]
        lp, lr = len(prompt), len(response)
        tokens[i, p - lp:p] = torch.tensor(prompt, dtype=torch.int64)
        tokens[i, p:p + lr] = torch.tensor(response, dtype=torch.int64)
        rewards[i, :lr] = torch.tensor(row["token_rewards"], dtype=torch.float32)
        if with_values:
            values[i, :lr] = torch.tensor(row["values"], dtype=torch.float32)
    lengths = [torch.tensor([len(row[key]) for row in rows]) for key in ("prompt_ids", "response_ids")]
    return verl_batch(tokens, *lengths, prompt_width=p, pad_id=pad_id, token_level_rewards=rewards,
                      **({"values": values} if with_values else {}))


def batch_indices(n: int, batch_size: int, seed: int | None, epoch: int) -> list[list[int]]:
    """Row indices of the fixed-size batches of one epoch over ``n`` rows.

    The order is a permutation drawn from ``seed`` and ``epoch`` (a different one each epoch, the same on
    every call and machine); ``seed=None`` keeps file order. The last ``n % batch_size`` rows of the order
    are dropped, so every batch has exactly ``batch_size`` rows; since the order changes with the epoch,
    different rows are dropped in different epochs. Raises BatchError when ``batch_size`` is not in [1, n].
    """
    if not _is_int(batch_size) or not 1 <= batch_size <= n:
        raise BatchError(f"batch_size must be between 1 and the number of rollouts ({n}), got {batch_size}")
    if seed is None:
        order = list(range(n))
    else:
        order = seeded_permutation(n, seed, epoch=epoch).tolist()
    return [order[k:k + batch_size] for k in range(0, n - batch_size + 1, batch_size)]


def iterate_batches(rows: Sequence[dict], batch_size: int, seed: int | None, epoch: int, *,
                    prompt_width: int | None = None, response_width: int | None = None,
                    pad_id: int = 0) -> Iterator[TensorDict]:
    """Yield the epoch's batches (``len(rows) // batch_size`` of them, each of exactly ``batch_size``
    rollouts, the remainder dropped) in the seeded order of :func:`batch_indices`, each built by
    :func:`to_batch` with the given widths and pad id (by default each batch is as wide as its longest
    prompt and response)."""
    for idx in batch_indices(len(rows), batch_size, seed, epoch):
        yield to_batch([rows[i] for i in idx], prompt_width=prompt_width, response_width=response_width,
                       pad_id=pad_id)
