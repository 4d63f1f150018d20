"""Config: msgspec Structs with documented fields, loaded from YAML with clear errors."""

from rollart.config.loader import ConfigError, convert, describe, load, load_yaml
from rollart.config.schema import (
    ActorConfig,
    EnvConfig,
    HandlerConfig,
    ModelConfig,
    NodeConfig,
    ProxyConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    TinyModelConfig,
    TrainerConfig,
)

__all__ = ["ActorConfig", "ConfigError", "EnvConfig", "HandlerConfig", "ModelConfig",
           "NodeConfig", "ProxyConfig", "RewardConfig", "RolloutConfig", "RunConfig",
           "SamplingConfig", "TinyModelConfig", "TrainerConfig",
           "convert", "describe", "load", "load_yaml"]
