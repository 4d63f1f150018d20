"""An env module whose import fails: it needs a package that is not installed."""

import rollart_test_package_that_is_not_installed  # noqa: F401


class Env:
    instruction = "never built"
