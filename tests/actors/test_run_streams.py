"""The run's streams are created even when the server is slow to answer: a JetStream API
call that times out on a single server (seen on a loaded 2-core CI host: ``ensure stream
ROLLART_<run>: timed out`` failed a whole training run) is asked again, while an error that
is not a timeout still fails at once."""

from __future__ import annotations

import pytest

from rollart import messages as m
from rollart.bus import BusError, BusTimeout
from rollart.node import ensure_run_streams
from tests.actors.sample_actors import new_run


class SlowServer:
    """The test's bus, but its first ``ensure_stream`` calls fail with ``error``."""

    def __init__(self, bus, error: Exception, times: int) -> None:
        self.bus, self.error, self.left, self.calls = bus, error, times, 0

    def __getattr__(self, name):
        return getattr(self.bus, name)

    async def ensure_stream(self, spec, **kw):
        self.calls += 1
        if self.left:
            self.left -= 1
            raise self.error
        return await self.bus.ensure_stream(spec, **kw)


async def test_a_stream_call_that_times_out_is_asked_again(bus, caplog):
    run = new_run()
    slow = SlowServer(bus, BusTimeout("ensure stream: timed out"), times=2)
    await ensure_run_streams(slow, run)
    assert slow.calls == 4, "two timeouts, then the events and work streams"
    for kind in ("events", "work"):
        assert await bus.stream_info(m.stream_name(run, kind)), kind
    assert "slow to answer" in caplog.text


async def test_an_error_that_is_not_a_timeout_fails_at_once(bus):
    slow = SlowServer(bus, BusError("ensure stream: permission denied"), times=1)
    with pytest.raises(BusError, match="permission denied"):
        await ensure_run_streams(slow, new_run())
    assert slow.calls == 1
