"""The verl config classes that select megacritic as the critic's engine: one override on verl's command line,
``critic._target_=megacritic.integrations.verl.MegacriticCriticConfig``.

:class:`MegacriticCriticConfig` is verl's Megatron critic section (``McoreCriticConfig``: every key keeps
its meaning) plus ``megacritic``, megacritic's own settings (``+critic.megacritic.model.attention_impl=fa2``).
When verl instantiates it (in the driver, before any worker starts) it maps the whole section with
:func:`~megacritic.integrations.verl.config.config_from_verl` (a refused or unknown setting stops the job
there, by name) and replaces the section's engine config with a :class:`MegacriticEngineConfig`, whose
``strategy`` picks the plugin engine from verl's ``EngineRegistry`` and which carries megacritic's settings
to the workers. It also carries what verl's own Megatron critic drops on the way to its engine: the
critic's ``nccl_timeout`` (verl issue 7815), its training token budget ``ppo_max_token_len_per_gpu`` (the
V1 trainer hands the engine the inference budget instead, issue 7462), ``use_dynamic_bsz`` and
``ppo_micro_batch_size_per_gpu``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from verl.workers.config import McoreCriticConfig
from verl.workers.config.engine import EngineConfig

from megacritic.integrations.verl.config import config_from_verl, dotted, verl_leaves

BACKEND = "megacritic"  # the engine's name in verl's EngineRegistry (EngineConfig.strategy)


@dataclass
class MegacriticEngineConfig(EngineConfig):
    """What verl's TrainingWorker hands the megacritic engine (``critic.engine``).

    ``verl_settings``: megacritic overrides mapped from the critic section; ``megacritic_settings``: the
    user's own (``critic.megacritic``), applied after them. verl's EngineConfig fields are filled from the
    critic section so that the values verl's worker reads or injects agree with what megacritic runs."""

    strategy: str = BACKEND
    verl_settings: list = field(default_factory=list)
    megacritic_settings: list = field(default_factory=list)

    @classmethod
    def from_critic(cls, critic: "MegacriticCriticConfig", verl_settings, megacritic_settings):
        mg = critic.megatron
        return cls(param_offload=mg.param_offload, optimizer_offload=mg.optimizer_offload, dtype=mg.dtype,
                   seed=mg.seed, use_dynamic_bsz=critic.use_dynamic_bsz,
                   max_token_len_per_gpu=critic.ppo_max_token_len_per_gpu,
                   micro_batch_size_per_gpu=critic.ppo_micro_batch_size_per_gpu,
                   infer_max_token_len_per_gpu=critic.ppo_infer_max_token_len_per_gpu,
                   infer_micro_batch_size_per_gpu=critic.ppo_infer_micro_batch_size_per_gpu,
                   use_remove_padding=critic.model.use_remove_padding,
                   verl_settings=list(verl_settings), megacritic_settings=list(megacritic_settings))


@dataclass
class MegacriticCriticConfig(McoreCriticConfig):
    """verl's Megatron critic section, trained by megacritic (module doc). ``megacritic``: megacritic-only
    settings as a nested mapping (``+critic.megacritic.model.attention_impl=fa2`` on verl's command line);
    every key megacritic documents (``megacritic.config.schema``) may appear, after the mapped ones."""

    megacritic: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        section = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("megacritic", "engine")}
        self.engine = MegacriticEngineConfig.from_critic(self, config_from_verl(section), dotted(self.megacritic))


__all__ = ["BACKEND", "MegacriticCriticConfig", "MegacriticEngineConfig", "verl_leaves"]
