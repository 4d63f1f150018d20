"""Sandboxes for the tests here: a real bubblewrap sandbox per test (skipped, with the
reason, where bubblewrap is missing; ``.ci/run`` installs it and requires it). Other test
packages that need a sandbox import ``needs_bwrap`` from here."""

from __future__ import annotations

import os
import shutil

import pytest

from rollart import sandbox
from rollart.config.sandbox import SandboxConfig

NO_BWRAP = "bubblewrap ('bwrap') is not installed: apt-get install bubblewrap (.ci/run does, as root)"
MISSING = shutil.which("bwrap") is None and os.environ.get("ROLLART_REQUIRE_SANDBOX") != "1"
"""Skip for want of bubblewrap, except where ``ROLLART_REQUIRE_SANDBOX=1`` (``.ci/run``): there
the tests run and fail, saying that it is missing."""
needs_bwrap = pytest.mark.skipif(MISSING, reason=NO_BWRAP)

SMALL = SandboxConfig(warm=0, timeout_s=10, cpu_s=5, memory_bytes=512 << 20, processes=32,
                      file_bytes=4 << 20, workspace_bytes=16 << 20, max_output_bytes=8 << 10)


@pytest.fixture
def sb():
    if MISSING:
        pytest.skip(NO_BWRAP)
    box = sandbox.start(SMALL)
    try:
        yield box
    finally:
        box.close()
