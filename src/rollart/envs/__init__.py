"""Environments: the text Env protocol, an async runner, a registry and built-in envs.

Nothing here imports a bus or torch.
"""

from rollart.envs.actions import ANSWER_PATTERN, parse_action
from rollart.envs.base import Env, ResetResult, StepResult
from rollart.envs.registry import BUILTIN_ENVS, make_env
from rollart.envs.runner import EnvError, EnvRunner, EnvTimeout

__all__ = [
    "ANSWER_PATTERN", "BUILTIN_ENVS", "Env", "EnvError", "EnvRunner", "EnvTimeout",
    "ResetResult", "StepResult", "make_env", "parse_action",
]
