"""megacritic inside verl.

- :mod:`.config`: verl's critic section as megacritic settings (pure; no verl import);
- :mod:`.config_classes`: ``MegacriticCriticConfig``, the one override that selects megacritic
  (``critic._target_=megacritic.integrations.verl.MegacriticCriticConfig``), and the engine config it builds;
- :mod:`.engine`: the engine verl's own ``TrainingWorker`` runs (``EngineRegistry``, backend ``megacritic``),
  registered by :mod:`.plugin`, the ``verl.plugins`` entry point, when verl loads its engines;
- :mod:`.legacy`: a worker class of its own for verl <= 0.8's critic interface (:func:`critic_worker_cls`).

Names that need verl (the config classes, the legacy worker) load on first use, so that the config mapping
and megacritic itself work without verl.
"""

from megacritic.integrations.verl.config import (
    config_from_verl,
    critic_config_from_verl,
    verl_leaves,
    verl_rule,
)

_LAZY = {"MegacriticCriticConfig": "config_classes", "MegacriticEngineConfig": "config_classes",
         "critic_worker_cls": "legacy", "VERL_INSTALL_HINT": "legacy"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["config_from_verl", "critic_config_from_verl", "verl_leaves", "verl_rule", *_LAZY]
