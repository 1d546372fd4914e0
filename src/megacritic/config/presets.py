"""Named model architectures.

``TINY_MODEL`` is the embedded default critic: the seeded model ``megacritic init-hf`` writes (as a
Qwen2-style Hugging Face folder, which ``make train`` then trains), and the model of the tests and of
``megacritic train`` when neither ``model.path`` nor an architecture is given.
"""

from __future__ import annotations

from types import MappingProxyType

from megacritic.config.schema import ModelConfig, with_defaults

TINY_MODEL = MappingProxyType({
    "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "attention_bias": True, "qk_layernorm": False,
    "tie_word_embeddings": False,
})
"""The embedded tiny critic's architecture (model.* fields; read-only)."""

TINY_MODEL_OVERRIDES = tuple(f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"
                             for key, value in TINY_MODEL.items())
"""TINY_MODEL as dotted overrides, to put in front of others: ``load_config([*TINY_MODEL_OVERRIDES, ...])``."""


def tiny_model(**changes) -> ModelConfig:
    """A new, complete ModelConfig: TINY_MODEL with ``changes`` (any ModelConfig fields) applied, the other
    fields at their defaults (as load_config would give)."""
    return with_defaults(ModelConfig(**{**TINY_MODEL, **changes}))
