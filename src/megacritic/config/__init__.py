"""Configuration: the schema and its pure checks (:mod:`.schema`), named models (:mod:`.presets`), and
:func:`load_config` (:mod:`.load`: defaults < base < YAML < overrides, then ``model.path``'s config.json)."""

from megacritic.config.presets import TINY_MODEL, TINY_MODEL_OVERRIDES, tiny_model
from megacritic.config.schema import (  # noqa: F401  (the public names of the package)
    ARCHITECTURE_DEFAULTS, ATTENTION_IMPLS, DENSE_MODEL_TYPES, DTYPES, LLAMA3_ROPE_CONSTANTS, LOSS_AGG_MODES,
    LR_DECAY_STYLES, MODEL_TYPES, MOE_MODEL_TYPES, RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS,
    REQUIRED_ARCHITECTURE, SCHEDULE_UNITS, VALUE_HEAD_INITS, AlgorithmConfig, ConfigError, CriticConfig, DataConfig,
    MegatronConfig, ModelConfig, OptimConfig, TrainerConfig, expert_ffn_size, head_dim, hf_family, is_moe,
    moe_layer_pattern, shared_expert_size, to_dict, validate, with_defaults)


def __getattr__(name: str):
    # load_config reads model.path's config.json through megacritic.hf, whose modules read the schema from
    # this package: it is bound on first use, so that they import in any order (no import cycle).
    if name == "load_config":
        from megacritic.config.load import load_config
        return load_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig", "MegatronConfig", "ModelConfig",
           "OptimConfig", "TINY_MODEL", "TINY_MODEL_OVERRIDES", "TrainerConfig", "load_config", "tiny_model",
           "to_dict", "validate"]
