"""Configuration: the schema and its pure checks (:mod:`.schema`) and named models (:mod:`.presets`).

:func:`megacritic.load_config` (:mod:`.load`: defaults < base < YAML < overrides, then ``model.path``'s
config.json) reads files through :mod:`megacritic.hf`, whose modules use the schema: it is not imported
here, so that the package imports nothing that imports it back."""

from megacritic.config.presets import TINY_MODEL, TINY_MODEL_OVERRIDES, tiny_model
from megacritic.config.schema import (  # noqa: F401  (the public names of the package)
    ARCHITECTURE_DEFAULTS, ATTENTION_IMPLS, DENSE_MODEL_TYPES, DTYPES, LLAMA3_ROPE_CONSTANTS, LOSS_AGG_MODES,
    LR_DECAY_STYLES, MODEL_TYPES, MOE_MODEL_TYPES, RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS,
    REQUIRED_ARCHITECTURE, SCHEDULE_UNITS, VALUE_HEAD_INITS, AlgorithmConfig, ConfigError, CriticConfig, DataConfig,
    MegatronConfig, ModelConfig, OptimConfig, TrainerConfig, expert_ffn_size, head_dim, hf_family, is_moe,
    moe_layer_pattern, shared_expert_size, to_dict, validate, with_defaults)


__all__ = ["AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig", "MegatronConfig", "ModelConfig",
           "OptimConfig", "TINY_MODEL", "TINY_MODEL_OVERRIDES", "TrainerConfig", "tiny_model",
           "to_dict", "validate"]
