"""A CPU-weighted stack sampler that runs inside a process, for ``cpu_per_turn.py`` only.

Loaded by the ``sitecustomize.py`` that ``cpu_per_turn.py`` writes into a temporary folder
it puts first on ``PYTHONPATH`` of the run it measures, and only when
``ROLLART_CPU_SAMPLER`` names a control folder: nothing in rollart imports it. A daemon thread
waits for ``<folder>/start``; from then on, ``ROLLART_CPU_SAMPLER_HZ`` times a second, it
reads every other Python thread's stack (``sys._current_frames``) and that thread's CPU clock
(``pthread_getcpuclockid``), and adds the CPU the thread used since the previous tick to the
stack it is in now: a blocked thread (a queue wait, the GIL) adds nothing, and the sums are
CPU time, not sample counts. The main thread (the event loop) is sampled differently: a
thread that needs the GIL to look would mostly see it where it lets the GIL go, in
``epoll_wait``, and charge the loop's work to its idle point. So a ``SIGPROF`` timer
(``ITIMER_PROF``, ticking with the process's CPU) runs a handler in the main thread at its next
bytecode, which adds the main thread's CPU since its previous call to the stack it is in
(``SA_RESTART``: interrupted system calls are restarted). The handlers' and the sampler
thread's own CPU are counted apart; garbage collection in the main thread is timed by
``gc.callbacks`` and counted as one stack of its own (``gc``). When ``<folder>/stop`` appears it writes ``<folder>/<pid>.json`` (folded stacks,
a ``thread:<id>:<name>`` frame, then the outermost frame first, ``;``-separated, with their
CPU in microseconds; its own thread's CPU;
the process's CPU over the same span) and ends.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time


def _name(code) -> str:
    return f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename})"


def _loop(ctl: str, hz: float) -> None:
    start, stop = os.path.join(ctl, "start"), os.path.join(ctl, "stop")
    while not os.path.exists(start):
        time.sleep(0.1)
    me = threading.get_ident()
    main_id = threading.main_thread().ident
    use_signal = signal.getsignal(signal.SIGPROF) is _on_prof
    if use_signal:
        _main["main_id"] = main_id
        gc.callbacks.append(_on_gc)
        _main["on"] = True
        signal.setitimer(signal.ITIMER_PROF, 1.0 / hz, 1.0 / hz)
    clocks: dict[int, list] = {}
    stacks: dict[tuple, float] = {}
    period = 1.0 / hz
    own0, proc0, t0 = time.thread_time(), time.process_time(), time.monotonic()
    ticks, next_check = 0, t0 + 0.2
    gettime, getclock = time.clock_gettime, time.pthread_getcpuclockid
    while True:
        frames = sys._current_frames()
        for ident, frame in frames.items():
            if ident == me or (use_signal and ident == main_id):
                continue
            c = clocks.get(ident)
            try:
                if c is None:
                    cid = getclock(ident)
                    clocks[ident] = [cid, gettime(cid)]
                    continue
                now = gettime(c[0])
            except OSError:
                clocks.pop(ident, None)
                continue
            d = now - c[1]
            c[1] = now
            if d <= 0:
                continue
            codes = []
            f = frame
            while f is not None:
                codes.append(f.f_code)
                f = f.f_back
            key = (ident, tuple(codes))
            stacks[key] = stacks.get(key, 0.0) + d
        del frames, frame
        ticks += 1
        t = time.monotonic()
        if t >= next_check:
            next_check = t + 0.2
            if os.path.exists(stop):
                break
        time.sleep(max(0.0, period - (time.monotonic() - t)))
    if use_signal:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        time.sleep(0.05)
        _main["on"] = False
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(_on_gc)
        for codes, cpu in _main["stacks"].items():
            key = (main_id, codes)
            stacks[key] = stacks.get(key, 0.0) + cpu
    names = {t.ident: t.name for t in threading.enumerate()}
    folded: dict[str, int] = {}
    if _main.get("gc"):
        folded[f"thread:{main_id}:MainThread;gc (<garbage collection>)"] = int(_main["gc"] * 1e6)
    for (ident, codes), cpu in stacks.items():
        s = ";".join([f"thread:{ident}:{names.get(ident, '?')}"] + [_name(c) for c in reversed(codes)])
        folded[s] = folded.get(s, 0) + int(cpu * 1e6)
    out = {"pid": os.getpid(), "argv": sys.argv, "ticks": ticks, "span_s": time.monotonic() - t0,
           "sampler_cpu_s": time.thread_time() - own0 + _main["cpu"], "main_by_signal": use_signal,
           "gc_by_generation": _main.get("gc_by_gen", {}), "gc_frozen": gc.get_freeze_count(),
           "gc_tracked": len(gc.get_objects()), "process_cpu_s": time.process_time() - proc0,
           "threads_cpu_s": sum(folded.values()) / 1e6, "stacks_us": folded}
    tmp = os.path.join(ctl, f"{os.getpid()}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(out, fh)
    os.replace(tmp, os.path.join(ctl, f"{os.getpid()}.json"))


_main: dict = {"stacks": {}, "last": None, "cpu": 0.0, "on": False}


_GC = ("gc", "<gc>")  # the key garbage collection in the main thread is counted under


def _on_gc(phase: str, info: dict) -> None:
    """Garbage collection in the main thread is timed apart: a SIGPROF handler that runs
    during a collection (in a weakref callback) would charge the whole pass to that callback."""
    st = _main
    if not st["on"] or threading.get_ident() != st["main_id"]:
        return
    now = time.thread_time()
    if phase == "start":
        st["gc0"] = now
    elif st.get("gc0") is not None:
        d = now - st["gc0"]
        st["gc0"] = None
        st["gc"] = st.get("gc", 0.0) + d
        g = st.setdefault("gc_by_gen", {}).setdefault(str(info.get("generation")), [0, 0.0])
        g[0] += 1
        g[1] += d
        if st["last"] is not None:
            st["last"] += d  # the next handler call charges only what is not the collection


def _on_prof(signum, frame) -> None:
    """SIGPROF in the main thread (the event loop): its CPU since the last call goes to the
    stack it is in now. Runs at the main thread's next bytecode after the signal, so a tick
    that fell while it waited in epoll (no CPU) weighs ~0."""
    t0 = time.thread_time()
    st = _main
    if not st["on"] or frame is None or st.get("gc0") is not None:
        return
    last = st["last"]
    if last is not None and t0 > last:
        codes = []
        f = frame
        while f is not None:
            codes.append(f.f_code)
            f = f.f_back
        key = tuple(codes)
        st["stacks"][key] = st["stacks"].get(key, 0.0) + (t0 - last)
    t1 = time.thread_time()
    st["cpu"] += t1 - t0  # the handler's own time is not the process's work
    st["last"] = t1


def start(ctl: str, hz: float = 200.0) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGPROF, _on_prof)
        signal.siginterrupt(signal.SIGPROF, False)  # restart interrupted system calls
    threading.Thread(target=_loop, args=(ctl, hz), name="cpu-sampler", daemon=True).start()


SITECUSTOMIZE = '''\
import os
if os.environ.get("ROLLART_CPU_SAMPLER"):
    import importlib.util
    _spec = importlib.util.spec_from_file_location("_rollart_cpu_sampler", {path!r})
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    _mod.start(os.environ["ROLLART_CPU_SAMPLER"], float(os.environ.get("ROLLART_CPU_SAMPLER_HZ", "200")))
'''


def write_sitecustomize(folder: str) -> None:
    """A ``sitecustomize.py`` in ``folder`` that starts the sampler when the env var is set."""
    with open(os.path.join(folder, "sitecustomize.py"), "w") as fh:
        fh.write(SITECUSTOMIZE.format(path=os.path.abspath(__file__)))
