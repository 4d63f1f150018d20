"""Error types raised on both sides of a layer boundary.

A leaf (imports nothing of rollart): :class:`ConfigError` is raised by :mod:`rollart.config`
when it loads a config and by layers below it that check one (:mod:`rollart.envs.check`
constructs the configured envs), so neither has to import the other for it.
"""


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and what is allowed."""


class TrainStepFailed(RuntimeError):
    """A training step could not be taken for a reason outside its batch (a trainer rank died
    or hung): nothing of the step was applied, and the trainer stops the run with the message."""
