"""megacritic: the PPO critic (value function) for LLMs on Megatron-Core."""

from megacritic.batch import BatchError
from megacritic.config import ConfigError, CriticConfig, load_config
from megacritic.critic import MegatronPPOCritic
from megacritic.worker import CriticWorker

__all__ = ["BatchError", "ConfigError", "CriticConfig", "CriticWorker", "MegatronPPOCritic", "load_config"]
__version__ = "0.1.0"
