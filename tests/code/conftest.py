"""Tests of rollart.code: every one runs real programs in bubblewrap sandboxes."""

from __future__ import annotations

import shutil

import pytest

from rollart import sandbox


def pytest_collection_modifyitems(config, items):
    if shutil.which("bwrap") is None:
        skip = pytest.mark.skip(reason="bubblewrap ('bwrap') is not installed: code tasks run "
                                       "in sandboxes (apt-get install bubblewrap)")
        for item in items:
            if "tests/code/" in str(item.fspath).replace("\\", "/"):
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def warm_pool():
    """The process's pool, warm before the first test and closed after the last."""
    sandbox.pool().start_warming()
    yield sandbox.pool()
    sandbox.shutdown()
