"""Credentials and least-privilege NATS permissions for multi-host runs.

- :mod:`rollart.security.permissions`: each role's NATS permissions, derived from the
  subject table (:data:`rollart.messages.SUBJECTS`), and the nats-server config that
  grants them (pure functions; no third-party imports).
- :mod:`rollart.security.init`: ``rollart secure init``: a CA, a server certificate, one
  password per role and the server config (needs ``pip install 'rollart[secure]'``).
- :mod:`rollart.app.secure`: the ``rollart secure`` commands.
"""

from rollart.security.permissions import ROLES, role_permissions, server_config

__all__ = ["ROLES", "role_permissions", "server_config"]
