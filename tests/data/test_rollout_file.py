"""Tests for megacritic.data.rollout_file: reading, checking and batching rollouts from JSONL and Parquet."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megacritic.data.rollouts import BatchError, rollouts_from_batch
from megacritic.data.rollout_file import (batch_indices, iterate_batches, read_rollouts, to_batch, validate_row,
                                     write_rollouts)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rollouts.jsonl"

ROWS = [
    {"prompt_ids": [5, 6, 7], "response_ids": [8, 9], "score": 1.5},
    {"prompt_ids": [1], "response_ids": [2, 3, 4, 5], "token_rewards": [0.1, -0.2, 0.0, 0.5], "uid": "a"},
    {"prompt_ids": [10, 11], "response_ids": [12], "score": -1},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    path = tmp_path / f"rollouts{suffix}"
    write_rollouts(ROWS, path)
    rows = read_rollouts(path)
    assert len(rows) == 3
    assert rows[0]["prompt_ids"] == [5, 6, 7] and rows[0]["response_ids"] == [8, 9]
    assert rows[0]["token_rewards"] == [0.0, 1.5] and "score" not in rows[0]
    assert rows[1]["token_rewards"] == [0.1, -0.2, 0.0, 0.5] and rows[1]["uid"] == "a"
    assert rows[2]["token_rewards"] == [-1.0]
    assert all("values" not in row for row in rows)
    # normalised rows read back identically, and normalising again changes nothing
    write_rollouts(rows, path)
    again = read_rollouts(path)
    for a, b in zip(rows, again):
        assert {k: v for k, v in a.items() if v is not None} == {k: v for k, v in b.items() if v is not None}
    assert [validate_row(r, i) for i, r in enumerate(rows)] == rows


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_values_round_trip(tmp_path, suffix):
    rows = [dict(r, values=[0.25] * len(r["response_ids"])) for r in ROWS]
    path = tmp_path / f"r{suffix}"
    write_rollouts(rows, path)
    back = read_rollouts(path)
    assert [r["values"] for r in back] == [[0.25] * len(r["response_ids"]) for r in ROWS]


def test_jsonl_skips_blank_lines_and_names_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text("\n" + json.dumps(ROWS[0]) + "\n\n" + json.dumps({"prompt_ids": [1]}) + "\n")
    with pytest.raises(BatchError, match=r"row 1 \(line 4\): missing field 'response_ids'"):
        read_rollouts(path)
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(BatchError, match=r"row 1 \(line 2\): not valid JSON"):
        read_rollouts(path)


def bad(**fields):
    row = {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "score": 1.0}
    row.update(fields)
    return {k: v for k, v in row.items() if v != "DROP"}


@pytest.mark.parametrize("row,message", [
    (bad(prompt_ids="DROP"), "missing field 'prompt_ids'"),
    (bad(response_ids=None), "missing field 'response_ids'"),
    (bad(prompt_ids=[]), "'prompt_ids' is empty"),
    (bad(response_ids=[]), "'response_ids' is empty"),
    (bad(prompt_ids="1 2"), "'prompt_ids' must be a list"),
    (bad(response_ids=[3, 4.0, 5]), r"'response_ids'\[1\] must be an int"),
    (bad(response_ids=[3, True]), r"'response_ids'\[1\] must be an int"),
    (bad(prompt_ids=[1, -2]), r"'prompt_ids'\[1\] is a negative token id"),
    (bad(score="DROP"), "missing field 'token_rewards' or 'score'"),
    (bad(token_rewards=[0.0, 0.0, 1.0]), "has both 'token_rewards' and 'score'"),
    (bad(score="high"), "'score' must be a number"),
    (bad(score=math.nan), "'score' is not finite"),
    (bad(score="DROP", token_rewards=[1.0, 2.0]), "'token_rewards' has 2 entries but response_ids has 3"),
    (bad(score="DROP", token_rewards=[1.0, math.inf, 2.0]), r"'token_rewards'\[1\] is not finite"),
    (bad(score="DROP", token_rewards=[1.0, "x", 2.0]), r"'token_rewards'\[1\] must be a number"),
    (bad(score="DROP", token_rewards=0.5), "'token_rewards' must be a list"),
    (bad(values=[0.0, 0.0]), "'values' has 2 entries but response_ids has 3"),
    (bad(values=[0.0, math.nan, 0.0]), r"'values'\[1\] is not finite"),
    ([1, 2, 3], "expected an object"),
])
def test_validation_errors(tmp_path, row, message):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")   # json writes NaN/Infinity
    with pytest.raises(BatchError, match=r"r\.jsonl: row 1 \(line 2\): " + message):
        read_rollouts(path)


def test_parquet_errors_name_the_row(tmp_path):
    path = tmp_path / "r.parquet"
    write_rollouts([ROWS[0], {"prompt_ids": [1], "response_ids": [2, 3], "score": 1.0, "values": [0.5]}], path)
    with pytest.raises(BatchError, match=r"row 1: 'values' has 1 entries"):
        read_rollouts(path)
    path.write_bytes(b"not parquet")
    with pytest.raises(BatchError, match="not a readable Parquet file"):
        read_rollouts(path)


def test_file_errors(tmp_path):
    with pytest.raises(BatchError, match="does not exist"):
        read_rollouts(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(BatchError, match="holds no rollout"):
        read_rollouts(tmp_path / "empty.jsonl")


def test_to_batch_layout():
    rows = [validate_row(r, i) for i, r in enumerate(ROWS)]
    td = to_batch(rows, pad_id=63)
    assert td.batch_size == torch.Size([3])
    assert td["input_ids"].tolist() == [
        [5, 6, 7, 8, 9, 63, 63],
        [63, 63, 1, 2, 3, 4, 5],
        [63, 10, 11, 12, 63, 63, 63],
    ]
    assert td["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]]
    assert td["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 2, 2, 2]]
    assert torch.equal(td["responses"], td["input_ids"][:, 3:])
    assert td["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    torch.testing.assert_close(td["token_level_rewards"], torch.tensor(
        [[0.0, 1.5, 0, 0], [0.1, -0.2, 0.0, 0.5], [-1.0, 0, 0, 0]]))
    assert td["token_level_rewards"].dtype == torch.float32 and "values" not in td.keys()
    ro = rollouts_from_batch(td, need_targets=False, vocab_size=64)
    assert ro.prompt_lens.tolist() == [3, 1, 2] and ro.response_lens.tolist() == [2, 4, 1]


def test_to_batch_widths_and_values():
    rows = [dict(r, values=[float(j) for j in range(len(r["response_ids"]))]) for r in ROWS]
    td = to_batch(rows, prompt_width=5, response_width=6)
    assert td["input_ids"].shape == (3, 11) and td["responses"].shape == (3, 6)
    assert td["values"].tolist()[1] == [0, 1, 2, 3, 0, 0]
    rollouts_from_batch(td, need_targets=False, vocab_size=64)
    # a batch without values in some row has no values key
    assert "values" not in to_batch(rows[:2] + ROWS[2:]).keys()
    with pytest.raises(BatchError, match="prompt_width=2 is shorter than row 0's prompt_ids"):
        to_batch(ROWS, prompt_width=2)
    with pytest.raises(BatchError, match="response_width=3 is shorter than row 1's response_ids"):
        to_batch(ROWS, response_width=3)
    with pytest.raises(BatchError, match="at least one rollout"):
        to_batch([])
    with pytest.raises(BatchError, match="row 1: missing field 'prompt_ids'"):
        to_batch([ROWS[0], {"response_ids": [1], "score": 0.0}])


def test_batch_indices():
    first = batch_indices(10, 3, seed=7, epoch=0)
    assert len(first) == 3 and all(len(b) == 3 for b in first)           # the 10th row is dropped
    assert len({i for b in first for i in b}) == 9
    assert first == batch_indices(10, 3, seed=7, epoch=0)                 # reproducible
    assert first != batch_indices(10, 3, seed=7, epoch=1)                 # a new order each epoch
    assert first != batch_indices(10, 3, seed=8, epoch=0)
    assert batch_indices(7, 2, seed=None, epoch=3) == [[0, 1], [2, 3], [4, 5]]
    assert batch_indices(4, 4, seed=1, epoch=0)[0] != [] and len(batch_indices(4, 4, seed=1, epoch=0)) == 1
    for size in (0, 5, 2.0):
        with pytest.raises(BatchError, match="batch_size must be between 1 and the number of rollouts"):
            batch_indices(4, size, seed=1, epoch=0)


def test_example_file_is_reproducible_and_learnable(tmp_path):
    out = tmp_path / "rollouts.jsonl"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_rollouts.py"), "--out", str(out)], check=True)
    assert out.read_bytes() == EXAMPLE.read_bytes()
    rows = read_rollouts(EXAMPLE)
    assert len(rows) == 256
    for row in rows:
        assert 4 <= len(row["prompt_ids"]) <= 16 and 4 <= len(row["response_ids"]) <= 32
        assert max(row["prompt_ids"] + row["response_ids"]) < 64
        assert row["token_rewards"][-1] == sum(t < 32 for t in row["prompt_ids"]) / len(row["prompt_ids"])
        assert not any(row["token_rewards"][:-1])
    batches = list(iterate_batches(rows, 64, seed=3, epoch=0, prompt_width=16, response_width=32))
    assert len(batches) == 4 and all(b["input_ids"].shape == (64, 48) for b in batches)
    for b in batches:
        rollouts_from_batch(b, need_targets=False, vocab_size=64)
    scores = torch.cat([b["token_level_rewards"].sum(1) for b in batches])
    assert scores.std() > 0.1                                              # a target worth learning
