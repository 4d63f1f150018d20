"""Which hardware runs what: the ``pools:``, ``mapping:`` and ``route:`` sections of a run's
config (DESIGN.md §2, hardware-affinity mapping).

- ``pools``: the pools by name, each with a description and hardware tags.
- ``mapping``: the pool(s) serving each role (``generate: [big, small]``, ``env: cpu``).
- ``route``: rules that pick the generation pool of each turn; the first rule whose ``when``
  holds wins, a rule without ``when`` always holds (the default). No rule matching: the first
  pool of ``mapping.generate``.

Without ``pools`` a run has one pool per node (the node's ``--pool``) and every actor sends
its requests to its own pool, as before these sections existed.
"""

from __future__ import annotations

from typing import Any

from rollart.config.base import Base

POOLED_ROLES = ("env", "generate", "reward")
"""Roles whose work subjects carry a pool token: with ``pools`` declared each must be mapped."""


class PoolConfig(Base):
    description: str = ""
    """What the pool's hosts are (free text, shown by ``rollart nodes``)."""
    tags: list[str] = []
    """Hardware tags (``gpu``, ``prefill``, ``cpu``...): documentation for people and tools."""
    weight: float = 1.0
    """Share of the work of a role mapped to several pools (``mapping.env: [a, b]``): the
    scheduler sends each request to the live pool with the fewest of its trajectories still
    open per unit of weight (so a faster pool, whose work finishes sooner, also gets more)."""


class RouteWhen(Base):
    """Conditions of a route rule; all that are set must hold."""

    prompt_tokens_gt: int | None = None
    """The turn's prompt (the whole context so far) is longer than this many tokens."""
    prompt_tokens_le: int | None = None
    """The turn's prompt is at most this many tokens."""
    turn_gt: int | None = None
    """The turn number (1 = first) is greater than this."""
    turn_le: int | None = None
    """The turn number is at most this."""
    env: str | None = None
    """The trajectory's environment (a key of ``envs``)."""

    def holds(self, *, prompt_tokens: int, turn: int, env: str) -> bool:
        return ((self.prompt_tokens_gt is None or prompt_tokens > self.prompt_tokens_gt)
                and (self.prompt_tokens_le is None or prompt_tokens <= self.prompt_tokens_le)
                and (self.turn_gt is None or turn > self.turn_gt)
                and (self.turn_le is None or turn <= self.turn_le)
                and (self.env is None or env == self.env))


class RouteRule(Base):
    pool: str
    """The generation pool of a turn this rule matches (a key of ``pools``)."""
    when: RouteWhen | None = None
    """Conditions; none: the rule always matches (the default route)."""

    def describe(self) -> str:
        if self.when is None:
            return f"default -> {self.pool}"
        conds = [f"{k}={v}" for k in self.when.__struct_fields__
                 if (v := getattr(self.when, k)) is not None]
        return f"{', '.join(conds)} -> {self.pool}"


def mapped_pools(mapping: dict[str, str | list[str]], role: str) -> list[str]:
    """The pools ``mapping`` gives ``role`` (a single name or a list), in order."""
    v = mapping.get(role, [])
    return [v] if isinstance(v, str) else list(v)


def check_placement(pools: dict[str, PoolConfig], mapping: dict[str, str | list[str]],
                    route: list[RouteRule], envs: dict[str, Any], roles: set[str]) -> None:
    """Raise ValueError naming the key when the sections disagree: a route or mapping to an
    undeclared pool, a role mapped to no pool, a route to a pool that is not a generation pool,
    a route condition on an unknown env. ``roles``: the role names the config knows."""
    declared = ", ".join(repr(p) for p in pools) or "none"
    if not pools:
        if mapping:
            raise ValueError(f"mapping: needs pools: (declare the pools it names; declared: {declared})")
        if route:
            raise ValueError("route: needs pools: and mapping.generate (declare the pools first)")
        return
    for name, pool in pools.items():
        if not (isinstance(pool.weight, (int, float)) and pool.weight > 0):
            raise ValueError(f"pools.{name}.weight must be a number > 0 (got {pool.weight!r})")
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"pools.{name}: a pool name is one subject token "
                             f"(letters, digits, '_' or '-')")
    for role in mapping:
        if role not in roles:
            raise ValueError(f"mapping.{role}: unknown role; known: {', '.join(sorted(roles))}")
        got = mapped_pools(mapping, role)
        if not got:
            raise ValueError(f"mapping.{role}: maps the role to no pool; name at least one of {declared}")
        for p in got:
            if p not in pools:
                raise ValueError(f"mapping.{role}: pool {p!r} is not declared under pools: "
                                 f"(declared: {declared})")
    for role in POOLED_ROLES:
        if role not in mapping:
            raise ValueError(f"mapping.{role}: with pools: declared, every pooled role "
                             f"({', '.join(POOLED_ROLES)}) needs a pool; {role!r} has none")
    gen = mapped_pools(mapping, "generate")
    for i, rule in enumerate(route):
        if rule.pool not in pools:
            raise ValueError(f"route[{i}].pool: pool {rule.pool!r} is not declared under pools: "
                             f"(declared: {declared})")
        if rule.pool not in gen:
            raise ValueError(f"route[{i}].pool: pool {rule.pool!r} serves no generation "
                             f"(mapping.generate: {', '.join(gen)})")
        if rule.when is not None and rule.when.env is not None and rule.when.env not in envs:
            raise ValueError(f"route[{i}].when.env: {rule.when.env!r} is not a key of envs; "
                             f"allowed: {', '.join(repr(k) for k in envs)}")


class Router:
    """Picks the generation pool of each turn from ``route`` rules (first match wins)."""

    def __init__(self, rules: list[RouteRule], default_pool: str) -> None:
        self.rules = list(rules)
        self.default_pool = default_pool

    def pick(self, *, prompt_tokens: int, turn: int, env: str) -> tuple[str, int]:
        """``(pool, index of the rule that matched)``; index -1: no rule matched."""
        for i, rule in enumerate(self.rules):
            if rule.when is None or rule.when.holds(prompt_tokens=prompt_tokens, turn=turn, env=env):
                return rule.pool, i
        return self.default_pool, -1
