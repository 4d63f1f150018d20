"""Config: msgspec Structs with documented fields, loaded from YAML with clear errors.

Modules: :mod:`~rollart.config.schema` (``RunConfig`` and the checks across sections) over the
sections (:mod:`~rollart.config.deploy`, :mod:`~rollart.config.pipeline`,
:mod:`~rollart.config.trainer`, :mod:`~rollart.config.nats`, :mod:`~rollart.config.placement`, :mod:`~rollart.config.tracing`, :mod:`~rollart.config.sandbox`),
all built on :mod:`~rollart.config.base`; :mod:`~rollart.config.loader` reads YAML and explains
errors; :mod:`~rollart.config.doc` writes ``rollart config --doc``. :mod:`~rollart.config.urls`
is a leaf the bus imports too. Imports go down: ``rollart.config`` may use
:mod:`rollart.messages`, :mod:`rollart.envs.actions` and :mod:`rollart.errors`, never
:mod:`rollart.bus`.
"""

from rollart.config.loader import ConfigError, convert, describe, load, load_yaml
from rollart.config.deploy import ActorConfig, HandlerConfig, NodeConfig
from rollart.config.nats import NatsConfig, NatsTlsConfig
from rollart.config.pipeline import (
    EnvConfig,
    ModelConfig,
    ProxyConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    TinyModelConfig,
)
from rollart.config.sandbox import SandboxConfig
from rollart.config.schema import RunConfig, nats_settings
from rollart.config.trainer import TrainerConfig
from rollart.config.tracing import TelemetryConfig, TracingConfig

__all__ = ["ActorConfig", "ConfigError", "EnvConfig", "HandlerConfig", "ModelConfig",
           "NatsConfig", "NatsTlsConfig", "NodeConfig", "ProxyConfig", "RewardConfig", "SandboxConfig",
           "RolloutConfig", "RunConfig", "SamplingConfig", "TelemetryConfig", "TinyModelConfig", "TracingConfig",
           "TrainerConfig", "convert", "describe", "load", "load_yaml", "nats_settings"]
