"""The application layer: the ``rollart`` command and its subcommands, the entry point of
``python -m rollart.node``, one-host launch (:mod:`rollart.app.launch`,
:mod:`rollart.app.local_nodes`) and the operator commands (top, tap, nodes, report, secure,
cluster).

It sits above every library package (actors, bus, config, engines, envs, node, telemetry,
security, deploy) and imports them; none of them imports it.
"""
