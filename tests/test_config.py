"""Tests of megacritic.config: loading (defaults < base < YAML < overrides) and validate (the layout checks that
need the world size: tests/test_parallel.py).

Every failure must be a ConfigError whose message names the dotted key at fault.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from megacritic.config import TINY_MODEL, TINY_MODEL_OVERRIDES, ConfigError, CriticConfig, tiny_model, validate
from megacritic.config.load import load_config
from megacritic.parallel import ParallelLayout

TINY_BASE = {"model": dict(TINY_MODEL)}


def _raises_naming(key: str, overrides=None, path=None, base=TINY_BASE) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, path, base)
    message = str(info.value)
    assert key in message, f"ConfigError does not name {key!r}: {message!r}"
    return message


# --------------------------------------------------------------------------------------------- loading


def test_defaults_with_the_tiny_preset_load_and_validate():
    config = load_config(TINY_MODEL_OVERRIDES)
    assert isinstance(config, CriticConfig)
    validate(config)  # a loaded config validates again without error
    # nothing but the dataclass defaults and the preset (not pinned here: they may be retuned)
    assert config == dataclasses.replace(CriticConfig(), model=tiny_model())
    assert load_config([], base=TINY_BASE) == config
    assert load_config(base=TINY_BASE) == config


def test_a_model_needs_a_path_or_its_whole_architecture():
    message = _raises_naming("model.vocab_size", ["model.hidden_size=64"], base=None)
    for key in ("model.intermediate_size", "model.num_hidden_layers", "model.num_attention_heads",
                "model.num_key_value_heads", "model.max_position_embeddings", "model.path"):
        assert key in message, message
    assert "model.hidden_size," not in message  # it is set
    _raises_naming("model.vocab_size", base=None)


def test_set_means_set_and_unset_fields_take_their_documented_defaults():
    # the tiny preset's own values, set explicitly, are kept; unset ones take ARCHITECTURE_DEFAULTS
    config = load_config([*TINY_MODEL_OVERRIDES, "model.attention_bias=false", "model.rope_theta=500000"])
    assert (config.model.attention_bias, config.model.rope_theta) == (False, 500000.0)
    assert (config.model.num_experts_per_tok, config.model.decoder_sparse_step, config.model.mlp_only_layers) == \
        (2, 1, [])
    # a hand-built config with a field left unset is refused by name, not guessed
    config = CriticConfig(model=dataclasses.replace(tiny_model(), rms_norm_eps=None))
    with pytest.raises(ConfigError, match="model.rms_norm_eps"):
        validate(config)


def test_tiny_preset_is_read_only_and_copied():
    with pytest.raises(TypeError):
        TINY_MODEL["hidden_size"] = 8
    a, b = tiny_model(), tiny_model(hidden_size=32)
    a.mlp_only_layers.append(1)
    assert b.hidden_size == 32 and tiny_model().mlp_only_layers == [] and b.num_hidden_layers == 2


def test_base_mapping_is_layered_under_the_file_and_the_overrides(tmp_path):
    base = {"ppo_epochs": 2, "cliprange_value": 0.3, "optim": {"lr": 1e-4}, "model": dict(TINY_MODEL)}
    path = tmp_path / "critic.yaml"
    path.write_text("ppo_epochs: 3\n")
    config = load_config(["optim.lr=3e-5"], str(path), base)
    assert (config.ppo_epochs, config.cliprange_value, config.optim.lr) == (3, 0.3, 3e-5)
    assert base == {"ppo_epochs": 2, "cliprange_value": 0.3, "optim": {"lr": 1e-4}, "model": dict(TINY_MODEL)}
    # a saved config (to_dict) loads back as itself, without a temporary file
    saved = dataclasses.asdict(config)
    assert load_config(base=saved) == config
    _raises_naming("optim.bogus", base={**saved, "optim": {**saved["optim"], "bogus": 1}})


def test_the_library_does_not_read_settings_only_the_cli_reads():
    # issue 15: a mini-batch of 6 does not divide the CLI's data.rollouts_per_step default (64); no matter
    config = load_config([*TINY_MODEL_OVERRIDES, "ppo_mini_batch_size=6", "ppo_micro_batch_size_per_gpu=3"])
    layout = ParallelLayout.from_config(config.megatron, 2)
    layout.check_batch_sizes(config)
    assert (config.ppo_mini_batch_size, layout.dp) == (6, 2)
    assert config.data.rollouts_per_step == 64  # carried, not checked


# Valid library settings (each a choice of a few values) and CLI-only settings that would be refused by
# `megacritic train` (checked by the train loop, never by load_config).
LIBRARY = {
    "ppo_mini_batch_size": [1, 6, 12, 16], "ppo_micro_batch_size_per_gpu": [1, 2, 3, 6], "ppo_epochs": [1, 3],
    "shuffle": ["true", "false"], "cliprange_value": [0.1, 0.5], "loss_agg_mode": ["token-mean", "seq-mean-token-sum"],
    "model.num_hidden_layers": [1, 2, 4], "model.max_position_embeddings": [8, 256],
    "optim.lr": [1e-5, 1e-3], "optim.lr_decay_style": ["constant", "cosine"], "optim.total_training_steps": [-1, 7],
    "optim.schedule_unit": ["step", "call"], "megatron.timing_level": [0, 1, 2],
}
CLI_ONLY = {
    "data.rollouts_per_step": [0, 17, 64], "data.prompt_length": ["[0,4]", "[200,300]"],
    "data.response_length": ["[5,4]", "[3]"], "data.path": ["/nonexistent/rollouts.jsonl"],
    "trainer.steps": [0, -1], "trainer.save_every": [-1], "trainer.max_consecutive_skips": [0],
    "trainer.profile_steps": ["[0]", "[99999]"], "algorithm.gamma": [-0.1, 1.5], "algorithm.lam": [2.0],
}


@pytest.mark.parametrize("seed", range(40))
def test_every_valid_library_config_loads_whatever_the_cli_only_settings(seed):
    rng = random.Random(seed)
    library = [f"{k}={rng.choice(v)}" for k, v in LIBRARY.items() if rng.random() < 0.6]
    if any(o.startswith("optim.lr_decay_style=cosine") for o in library):
        library.append("optim.total_training_steps=7")  # a decaying schedule needs its length
    if not any(o.startswith("ppo_micro_batch_size_per_gpu=") for o in library):
        library.append("ppo_micro_batch_size_per_gpu=1")
    cli = [f"{k}={rng.choice(v)}" for k, v in CLI_ONLY.items() if rng.random() < 0.5]
    alone = load_config([*TINY_MODEL_OVERRIDES, *library])
    with_cli = load_config([*TINY_MODEL_OVERRIDES, *library, *cli])
    assert dataclasses.replace(with_cli, data=alone.data, trainer=alone.trainer, algorithm=alone.algorithm) == alone


def test_validate_is_pure():
    # no I/O (neither model.path nor data.path is opened) and nothing changed
    config = CriticConfig(model=tiny_model(path="/nonexistent/model"))
    config.data.path = "/nonexistent/rollouts.jsonl"
    before = dataclasses.replace(config, model=dataclasses.replace(config.model))
    validate(config)
    assert config == before


@pytest.mark.parametrize("overrides, key", [
    (["optim.lr_decay_style=cosine"], "optim.total_training_steps"),
    (["optim.lr_decay_style=linear", "optim.schedule_unit=call"], "optim.total_training_steps"),
    (["optim.lr_warmup_steps=5"], "optim.total_training_steps"),
    (["optim.lr_warmup_steps_ratio=0.1"], "optim.total_training_steps"),
    (["optim.total_training_steps=0"], "optim.total_training_steps"),
    (["optim.total_training_steps=10", "optim.lr_warmup_steps=10"], "optim.lr_warmup_steps"),
    (["optim.total_training_steps=10", "optim.lr_warmup_steps_ratio=1.0"], "optim.lr_warmup_steps"),
])
def test_a_schedule_that_needs_its_length_names_it(overrides, key):
    message = _raises_naming(key, overrides)
    assert message.startswith(f"{key}="), message


def test_schedules_that_need_no_length_or_have_one_load():
    assert load_config(base=TINY_BASE).optim.total_training_steps == -1  # constant, no warm-up
    config = load_config(["optim.lr_decay_style=cosine", "optim.total_training_steps=100", "optim.lr_warmup_steps=10"],
                         base=TINY_BASE)
    assert config.optim.total_training_steps == 100


def test_yaml_file_and_overrides_precedence(tmp_path):
    path = tmp_path / "critic.yaml"
    path.write_text(
        "ppo_epochs: 3\n"
        "cliprange_value: 0.2\n"
        "optim:\n"
        "  lr: 2.0e-5\n"
        "  lr_decay_style: cosine\n"
        "  total_training_steps: 100\n"  # a decaying schedule needs its length
        "megatron:\n"
        "  tensor_model_parallel_size: 2\n"
        "model:\n"  # pinned so that TP=2 stays valid whatever the preset becomes
        "  hidden_size: 64\n"
        "  intermediate_size: 128\n"
        "  num_attention_heads: 4\n"
        "  num_key_value_heads: 2\n"
    )
    # file overrides defaults
    config = load_config(None, str(path), TINY_BASE)
    assert config.ppo_epochs == 3
    assert config.cliprange_value == pytest.approx(0.2)
    assert config.optim.lr == pytest.approx(2e-5)
    assert config.optim.lr_decay_style == "cosine"
    assert config.megatron.tensor_model_parallel_size == 2
    assert config.ppo_mini_batch_size == CriticConfig().ppo_mini_batch_size  # untouched default survives

    # command-line overrides override the file
    config = load_config(["ppo_epochs=5", "optim.lr=3e-5", "megatron.tensor_model_parallel_size=1"], str(path),
                         TINY_BASE)
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
    *TINY_MODEL_OVERRIDES, "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
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
    pytest.param(["model.num_attention_heads=4", "model.num_key_value_heads=3"],
                 "model.num_key_value_heads", id="kv-heads-not-dividing-heads"),
]


@pytest.mark.parametrize("overrides, key", INVALID)
def test_invalid_setting(overrides, key):
    message = _raises_naming(key, BASE + overrides)
    # validate() reports "<dotted.key>=<value>: <fix>": the key at fault comes first
    assert message.startswith(f"{key}="), message


def test_validate_checks_a_config_built_in_code():
    config = CriticConfig(model=tiny_model())
    validate(config)
    config.loss_agg_mode = "nope"
    with pytest.raises(ConfigError, match="loss_agg_mode"):
        validate(config)


def test_context_parallel_without_packing_names_the_fix():
    message = _raises_naming("model.use_remove_padding",
                             BASE + ["megatron.context_parallel_size=2", "model.use_remove_padding=false"])
    assert "use_remove_padding=true" in message


# ------------------------------------------------------------------------------------------ import graph


def _imports(file) -> set[str]:
    """Every module ``file`` imports, at module level or inside functions (relative imports resolved)."""
    import ast
    from pathlib import Path

    import megacritic
    root = Path(megacritic.__file__).parent
    parts = list(Path(file).relative_to(root.parent).with_suffix("").parts)
    package = parts[:-1]  # a module's package; a package's __init__ is its own
    out = set()
    for n in ast.walk(ast.parse(Path(file).read_text())):
        if isinstance(n, ast.ImportFrom):
            module = n.module or ""
            if n.level:
                base = package[: len(package) - (n.level - 1)]
                module = ".".join(base + ([module] if module else []))
            out |= {module} | {f"{module}.{a.name}" for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
    return out


def _import_graph() -> dict[str, set[str]]:
    """megacritic module -> the megacritic modules it imports, wherever the import statement stands (module
    level or in a function: each can run); importing a.b.c also runs a.b's __init__."""
    from pathlib import Path

    import megacritic
    root = Path(megacritic.__file__).parent
    modules = {}
    for file in root.rglob("*.py"):
        parts = file.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    graph = {}
    for name, file in modules.items():
        targets = {t for t in _imports(file) if t.startswith("megacritic")}
        packages = {".".join(t.split(".")[:i]) for t in targets for i in range(2, t.count(".") + 2)}
        graph[name] = {t for t in packages if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def test_only_the_layout_and_compat_import_megatrons_parallel_state():
    # Process groups and ranks are read from Megatron once (megacritic.parallel) and handed down.
    from pathlib import Path

    import megacritic
    root = Path(megacritic.__file__).parent
    users = {str(f.relative_to(root)) for f in root.rglob("*.py")
             if any(t.startswith("megatron.core.parallel_state") or t == "megatron.core.parallel_state"
                    or t == "megatron.core.mpu" for t in _imports(f))}
    assert users and {u for u in users if u != "parallel.py" and not u.startswith("compat/")} == set(), users


def test_import_graph_has_no_cycle_and_the_schema_imports_nothing_of_ours():
    graph = _import_graph()
    assert graph["megacritic.config.schema"] == set()
    assert graph["megacritic.config.load"] >= {"megacritic.hf.config"}  # the one way from config to hf
    assert not any(t.startswith("megacritic.hf") for t in graph["megacritic.config"])
    done, path = set(), []

    def visit(module):
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module):] + [module])}"
        if module in done:
            return
        path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


@pytest.mark.parametrize("first", ["megacritic.model.weights", "megacritic.hf.config", "megacritic.config.load"])
def test_modules_around_the_config_import_in_any_order(first):
    # A fresh interpreter imports ``first`` before anything else of ours (the root package's __init__, which
    # imports the config first, is bypassed), then loads a config.
    import subprocess
    import sys
    from pathlib import Path

    import megacritic
    probe = (f"import importlib, sys, types; package = types.ModuleType('megacritic'); "
             f"package.__path__ = [{str(Path(megacritic.__file__).parent)!r}]; sys.modules['megacritic'] = package; "
             f"importlib.import_module({first!r}); from megacritic.config import TINY_MODEL_OVERRIDES; from megacritic.config.load import load_config; "
             f"print(load_config(list(TINY_MODEL_OVERRIDES)).model.hidden_size)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == "64", out.stderr[-2000:]
