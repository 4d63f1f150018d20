"""Bring your own agent: envs of type ``agent:pkg.module:function``.

The EnvManager serves an OpenAI-compatible endpoint (:mod:`rollart.agents.endpoint`) and
runs the user's agent function with a base URL of its own per trajectory
(:mod:`rollart.actors.env.agent_loop`); every request becomes a turn of the trajectory, its
tokens recorded exactly as prompted and generated (:mod:`rollart.agents.conversation`).
Example agents: :mod:`rollart.agents.examples`.
"""

from rollart.envs.agent_type import AGENT_PREFIX, is_agent, resolve_agent

__all__ = ["AGENT_PREFIX", "is_agent", "resolve_agent"]
