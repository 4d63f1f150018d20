"""An env host's sandboxes in a process of their own (for the kill -9 test): holds the
process's pool as an EnvManager does, warm, lends one sandbox that runs a command that never
ends, prints ``ready`` and waits to be killed."""

from __future__ import annotations

import sys
import threading

from rollart import sandbox
from rollart.config import SandboxConfig


def main() -> None:
    pool = sandbox.hold(SandboxConfig(warm=int(sys.argv[1]) if len(sys.argv) > 1 else 2), warm=True)
    if not pool.wait_ready(timeout=60):
        sys.exit(f"no warm sandboxes within 60 s: {pool.snapshot()}")
    lent = pool.acquire()
    threading.Thread(target=lent.run, args=("sleep 600",), kwargs={"timeout": 600}, daemon=True).start()
    if not pool.wait_ready(timeout=60):  # the lent one replaced
        sys.exit(f"the pool was not refilled within 60 s: {pool.snapshot()}")
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
