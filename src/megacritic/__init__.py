"""megacritic: the PPO critic (value function) for LLMs on Megatron-Core.

The public names are imported on first use, so the pure modules (``megacritic.losses``,
``megacritic.advantages``, ``megacritic.config`` ...) import without Megatron-Core.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_PUBLIC = {
    "BatchError": "megacritic.data.rollouts",
    "ConfigError": "megacritic.config",
    "CriticConfig": "megacritic.config",
    "load_config": "megacritic.config.load",
    "MegatronPPOCritic": "megacritic.critic",
    "CriticWorker": "megacritic.worker",
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'megacritic' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
