"""The native function mode (native/fmode.cpp) against the Python one (recording/function.py).

With the native engine the function mode's ``__torch_function__`` is a C builtin bound to the
mode; ``TENSORSCOPE_PY_FUNCTION_MODE=1`` runs the Python ``TracingFunctionMode`` instead, with
the same engine. Both must produce the same ``calls`` rows (every column but the times), the
same ``ops.call``/``module``/source columns and the same errors and warnings, on workloads that
take every path of the C code: torch functions called from C bindings and Python-level ones
(handed to the mode by ``handle_torch_function``, called again through the trampoline), nested
modules with ModuleList/ModuleDict, a module freed and another allocated (the module-path cache),
getters (``.T``), tensor printing, autocast, C++ and Python warnings, errors raised in kernels and
in Python-level functions, a second thread.
"""
from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import tensorscope
from tensorscope.native import PY_FUNCTION_MODE_ENV, function_mode
from tensorscope.recording.function import CALL_DTYPE, NativeFunctionMode


def _available():
    try:
        from tensorscope.recording.engines import _native_ext

        ext, _ = _native_ext(wait=True)
        fm, _ = function_mode(CALL_DTYPE.itemsize)
        return ext is not None and fm is not None
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _available(), reason="the native engine or function mode cannot be built here")


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(d, d), torch.nn.Linear(d, d)])
        self.heads = torch.nn.ModuleDict({"a": torch.nn.Linear(d, d)})
        self.act = torch.nn.GELU()

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.act(self.heads["a"](x))


class Net(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.inp = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU())
        self.block = Block(d)

    def forward(self, x):
        return F.softmax(self.block(self.inp(x)), dim=1)


def workload():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    m = Net()
    y = m(x)
    y.sum().backward()
    m2 = Net()
    m2(x).sum().backward()
    del m, m2
    other = Block(8)            # may reuse a freed module's address: paths must not be stale
    other(x)
    z = x.T @ x                 # a getter recorded as a call
    repr(torch.ones(3))         # printing: no ops recorded, the row dropped
    str(z)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = torch.mm(x, x.T)
    a.float().add_(1)
    for _ in range(3):          # the same line again: the source cache
        x = x * 1.0
    torch.add(x, x, out=torch.empty(2))   # a C++ warning (out= resized), every time
    F.softmax(torch.randn(2, 2))   # Python-level warning (implicit dim), through the trampoline
    try:
        torch.mm(torch.randn(2, 3), torch.randn(2, 3))   # a kernel error, called from C
    except RuntimeError:
        pass
    try:
        F.softmax(torch.randn(2, 2), dim=5)               # an error inside a Python-level function
    except IndexError:
        pass
    done = []
    th = threading.Thread(target=lambda: done.append(torch.randn(3).sum()))
    th.start()
    th.join()
    return x


def _trace(monkeypatch, py):
    if py:
        monkeypatch.setenv(PY_FUNCTION_MODE_ENV, "1")
    else:
        monkeypatch.delenv(PY_FUNCTION_MODE_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with tensorscope.trace(engine="native", leaks=False) as t:
            workload()
    assert t.metadata["engine"] == "native"
    return t


def _rows(table, drop=()):
    d = table.to_pydict()
    return {k: v for k, v in d.items() if k not in drop}


def test_c_mode_is_the_one_used(monkeypatch):
    from tensorscope.options import TraceOptions
    from tensorscope.recording.session import new_session

    monkeypatch.delenv(PY_FUNCTION_MODE_ENV, raising=False)
    sess = new_session(TraceOptions(leaks=False, engine="native"))
    sess.start()
    try:
        mode = sess._fmode
        assert isinstance(mode, NativeFunctionMode)
        tf = mode.__torch_function__
        assert type(tf).__name__ == "builtin_function_or_method" and tf.__self__ is mode
        torch.ones(2) + 1
    finally:
        t = sess.stop()
    assert t.calls.num_rows == 2 and t.calls.column("name").to_pylist() == ["ones", "add"]


def test_same_rows_as_the_python_mode(monkeypatch):
    tc = _trace(monkeypatch, py=False)
    tp = _trace(monkeypatch, py=True)
    assert tc.metadata.get("tracer_errors", 0) == 0, tc.metadata.get("tracer_error_messages")
    assert tp.metadata.get("tracer_errors", 0) == 0
    times = ("start_ns", "dur_ns", "cpu_ns")
    assert tc.calls.num_rows > 40
    assert _rows(tc.calls, times) == _rows(tp.calls, times)
    cols = ("call_id", "module", "source_file", "source_line")
    ops_c = {k: v for k, v in tc.ops.to_pydict().items() if k in cols}
    ops_p = {k: v for k, v in tp.ops.to_pydict().items() if k in cols}
    assert ops_c == ops_p
    err_cols = ("kind", "py_type", "message", "call_id", "seq", "source_file", "source_line", "cpp_file")
    ec = [{k: r[k] for k in err_cols} for r in tc.errors.to_pylist()]
    ep = [{k: r[k] for k in err_cols} for r in tp.errors.to_pylist()]
    assert sorted(ec, key=repr) == sorted(ep, key=repr)
    kinds = [r["kind"] for r in ec]
    assert kinds.count("exception") == 2 and kinds.count("warning") >= 2
    # the module paths include the containers' qualified names
    names = set(tc.calls.column("module").to_pylist())
    assert {"block.layers.0", "block.layers.1", "block.heads.a", "inp.0"} <= names


def test_warnings_keep_the_users_location():
    # a C++ warning from a C binding and a Python warnings.warn from a Python-level torch function:
    # both name this file and line, as untraced
    def run():
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            torch.add(torch.ones(2), 1, out=torch.empty(3)); line_t = _line()  # noqa: E702
            F.softmax(torch.randn(2, 2)); line_s = _line()  # noqa: E702
        return [(w.filename, w.lineno) for w in got], (line_t, line_s)

    plain, lines = run()
    with tensorscope.trace(engine="native", leaks=False) as t:
        traced, tlines = run()
    assert t.metadata["engine"] == "native"
    assert [f for f, _ in plain] == [__file__, __file__]
    assert [ln for _, ln in plain] == list(lines)
    assert [f for f, _ in traced] == [__file__, __file__]
    assert [ln for _, ln in traced] == list(tlines)


def _line():
    import sys

    return sys._getframe(1).f_lineno


def test_exceptions_unchanged():
    def boom():
        return torch.mm(torch.randn(2, 3), torch.randn(2, 3))

    def boom_py():
        return F.softmax(torch.randn(2, 2), dim=5)

    for fn in (boom, boom_py):
        with pytest.raises(Exception) as plain:
            fn()
        with pytest.raises(Exception) as traced:
            with tensorscope.trace(engine="native", leaks=False):
                fn()
        assert type(traced.value) is type(plain.value) and str(traced.value) == str(plain.value)
        frames = lambda e: [(f.name, f.lineno) for f in e.traceback if "tensorscope" not in str(f.path)]  # noqa: E731
        assert frames(traced)[1:] == frames(plain)[1:]   # [0]: this test's own line


def test_tracer_bug_is_contained(monkeypatch):
    import tensorscope.recording.function as fmod

    def broken(_frame):
        raise RuntimeError("tracer bug")

    monkeypatch.setattr(fmod, "user_location_from", broken)
    x = torch.randn(3, 3)
    with tensorscope.trace(engine="native", leaks=False) as t:
        y = x @ x          # a fresh line: a source-cache miss calls the broken helper
    assert torch.equal(y, x @ x)
    assert t.metadata["tracer_errors"] >= 1
    assert t.calls.num_rows == 1   # the call is still recorded (without its line)


def test_keyboard_interrupt_in_a_helper_reaches_the_program(monkeypatch):
    from torch.overrides import _get_current_function_mode_stack

    import tensorscope.recording.function as fmod

    def interrupted(_frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(fmod, "user_location_from", interrupted)
    x = torch.randn(2, 2)
    with pytest.raises(KeyboardInterrupt):
        with tensorscope.trace(engine="native", leaks=False):
            x + 1
    assert not _get_current_function_mode_stack()
    monkeypatch.undo()
    with tensorscope.trace(engine="native", leaks=False) as t:   # everything was restored
        x + 1
    assert t.calls.num_rows == 1


def test_many_calls_are_packed_and_decode_to_the_same_rows(monkeypatch):
    # > 2 blocks of 16384 calls: full blocks are packed column by column while recording
    from tensorscope.native import _build

    x = torch.ones(2)

    def many():
        z = x
        for i in range(40000):
            z = z + 1 if i % 7 else z.mul(1.0)
        return z

    stats = {}

    def run(py, **spill):
        if py:
            monkeypatch.setenv(PY_FUNCTION_MODE_ENV, "1")
        else:
            monkeypatch.delenv(PY_FUNCTION_MODE_ENV, raising=False)
        with tensorscope.trace(engine="native", leaks=False, storages=False, nonfinite=False, **spill) as t:
            many()
            if not py:
                stats.update(_build._STATES["fmode"].module.stats())
        return t

    tc, tp = run(False), run(True)
    assert stats["calls"] == 40000 and stats["packed_blocks"] == 2
    assert stats["row_bytes"] / stats["calls"] < 40   # vs 56 bytes a live row
    times = ("start_ns", "dur_ns", "cpu_ns")
    assert _rows(tc.calls, times) == _rows(tp.calls, times)
    starts = tc.calls.column("start_ns").to_pylist()
    assert starts == sorted(starts) and tc.calls.column("dur_ns").to_pylist()[20000] >= 0
    # spilled: the packed blocks handed over at the end spill with the last op chunks and the calls
    # table is decoded 3000 calls at a time across them and the rows after them
    ts = run(False, spill_rows=6000, chunk_rows=3000)
    assert ts.metadata["spilled_rows"] > 0 and ts.calls.column("call_id").num_chunks > 10
    assert _rows(ts.calls, times) == _rows(tp.calls, times)


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")
def test_compiled_code_stays_compiled_under_the_c_mode(monkeypatch):
    # Dynamo must see the class's Python handler (a plain call), not the C builtin: the instance
    # attribute is hidden while it compiles. Otherwise the compiled function runs eagerly, every
    # torch function recorded as a call.
    import shutil

    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        pytest.skip("Inductor on CPU needs a C++ compiler")
    from torch._dynamo.utils import counters

    def f(x):
        return torch.relu(x @ x.T).sum() + F.softmax(x, dim=1).sum()

    x = torch.randn(4, 4)
    seen = {}
    for py in (False, True):
        if py:
            monkeypatch.setenv(PY_FUNCTION_MODE_ENV, "1")
        else:
            monkeypatch.delenv(PY_FUNCTION_MODE_ENV, raising=False)
        torch._dynamo.reset()
        counters.clear()
        cf = torch.compile(f, dynamic=False)
        with tensorscope.trace(engine="native", leaks=False) as t:
            cf(x)
        seen[py] = (t.calls.column("name").to_pylist(), t.ops.num_rows, dict(counters["graph_break"]))
    torch._dynamo.reset()
    assert seen[False] == seen[True]
    names, _n_ops, breaks = seen[False]
    assert not breaks and "relu" not in names and "softmax" not in names
