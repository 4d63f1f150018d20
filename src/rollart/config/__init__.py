"""Config: msgspec Structs with documented fields, loaded from YAML with clear errors."""

from rollart.config.loader import ConfigError, convert, describe, load, load_yaml
from rollart.config.schema import ActorConfig, HandlerConfig, NodeConfig, RunConfig

__all__ = ["ActorConfig", "ConfigError", "HandlerConfig", "NodeConfig", "RunConfig",
           "convert", "describe", "load", "load_yaml"]
