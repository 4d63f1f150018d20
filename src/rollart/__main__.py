"""``python -m rollart`` is the ``rollart`` command."""

from rollart.app.cli import main

raise SystemExit(main())
