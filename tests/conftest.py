"""Shared fixtures: a real nats-server per session, and a bus per test over both buses."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.nats_fixtures import nats_bus, nats_server  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """Spread the tests marked ``slow`` (learning runs, kills, hosts: 10-100 s each, several
    processes each) evenly through the run, the rest between them in their order: pytest-xdist's
    workers then run about one slow test each at a time. In file order they cluster (faults,
    hosts), so three ran side by side on two cores and each took 2-3x as long (a run that put
    them all first took 13 min 16 s against 12 min 05 s in random order). ``-p randomly``
    shuffles before this hook (its wrapper runs first): the slow tests are then spread over
    its shuffled order, each part in the order it chose."""
    slow = [it for it in items if it.get_closest_marker("slow") is not None]
    if not slow or len(slow) == len(items):
        return
    rest = [it for it in items if it.get_closest_marker("slow") is None]
    every = len(items) / len(slow)
    out, k = [], 0
    for it in rest:
        while k < len(slow) and len(out) >= k * every:
            out.append(slow[k])
            k += 1
        out.append(it)
    out.extend(slow[k:])
    items[:] = out


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny Qwen3-style model and tokenizer built locally once per session."""
    from rollart.engines.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture
async def memory_bus_only():
    """A MemoryBus, for tests whose point is not the transport."""
    from rollart.bus.memory import MemoryBus

    b = MemoryBus()
    await b.connect()
    try:
        yield b
    finally:
        await b.close()


try:  # transformers prints a progress bar per model load
    from transformers.utils import logging as _hf_logging

    _hf_logging.disable_progress_bar()
except ImportError:
    pass
