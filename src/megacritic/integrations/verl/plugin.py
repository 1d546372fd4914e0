"""The ``verl.plugins`` entry point of the megacritic distribution (``import verl`` loads it in the driver and
in every Ray worker). It registers the megacritic engine with verl's ``EngineRegistry`` once verl's engine
base module is imported, not before: loading the plugin imports neither verl's engines nor Megatron nor
torch.distributed (verl imports its engines only where a TrainingWorker is built, and megacritic builds
its model only when verl initialises the engine).

verl swallows an exception raised while it loads a plugin (logged at debug level), so a failed registration
would surface later as verl's "Unknown backend: megacritic"; :func:`register` raises from inside the import
of verl's engine base instead, naming the cause.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_BASE = "verl.workers.engine.base"


def register() -> None:
    """Define and register the engine (idempotent). Needs verl's engine base module."""
    import megacritic.integrations.verl.engine  # noqa: F401  (its import registers the class)


class _AfterBaseImport(importlib.abc.MetaPathFinder):
    """Runs :func:`register` right after verl's engine base module has been executed (a post-import hook:
    the module's own loader runs, then the registration)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _BASE:
            return None
        sys.meta_path.remove(self)  # find the real spec with the other finders, once
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            sys.modules[fullname] = module  # the engine module imports it by name
            register()

        spec.loader.exec_module = exec_then_register
        return spec


if _BASE in sys.modules:
    register()
elif not any(isinstance(finder, _AfterBaseImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AfterBaseImport())
