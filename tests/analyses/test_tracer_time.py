"""The tracer's own time between two ops is never the program's. The engines time their own work in
the gaps: the python engine all of it, per row (``ops.probe_ns``: its modes' bookkeeping, the non-finite
screen, hooks), the native engine its callbacks and function mode on a sample (``metadata["tracer_op_ns"]``,
a mean per op). The ``outside_ops`` finding counts a gap only past that and past what torch's calls into
the tracer cost (``idle.TRACER_NS``, or ``UNTIMED_RATIO`` times the timed part). A fixed per-op allowance
alone read a slower machine's tracer as the program's Python: CI (a machine then ~3x slower than the
development one) reported "outside_ops" for 600 back-to-back ``x.add`` under the python engine (gaps of
~95 us against a 50 us allowance)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import tensorscope
from tensorscope.recording import function

ENGINES = ("native", "python")
_SLOW_NS = 150_000   # the tracer's work before each call, as on a machine many times slower (CPU-bound)


def _busy(ns: int) -> None:
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


@pytest.fixture
def slow_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both engines' function modes ask whether autocast is on before each call they record (their
    own timed work): made to take 150 us, the tracer of a much slower machine."""
    real = function._any_autocast
    assert real is not None

    def slow() -> bool:
        _busy(_SLOW_NS)
        return bool(real())
    monkeypatch.setattr(function, "_any_autocast", slow)


def _kinds(t: tensorscope.Trace) -> set[str]:
    return {f["kind"] for f in t.advice().findings.to_pylist()}


def _gaps(t: tensorscope.Trace) -> tuple[np.ndarray, np.ndarray]:
    ops = t.ops.select(["start_ns", "cpu_ns", "probe_ns"]).to_pandas()
    s = ops.start_ns.to_numpy()
    e = s + ops.cpu_ns.to_numpy()
    return s[1:] - e[:-1], ops.probe_ns.to_numpy(dtype=float, na_value=np.nan)


@pytest.mark.parametrize("spill_rows", [None, 64])
def test_the_python_engine_times_its_own_work_in_every_gap(spill_rows):
    """Every row but the last has the tracer's time after it, and that time lies within the gap to the
    next op (it is measured, not assumed): a loop of small ops and a model's forward and backward
    (one thread, rows in start order); spilled, the last row of each spilled part keeps null."""
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 16)
    kw = {} if spill_rows is None else {"spill_rows": spill_rows, "chunk_rows": spill_rows}
    with tensorscope.trace(engine="python", leaks=False, **kw) as t:
        y = torch.ones(4)
        for _ in range(100):
            y = y.add(1.0)
        m(x).sum().backward()
    gaps, own = _gaps(t)
    assert np.isnan(own[-1])                       # no op after the last: nothing to time
    timed = ~np.isnan(own[:-1])
    nulls = int((~timed).sum())
    assert nulls == 0 if spill_rows is None else 0 < nulls <= t.ops.num_rows // spill_rows + 1
    assert (own[:-1][timed] > 0).all()
    assert (own[:-1][timed] <= gaps[timed]).all()  # the tracer's time lies inside the gap it was spent in
    assert np.median(own[:-1][timed] / np.maximum(gaps[timed], 1)) > 0.3   # and is a real part of it


def test_the_native_engine_times_a_sample_of_its_own_work():
    """The native engine's mean own time per op (its callbacks outside the op and its function mode,
    sampled) is recorded, and lies within the gaps it was spent in."""
    x = torch.ones(16)
    with tensorscope.trace(engine="native", leaks=False) as t:
        for _ in range(2000):
            x = x.add(1.0)
    if t.metadata.get("engine") != "native":
        pytest.skip("the native engine is not built here")
    own = t.metadata.get("tracer_op_ns")
    gaps, _ = _gaps(t)
    assert own is not None and 0 < own < np.median(gaps)
    with tensorscope.trace(engine="native", leaks=False) as t:   # too few ops for a sample: no estimate
        x.add(1.0)
    assert t.metadata.get("tracer_op_ns") is None


@pytest.mark.parametrize("engine", ENGINES)
def test_a_slow_tracer_is_no_outside_ops_finding(slow_tracer, engine):
    x = torch.ones(16)
    with tensorscope.trace(engine=engine, leaks=False) as t:
        for _ in range(300):
            x = x.add(1.0)
    gaps, _ = _gaps(t)
    assert np.median(gaps) > _SLOW_NS > 2 * 50_000   # past either fixed allowance: the finding before
    assert "outside_ops" not in _kinds(t)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_programs_python_is_still_found_beside_a_slow_tracer(slow_tracer, engine):
    x = torch.ones(16)
    with tensorscope.trace(engine=engine, leaks=False) as t:
        for _ in range(40):
            x = x.add(1.0)
            if _ % 10 == 0:
                deadline = time.thread_time() + 0.004    # 4 ms of the program's own CPU work between two ops
                while time.thread_time() < deadline:
                    pass
        x = x.add(1.0)
    (f,) = [f for f in t.advice().findings.to_pylist() if f["kind"] == "outside_ops"]
    assert f["cost_ns"] >= 4 * 2_500_000   # each 4 ms, less what a tracer this slow may have spent (~0.9 ms)
