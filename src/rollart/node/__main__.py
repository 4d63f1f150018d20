"""``python -m rollart.node``: the entry point, :func:`rollart.app.node.main`."""

from rollart.app.node import main

raise SystemExit(main())
