"""A complete PPO trainer for causal LMs built on the ppo_fast ops (``ppo-fast train``)."""

from .config import TrainerConfig
from .scoring import NonFiniteError, RewardError
from .trainer import PPOTrainer

__all__ = ["TrainerConfig", "PPOTrainer", "RewardError", "NonFiniteError"]
