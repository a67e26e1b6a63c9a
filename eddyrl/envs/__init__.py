"""Multi-turn environments and tools: the contract (`base`), the episode loop (`episode`), the
bundled calculator and sandboxed Python environments, and loading custom ones by dotted path."""

from ..plugins import load_reward_fn
from .base import (Action, EnvStats, Environment, EpisodeLimits, Observation, Reply,
                   ToolInfo)
from .config import EnvConfig
from .episode import Episode, EpisodeState, Transcript, Turn, run_episode
from .loading import load_environment

__all__ = ["Action", "EnvConfig", "EnvStats", "Environment", "Episode", "EpisodeLimits",
           "EpisodeState", "Observation", "Reply", "ToolInfo", "Transcript", "Turn",
           "load_environment", "load_reward_fn", "run_episode"]
