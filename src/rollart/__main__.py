"""``python -m rollart`` is the ``rollart`` command."""

from rollart.cli import main

raise SystemExit(main())
