"""Config fuzz: hundreds of random invalid configs each fail with a ConfigError that names a key, never
another exception and never later: in load_config when every bad setting is the library's, and in the
checks of ``megacritic train`` (the CLI's config path) when one is a CLI-only setting."""

import random

import pytest

from megacritic.cli import train_config
from megacritic.config import TINY_MODEL_OVERRIDES, ConfigError
from megacritic.config.load import load_config

# Settings only `megacritic train` reads: load_config carries them unchecked.
CLI_ONLY = ("data.", "trainer.", "algorithm.")

# Settings that are invalid whatever else is set.
BAD = {
    "ppo_mini_batch_size": [0, -3, "many", 1.5],
    "ppo_epochs": [0, -1, "x"],
    "cliprange_value": [0, -0.2, "wide"],
    "loss_agg_mode": ["mean", "token_mean", 3],
    "shuffle": ["perhaps"],
    "megatron.tensor_model_parallel_size": [0, -2, 3, 5],  # 3 and 5 divide neither 4 heads nor 2 kv heads
    "megatron.pipeline_model_parallel_size": [0, -1, 3],  # 3 does not divide 2 layers
    "megatron.virtual_pipeline_model_parallel_size": [0, -1],
    "megatron.context_parallel_size": [0, -2],
    "megatron.nccl_timeout": [0, -10],
    "optim.lr": [0, -1e-5, "fast"],
    "optim.min_lr": [-1.0, 1.0],  # above the lr
    "optim.weight_decay": [-0.1],
    "optim.clip_grad": [-1.0],
    "optim.lr_decay_style": ["step", "exp"],
    "optim.lr_warmup_steps_ratio": [-0.5, 1.5],
    "optim.lr_warmup_steps": [-5],
    "optim.betas": ["[0.9]", "[1.5,0.9]"],
    "model.hidden_size": [0, -64, 63],
    "model.num_attention_heads": [0, 3],  # 3 is not a multiple of the 2 kv heads
    "model.num_key_value_heads": [0, 3],
    "model.dtype": ["fp8", "half"],
    "model.value_head_init": ["uniform", "from_checkpoint"],  # from_checkpoint needs model.path
    "model.path": ["/nonexistent/model"],
    "model.num_experts": [-1],
    # MoE-only settings on the default dense model (or out of range)
    "model.moe_aux_loss_coeff": [0.1, -1.0],
    "model.freeze_moe_router": ["true"],
    "megatron.expert_model_parallel_size": [0, 2],
    "megatron.expert_tensor_parallel_size": [0, 2],
    "trainer.steps": [0, -1],
    "trainer.save_every": [-1],
    "trainer.max_consecutive_skips": [0],
    "data.rollouts_per_step": [0, 17],  # 17 is not a multiple of the mini-batch
    "data.prompt_length": ["[0,4]", "[5,4]", "[3]"],
    "data.response_length": ["[4,300]"],  # longer than the 256 positions with a prompt
    "algorithm.gamma": [-0.1, 1.5],
    "algorithm.lam": [2.0],
    "unknown_key": [1],
    "megatron.unknown": [1],
}
# Valid changes mixed in, so the bad setting is not always alone.
NOISE = {
    "ppo_epochs": [1, 2, 3],
    "shuffle": ["true", "false"],
    "cliprange_value": [0.1, 0.5],
    "loss_agg_mode": ["token-mean", "seq-mean-token-mean"],
    "optim.lr": [1e-4, 1e-3],
    "model.use_remove_padding": ["true", "false"],
    "trainer.steps": [1, 5],
}


def _case(seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    bad_keys = rng.sample(sorted(BAD), rng.randint(1, 3))
    bad = [f"{k}={rng.choice(BAD[k])}" for k in bad_keys]
    noise = [f"{k}={rng.choice(v)}" for k, v in NOISE.items() if k not in bad_keys and rng.random() < 0.4]
    return noise + bad, bad_keys


@pytest.mark.parametrize("seed", range(300))
def test_random_invalid_config_is_refused_at_load(seed):
    bad, bad_keys = _case(seed)
    with pytest.raises(ConfigError) as info:
        if any(k.startswith(CLI_ONLY) for k in bad_keys):
            train_config(bad)  # the CLI's path: the tiny model where model.path is unset, the job's checks
        else:
            load_config([*TINY_MODEL_OVERRIDES, *bad])
    message = str(info.value)
    assert any(k.rsplit(".", 1)[-1] in message for k in bad_keys) or "world size" in message, message
