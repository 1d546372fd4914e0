"""Tests of megacritic.config: loading (defaults < YAML < overrides) and validate (the layout checks that need
the world size: tests/test_parallel.py).

Every failure must be a ConfigError whose message names the dotted key at fault.
"""

from __future__ import annotations

import pytest

from megacritic.config import ConfigError, CriticConfig, load_config, validate


def _raises_naming(key: str, overrides=None, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, path)
    message = str(info.value)
    assert key in message, f"ConfigError does not name {key!r}: {message!r}"
    return message


# --------------------------------------------------------------------------------------------- loading


def test_defaults_load_and_validate():
    config = load_config()
    assert isinstance(config, CriticConfig)
    validate(config)  # a loaded config validates again without error
    # nothing but the dataclass defaults (not pinned here: they may be retuned)
    assert config == CriticConfig()
    assert load_config([]) == config


def test_yaml_file_and_overrides_precedence(tmp_path):
    path = tmp_path / "critic.yaml"
    path.write_text(
        "ppo_epochs: 3\n"
        "cliprange_value: 0.2\n"
        "optim:\n"
        "  lr: 2.0e-5\n"
        "  lr_decay_style: cosine\n"
        "megatron:\n"
        "  tensor_model_parallel_size: 2\n"
        "model:\n"  # pinned so that TP=2 stays valid whatever the defaults become
        "  hidden_size: 64\n"
        "  intermediate_size: 128\n"
        "  num_attention_heads: 4\n"
        "  num_key_value_heads: 2\n"
    )
    # file overrides defaults
    config = load_config(None, str(path))
    assert config.ppo_epochs == 3
    assert config.cliprange_value == pytest.approx(0.2)
    assert config.optim.lr == pytest.approx(2e-5)
    assert config.optim.lr_decay_style == "cosine"
    assert config.megatron.tensor_model_parallel_size == 2
    assert config.ppo_mini_batch_size == CriticConfig().ppo_mini_batch_size  # untouched default survives

    # command-line overrides override the file
    config = load_config(["ppo_epochs=5", "optim.lr=3e-5", "megatron.tensor_model_parallel_size=1"], str(path))
    assert config.ppo_epochs == 5
    assert config.optim.lr == pytest.approx(3e-5)
    assert config.megatron.tensor_model_parallel_size == 1
    assert config.cliprange_value == pytest.approx(0.2)  # from the file, not overridden
    assert config.optim.lr_decay_style == "cosine"


def test_yaml_file_is_validated(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  lr_decay_style: exponential\n")
    _raises_naming("optim.lr_decay_style", None, str(path))


@pytest.mark.parametrize("override, key", [
    ("bogus=1", "bogus"),
    ("model.bogus_size=1", "model.bogus_size"),
    ("megatron.tensor_parallel_size=2", "megatron.tensor_parallel_size"),
])
def test_unknown_key(override, key):
    _raises_naming(key, [override])


@pytest.mark.parametrize("override, key", [
    ("ppo_epochs=abc", "ppo_epochs"),
    ("shuffle=maybe", "shuffle"),
    ("optim.lr=fast", "optim.lr"),
    ("model.num_hidden_layers=1.5", "model.num_hidden_layers"),
])
def test_wrong_type(override, key):
    _raises_naming(key, [override])


def test_override_without_equals():
    message = _raises_naming("ppo_epochs", ["ppo_epochs"])
    assert "=" in message


def test_missing_config_file(tmp_path):
    missing = tmp_path / "does_not_exist.yaml"
    message = _raises_naming(str(missing), None, str(missing))
    assert "--config" in message


# ------------------------------------------------------------------------------------ invalid settings

# A small, valid baseline pinned here so the cases below do not depend on the current defaults;
# each case's own overrides come after it and win.
BASE = [
    "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
    "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.max_position_embeddings=256",
    "data.prompt_length=[4,16]", "data.response_length=[4,32]", "data.rollouts_per_step=64",
    "ppo_mini_batch_size=16", "ppo_micro_batch_size_per_gpu=4", "optim.lr=1e-5", "optim.min_lr=0",
]


def test_base_is_valid():
    config = load_config(BASE)
    assert config.model.num_attention_heads == 4


def test_later_override_wins():
    assert load_config(BASE + ["model.num_hidden_layers=4"]).model.num_hidden_layers == 4

INVALID = [
    # (overrides, dotted key the message must name)
    pytest.param(["megatron.tensor_model_parallel_size=3"],
                 "megatron.tensor_model_parallel_size", id="tp-not-dividing-heads"),
    pytest.param(["model.num_key_value_heads=1", "megatron.tensor_model_parallel_size=2"],
                 "megatron.tensor_model_parallel_size", id="tp-not-dividing-kv-heads"),
    pytest.param(["model.num_hidden_layers=3", "megatron.pipeline_model_parallel_size=2"],
                 "megatron.pipeline_model_parallel_size", id="pp-not-dividing-layers"),
    pytest.param(["model.num_hidden_layers=2", "megatron.pipeline_model_parallel_size=2",
                  "megatron.virtual_pipeline_model_parallel_size=2"],
                 "megatron.virtual_pipeline_model_parallel_size", id="pp-x-vpp-not-dividing-layers"),
    pytest.param(["model.num_hidden_layers=4", "megatron.virtual_pipeline_model_parallel_size=2"],
                 "megatron.virtual_pipeline_model_parallel_size", id="vpp-with-pp1"),
    pytest.param(["use_dynamic_bsz=true"],
                 "ppo_max_token_len_per_gpu", id="dynamic-bsz-without-token-budget"),
    pytest.param(["shuffle=true", "data_loader_seed=null"],
                 "data_loader_seed", id="shuffle-without-seed"),
    pytest.param(["cliprange_value=0"], "cliprange_value", id="cliprange-value-zero"),
    pytest.param(["loss_agg_mode=sum"], "loss_agg_mode", id="bad-loss-agg-mode"),
    pytest.param(["optim.lr_decay_style=exponential"], "optim.lr_decay_style", id="bad-lr-decay-style"),
    pytest.param(["optim.lr=1e-5", "optim.min_lr=1e-4"], "optim.min_lr", id="min-lr-above-lr"),
    pytest.param(["optim.lr_warmup_steps_ratio=2"], "optim.lr_warmup_steps_ratio", id="warmup-ratio-above-1"),
    pytest.param(["optim.clip_grad=-1"], "optim.clip_grad", id="negative-clip-grad"),
    pytest.param(["megatron.context_parallel_size=2", "model.use_remove_padding=false"],
                 "megatron.context_parallel_size", id="context-parallel-without-packing"),
    pytest.param(["megatron.context_parallel_size=0"], "megatron.context_parallel_size", id="context-parallel-zero"),
    pytest.param(["megatron.context_parallel_size=2", "model.num_experts=4", "model.num_experts_per_tok=2",
                  "model.moe_intermediate_size=32"], "megatron.context_parallel_size", id="context-parallel-with-moe"),
    pytest.param(["model.path=/tmp/some-hf-model"], "model.path", id="model-path-unsupported"),
    pytest.param(["trainer.save_every=-1"], "trainer.save_every", id="negative-save-every"),
    pytest.param(["data.rollouts_per_step=24", "ppo_mini_batch_size=16"],
                 "data.rollouts_per_step", id="rollouts-not-multiple-of-mini-batch"),
    pytest.param(["model.max_position_embeddings=32", "data.prompt_length=[4,16]",
                  "data.response_length=[4,32]"],
                 "data.response_length", id="sequence-longer-than-positions"),
    pytest.param(["model.num_attention_heads=4", "model.num_key_value_heads=3"],
                 "model.num_key_value_heads", id="kv-heads-not-dividing-heads"),
]


@pytest.mark.parametrize("overrides, key", INVALID)
def test_invalid_setting(overrides, key):
    message = _raises_naming(key, BASE + overrides)
    # validate() reports "<dotted.key>=<value>: <fix>": the key at fault comes first
    assert message.startswith(f"{key}="), message


def test_validate_checks_a_config_built_in_code():
    config = CriticConfig()
    config.loss_agg_mode = "nope"
    with pytest.raises(ConfigError, match="loss_agg_mode"):
        validate(config)


def test_context_parallel_without_packing_names_the_fix():
    message = _raises_naming("model.use_remove_padding",
                             BASE + ["megatron.context_parallel_size=2", "model.use_remove_padding=false"])
    assert "use_remove_padding=true" in message
