"""megacritic: the PPO critic (value function) for LLMs on Megatron-Core."""

import warnings

# Megatron-Core announces at import that Transformer Engine and Apex are missing; megacritic does not use
# them (its attention, norm and optimizer paths are chosen for that), so the notices only mislead.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")

from megacritic.data.rollouts import BatchError  # noqa: E402
from megacritic.config import ConfigError, CriticConfig, load_config  # noqa: E402
from megacritic.critic import MegatronPPOCritic  # noqa: E402
from megacritic.worker import CriticWorker  # noqa: E402

__all__ = ["BatchError", "ConfigError", "CriticConfig", "CriticWorker", "MegatronPPOCritic", "load_config"]
__version__ = "0.1.0"
