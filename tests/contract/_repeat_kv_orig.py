import os
import pytest
from tests.contract.test_bus_contract import names, test_kv_get_put_watch as _t  # noqa: F401

N = int(os.environ.get("REP", "50"))

@pytest.mark.parametrize("i", range(N))
async def test_rep(bus, names, i):
    await _t(bus, names)
