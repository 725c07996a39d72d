"""Where a traced op's µs go: the native function mode and the recording engine, component by component.

Steady state inside one trace (entering, leaving and building the tables excluded: those are
``overhead.py``'s fixed cost), thread CPU time (this machine is shared: wall time is noise), one
intra-op thread, the contexts interleaved round robin, best of ``reps``:

    python benchmarks/fmode.py [small|mlp] [reps]

Rows: an empty TorchDispatchMode (the yardstick), an empty Python TorchFunctionMode, the C handler
passing every call through (torch's own cost of dispatching to any function mode), the native
engine's observer alone (rows; then with storages and the non-finite screen), full traces with the
C function mode and with the Python one (``TENSORSCOPE_PY_FUNCTION_MODE=1``), and ``leaks=False``
traces with one option off at a time.
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import tensorscope
from tensorscope.native import PY_FUNCTION_MODE_ENV, _build
from tensorscope.recording.engines import _native_ext


class EmptyDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class EmptyFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main(argv):
    which = argv[0] if argv else "small"
    reps = int(argv[1]) if len(argv) > 1 else 7
    torch.set_num_threads(1)
    eng, why = _native_ext()
    fm, why2 = _build.ensure(_build.FMODE)
    if eng is None or fm is None:
        print(f"native engine or function mode unavailable: {why} / {why2}")
        return 1

    class CPassThrough(TorchFunctionMode):   # the C handler with no trace configured: calls through
        def __init__(self):
            super().__init__()
            self.__torch_function__ = fm.bind(self)

    @contextlib.contextmanager
    def engine_only(screen=False, storages=False):
        eng.start(time.perf_counter_ns(), screen, storages, True, (), None, None)
        try:
            yield
        finally:
            eng.stop()
            eng.take()
            eng.release()

    @contextlib.contextmanager
    def traced(py, **kw):
        old = os.environ.pop(PY_FUNCTION_MODE_ENV, None)
        if py:
            os.environ[PY_FUNCTION_MODE_ENV] = "1"
        try:
            with tensorscope.trace(engine="native", **kw):
                yield
        finally:
            os.environ.pop(PY_FUNCTION_MODE_ENV, None)
            if old is not None:
                os.environ[PY_FUNCTION_MODE_ENV] = old

    rows_only = dict(leaks=False, nonfinite=False, storages=False, modules=False, source=False, flops=False)
    ctx = {
        "eager": contextlib.nullcontext,
        "empty dispatch mode": EmptyDispatch,
        "empty function mode (Python)": EmptyFunction,
        "C function mode, pass-through": CPassThrough,
        "engine alone (rows)": engine_only,
        "engine alone (+storages, screen)": lambda: engine_only(True, True),
        "trace rows only, C fmode": lambda: traced(False, **rows_only),
        "trace rows only, Python fmode": lambda: traced(True, **rows_only),
        "trace leaks=False, C fmode": lambda: traced(False, leaks=False),
        "  ... modules=False, source=False": lambda: traced(False, leaks=False, modules=False, source=False),
        "  ... nonfinite=False": lambda: traced(False, leaks=False, nonfinite=False),
        "  ... storages=False": lambda: traced(False, leaks=False, storages=False),
        "trace leaks=False, Python fmode": lambda: traced(True, leaks=False),
    }
    if which == "small":
        x, y = torch.rand(8, 8) * 0.5, torch.rand(8, 8)

        def work():
            z = x
            for _ in range(300):
                z = torch.add(z, y)
                z = z.mul(0.5)
                z = torch.relu(z)
            return 900
    else:
        m = torch.nn.Sequential(*[lay for _ in range(4) for lay in (torch.nn.Linear(128, 128), torch.nn.ReLU())])
        xb = torch.randn(16, 128)

        def work():
            for _ in range(3):
                m(xb).sum().backward()
            return 3 * 57   # ops per step: counted by the python engine once
    best = {k: float("inf") for k in ctx}
    for _ in range(reps):
        for key, make in ctx.items():
            with make():
                work()   # warm: caches, first-call costs
                gc.collect()
                t0 = time.thread_time_ns()
                n = work() + work()
                t1 = time.thread_time_ns()
            best[key] = min(best[key], (t1 - t0) / n / 1e3)
    eager = best["eager"]
    empty = best["empty dispatch mode"] - eager
    print(f"{which}: steady-state µs per op (thread CPU time, best of {reps})")
    print(f"{'context':36s} {'us/op':>7s} {'over eager':>11s} {'x empty mode':>13s}")
    for key, v in best.items():
        print(f"{key:36s} {v:7.2f} {v - eager:11.2f} {(v - eager) / empty:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
