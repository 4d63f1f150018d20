import os, sys
import pytest
sys.path.insert(0, "/tmp/kvrep")
from tests.contract.test_bus_contract import names  # noqa: F401

N = int(os.environ.get("REP", "50"))

@pytest.mark.parametrize("i", range(N))
async def test_rep(nats_bus, i):
    import importlib, asyncio
    spec = importlib.util.spec_from_file_location("diag_mod", "/tmp/kvrep/diag_fn.py")
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    r = await mod.one(nats_bus, i)
    assert r is None, r
