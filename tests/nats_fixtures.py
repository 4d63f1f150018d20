"""Fixtures for a real nats-server; ``tests/conftest.py`` imports them.

``nats_server``: one embedded JetStream server per test session (its own temporary
store), stopped at the end. ``nats_bus``: a connected :class:`NatsBus` per test.
"""

from __future__ import annotations

import pytest

from rollart.bus.nats import NatsBus
from rollart.bus.server import EmbeddedServer


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = EmbeddedServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def nats_bus(nats_server):
    bus = NatsBus(nats_server.url, name="rollart-test")
    await bus.connect()
    try:
        yield bus
    finally:
        await bus.close()
