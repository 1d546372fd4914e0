"""``load_config``: dataclass defaults < base mapping < YAML file < dotted overrides, then the Hugging Face
config of ``model.path``, then one validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megacritic.config.schema import ConfigError, CriticConfig, validate, with_defaults
from megacritic.hf.config import resolve


def merge(overrides: list[str] | None = None, path: str | None = None,
          base: Mapping | None = None) -> CriticConfig:
    """The layered settings as a CriticConfig, before model.path is read and before validation."""
    layers = [OmegaConf.structured(CriticConfig)]
    try:
        if base is not None:
            layers.append(OmegaConf.create(dict(base)))
        if path is not None:
            layers.append(OmegaConf.load(path))
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"override {bad[0]!r} is not of the form dotted.key=value")
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(OmegaConf.merge(*layers))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f"{key}: " if key else ""
        raise ConfigError(f"{where}{exc.msg if hasattr(exc, 'msg') else exc}") from None
    except FileNotFoundError as exc:
        raise ConfigError(f"--config file not found: {path}") from exc


def complete(config: CriticConfig) -> CriticConfig:
    """``config`` with its model resolved, as a new config, and validated: with model.path, config.json
    defines the architecture (a new ModelConfig); unset architecture fields then take their defaults."""
    model = resolve(config.model) if config.model.path is not None else config.model
    config = dataclasses.replace(config, model=with_defaults(model))
    validate(config)
    return config


def load_config(overrides: list[str] | None = None, path: str | None = None,
                base: Mapping | None = None) -> CriticConfig:
    """Defaults < ``base`` (e.g. the config dict saved in a checkpoint) < YAML file at ``path`` < dotted
    ``overrides`` (``key=value``), then model.path's config.json, then one validation (:func:`complete`).
    Nothing is mutated; the ``megacritic train`` settings (data.*, algorithm.*, trainer.*) are carried,
    not checked."""
    return complete(merge(overrides, path, base))
