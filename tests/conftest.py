"""Shared fixtures: a real nats-server per session, and a bus per test over both buses."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.nats_fixtures import nats_bus, nats_server  # noqa: E402,F401


@pytest.fixture(params=["memory", "nats"])
async def bus(request):
    """A connected bus of each kind; the contract suite runs once per kind."""
    if request.param == "memory":
        from rollart.bus.memory import MemoryBus

        b = MemoryBus()
    else:
        from rollart.bus.nats import NatsBus

        server = request.getfixturevalue("nats_server")
        b = NatsBus(server.url)
    await b.connect()
    try:
        yield b
    finally:
        await b.close()
