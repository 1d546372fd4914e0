"""megacritic.parallel: the layout derived from the config and the world size (with the checks that need the
world size), and Megatron's parallel state: created, or reused from a colocated model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megacritic.config import TINY_MODEL_OVERRIDES, ConfigError, MegatronConfig
from megacritic.config.load import load_config
from megacritic.parallel import ParallelLayout

BASE = [*TINY_MODEL_OVERRIDES,
    "data.prompt_length=[4,16]", "data.response_length=[4,32]", "data.rollouts_per_step=64",
    "ppo_mini_batch_size=16", "ppo_micro_batch_size_per_gpu=4", "optim.lr=1e-5", "optim.min_lr=0",
]


def _dp(config, world_size: int) -> int:
    """The checks the worker makes before it initialises anything; the data-parallel size."""
    layout = ParallelLayout.from_config(config.megatron, world_size)
    layout.check_batch_sizes(config)
    return layout.dp


# ------------------------------------------------------------------------------------ derived settings


@pytest.mark.parametrize("mg, world, expected", [
    (MegatronConfig(), 1, dict(tp=1, pp=1, vpp=1, cp=1, dp=1, sequence_parallel=False, fixed_micro_batch_shape=False,
                               variable_seq_lengths=False, micro_batch_multiple=1, seq_multiple=1)),
    (MegatronConfig(tensor_model_parallel_size=2), 4,
     dict(dp=2, sequence_parallel=True, seq_multiple=2, variable_seq_lengths=False)),
    (MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=False), 2, dict(sequence_parallel=False,
                                                                                    seq_multiple=1)),
    (MegatronConfig(pipeline_model_parallel_size=2), 2, dict(variable_seq_lengths=True, micro_batch_multiple=1)),
    (MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 2,
     dict(vpp=2, fixed_micro_batch_shape=True, variable_seq_lengths=False, micro_batch_multiple=2)),
    (MegatronConfig(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2), 8,
     dict(dp=2, fixed_micro_batch_shape=False, variable_seq_lengths=True, micro_batch_multiple=4)),
    (MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1), 2, dict(vpp=1)),
    (MegatronConfig(context_parallel_size=2, tensor_model_parallel_size=2), 8, dict(cp=2, dp=2)),
])
def test_layout_derives_its_settings(mg, world, expected):
    layout = ParallelLayout.from_config(mg, world)
    assert {key: getattr(layout, key) for key in expected} == expected
    with pytest.raises(AttributeError):
        layout.dp = 3  # frozen


# ------------------------------------------------------------------------------------ world-size checks


def test_layout_world_size_not_divisible_by_model_parallel():
    config = load_config(BASE + ["megatron.tensor_model_parallel_size=2", "megatron.pipeline_model_parallel_size=2"])
    with pytest.raises(ConfigError) as info:
        _dp(config, 6)
    message = str(info.value)
    assert "world size 6" in message
    assert "megatron." in message


@pytest.mark.parametrize("world_size", [2, 6, 12])
def test_layout_world_size_not_divisible_by_tp_x_pp_x_cp(world_size):
    config = load_config(BASE + ["megatron.tensor_model_parallel_size=2", "megatron.pipeline_model_parallel_size=2",
                                 "megatron.context_parallel_size=2"])
    with pytest.raises(ConfigError) as info:
        _dp(config, world_size)
    for key in ("megatron.tensor_model_parallel_size", "megatron.pipeline_model_parallel_size",
                "megatron.context_parallel_size"):
        assert key in str(info.value)


def test_layout_mini_batch_not_divisible_by_dp_with_context_parallel():
    # world 12 / (cp 2 x tp 2) = dp 3 does not divide 16
    config = load_config(BASE + ["megatron.context_parallel_size=2", "megatron.tensor_model_parallel_size=2",
                                 "ppo_micro_batch_size_per_gpu=1"])
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        _dp(config, 12)


def test_layout_mini_batch_not_divisible_by_dp():
    config = load_config(BASE + ["ppo_mini_batch_size=16", "ppo_micro_batch_size_per_gpu=1", "data.rollouts_per_step=48"])
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        _dp(config, 3)  # dp = 3


def test_layout_per_rank_mini_batch_not_divisible_by_micro_batch():
    # 16 sequences over dp=4 -> 4 per rank, micro-batch 3 does not divide it
    config = load_config(BASE + ["ppo_mini_batch_size=16", "ppo_micro_batch_size_per_gpu=3"])
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu"):
        _dp(config, 4)


def test_layout_vpp_needs_micro_batch_count_multiple_of_pp():
    # pp=4, vpp=2, world 4 -> dp=1; 16 / 8 = 2 micro-batches, not a multiple of 4
    config = load_config(BASE + [
        "model.num_hidden_layers=8",
        "megatron.pipeline_model_parallel_size=4",
        "megatron.virtual_pipeline_model_parallel_size=2",
        "ppo_mini_batch_size=16",
        "ppo_micro_batch_size_per_gpu=8",
    ])
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu"):
        _dp(config, 4)
    # with 4 micro-batches the same layout is fine
    config.ppo_micro_batch_size_per_gpu = 4
    assert _dp(config, 4) == 1


@pytest.mark.parametrize("overrides, world_size, dp", [
    ([], 1, 1),
    (["ppo_mini_batch_size=16", "ppo_micro_batch_size_per_gpu=2"], 8, 8),
    (["megatron.tensor_model_parallel_size=2", "ppo_mini_batch_size=16", "ppo_micro_batch_size_per_gpu=4"], 8, 4),
    (["megatron.tensor_model_parallel_size=2", "megatron.pipeline_model_parallel_size=2",
      "ppo_mini_batch_size=16", "ppo_micro_batch_size_per_gpu=4"], 8, 2),
    (["model.num_hidden_layers=4", "megatron.pipeline_model_parallel_size=2",
      "megatron.virtual_pipeline_model_parallel_size=2", "ppo_mini_batch_size=16",
      "ppo_micro_batch_size_per_gpu=4"], 4, 2),
    (["use_dynamic_bsz=true", "ppo_max_token_len_per_gpu=512", "ppo_micro_batch_size_per_gpu=null"], 4, 4),
    (["megatron.context_parallel_size=2", "ppo_mini_batch_size=16", "ppo_micro_batch_size_per_gpu=4"], 8, 4),
    (["megatron.context_parallel_size=2", "megatron.tensor_model_parallel_size=2",
      "megatron.pipeline_model_parallel_size=2", "ppo_mini_batch_size=16", "ppo_micro_batch_size_per_gpu=4"], 16, 2),
    (["model.num_hidden_layers=4", "megatron.context_parallel_size=2", "megatron.pipeline_model_parallel_size=2",
      "megatron.virtual_pipeline_model_parallel_size=2", "ppo_mini_batch_size=16",
      "ppo_micro_batch_size_per_gpu=4"], 8, 2),
])
def test_layout_valid_returns_dp(overrides, world_size, dp):
    config = load_config(BASE + overrides)
    assert _dp(config, world_size) == dp


# ------------------------------------------------------------------------------------ colocation


def test_process_group_of_another_role_is_used_and_left_up(monkeypatch):
    """A world already initialised in the process (e.g. a colocated FSDP actor's): the critic joins it, builds
    its own parallel state, and leaves the process group up when closed."""
    import torch.distributed as dist

    from megacritic import CriticWorker
    from megacritic.data.sources import SyntheticRollouts
    from megacritic.parallel import free_port

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        config = load_config([*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4", "ppo_micro_batch_size_per_gpu=2"])
        worker = CriticWorker(config)
        worker.init_model()
        assert worker.compute_values(SyntheticRollouts(config).batch(0)).shape[0] == 8
        worker.close()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    out = tmp_path_factory.mktemp("colocation") / "result.json"
    script = Path(__file__).parent / "multiproc" / "colocation_run.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_matching_parallel_state_is_reused_and_kept(colocated):
    assert colocated["kept"]  # close() left the colocated model's parallel state in place
    assert colocated["reused"] == colocated["own"]  # the same values as with a parallel state of its own
    assert colocated["destroyed"]  # ... which close() does tear down


def test_other_degrees_are_refused_naming_the_fix(colocated):
    message = colocated["refusal"]
    assert message is not None
    assert "megatron.tensor_model_parallel_size=1 (initialised: 2)" in message
    assert "own resource pool" in message
