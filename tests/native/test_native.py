"""tensorscope.native: warning capture, error observer, error counter, build cache, fallback.

Every behavioural test runs against both implementations (the compiled hooks
and the pure-Python fallback) inside minimal modes of its own
(tests/helpers/native_helpers.py). The native part is compiled for real: the first
test session on a machine compiles hooks.cpp and test_ops.cpp (~15-40 s each)
into the cache, later sessions load them in about a millisecond.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

import tensorscope.native as tn
from tensorscope.native import _build
from tensorscope.native._capture import NativeCapture
from tensorscope.native._fallback import TAP, FallbackCapture, split_triggered
from tests.helpers import ROOT
from tests.helpers.native_helpers import TEST_OPS_CPP, cpp_line_of, traced

PY = sys.executable


def _skip_without_toolchain():
    problem = _build.toolchain_problem()
    if problem and _build.cached(_build.HOOKS) is None:
        pytest.skip(f"cannot compile the native part here: {problem}")


@pytest.fixture(scope="session")
def ext():
    _skip_without_toolchain()
    mod, reason = _build.ensure(_build.HOOKS)
    assert mod is not None, f"native hooks failed to build: {reason}"
    return mod


@pytest.fixture(scope="session")
def T():
    _skip_without_toolchain()
    return tn.load_test_ops(TEST_OPS_CPP)


@pytest.fixture(params=["native", "fallback"])
def cap(request, ext):
    """A capture of each kind (native built directly, so it also runs under the force flag)."""
    c = NativeCapture(ext) if request.param == "native" else FallbackCapture(reason="test")
    yield c
    c.close()
    assert ext.depth() == 0
    assert not TAP.installed


def _x():
    return torch.ones(3)


# ---------------------------------------------------------------------------
# facade, import, status
# ---------------------------------------------------------------------------

def test_import_is_cheap_and_builds_nothing(tmp_path):
    code = ("import sys, tensorscope.native as n; "
            "print('torch' in sys.modules, 'torch.utils.cpp_extension' in sys.modules, "
            "n._build._STATES['hooks'].state)")
    env = dict(os.environ, TENSORSCOPE_CACHE=str(tmp_path))
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "idle"]
    assert list(tmp_path.iterdir()) == []


def test_force_fallback_env(monkeypatch, ext):
    monkeypatch.setenv(tn.FORCE_ENV, "1")
    st = tn.status()
    assert st["state"] == "fallback" and tn.FORCE_ENV in st["reason"] and st["available"] == "built"
    c = tn.open_capture(native=True)
    try:
        assert c.native is False and tn.FORCE_ENV in c.reason
        assert c.swallowed_count() is None
    finally:
        c.close()
    monkeypatch.setenv(tn.FORCE_ENV, "0")
    c = tn.open_capture(native=True)
    try:
        assert c.native is True
    finally:
        c.close()


def test_status_when_built(ext, monkeypatch):
    monkeypatch.delenv(tn.FORCE_ENV, raising=False)
    st = tn.status()
    assert st["state"] == "built" and st["loaded"] and os.path.exists(st["path"])
    assert st["source_locations"] is True, st.get("source_locations_reason")
    c = tn.open_capture(native=False)
    try:
        assert c.native is False and c.reason == "native=False"
    finally:
        c.close()


def test_build_native_main(ext, capsys):
    assert tn.build_native_main(["--cache-dir"]) == 0
    assert capsys.readouterr().out.strip() == _build.cache_root()
    assert tn.build_native_main([]) == 0
    out = capsys.readouterr().out
    assert "native hooks: built" in out and "source locations: yes" in out


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

ERROR_KINDS = [
    # kind, Python type, c10 type, message fragment
    ("error", RuntimeError, "c10::Error", "c10::Error raised"),
    ("index", IndexError, "c10::IndexError", "c10::IndexError raised"),
    ("value", ValueError, "c10::ValueError", "c10::ValueError raised"),
    ("type", TypeError, "c10::TypeError", "c10::TypeError raised"),
    ("not_implemented", NotImplementedError, "c10::NotImplementedError", "c10::NotImplementedError raised"),
    ("linalg", torch.linalg.LinAlgError, "c10::LinAlgError", "c10::LinAlgError raised"),
    ("oom", torch.OutOfMemoryError, "c10::OutOfMemoryError", "c10::OutOfMemoryError raised"),
    ("buffer", BufferError, "c10::BufferError", "c10::BufferError raised"),
    ("internal", RuntimeError, "c10::Error", "internal assert"),
]
PY_NAMES = {torch.linalg.LinAlgError: "torch.linalg.LinAlgError", torch.OutOfMemoryError: "torch.OutOfMemoryError"}


@pytest.mark.parametrize("kind,py_type,c10_type,fragment", ERROR_KINDS, ids=[k[0] for k in ERROR_KINDS])
def test_every_c10_kind(cap, T, kind, py_type, c10_type, fragment):
    x = _x()
    with pytest.raises(py_type) as ei:
        T.raise_error(x, kind)
    untraced_msg = str(ei.value)
    with traced(cap) as log:
        with pytest.raises(py_type) as ei:
            T.raise_error(x, kind)
    assert type(ei.value) is py_type and str(ei.value) == untraced_msg  # the user's exception, unchanged
    [(op, etype, info)] = log.op_errors
    assert op == "tensorscope_test.raise_error.default" and etype is py_type
    assert info["message"] == untraced_msg and fragment in info["message"]
    assert info["py_type"] == PY_NAMES.get(py_type, py_type.__name__)
    if cap.native:
        assert info["native"] is True and info["cpp_type"] == c10_type
        assert os.path.basename(info["cpp_file"]) == "test_ops.cpp"
        assert info["cpp_line"] == cpp_line_of(f'"tensorscope_test: {fragment}')
        assert info["cpp_function"] == "raise_error"
    else:
        assert info["native"] is False
        assert info["cpp_type"] is info["cpp_file"] is info["cpp_line"] is info["cpp_function"] is None


def test_errors_without_location(ext, T):
    cap = NativeCapture(ext)
    try:
        with traced(cap) as log:
            for kind in ("no_location", "std"):
                with pytest.raises(RuntimeError):
                    T.raise_error(_x(), kind)
        (_, _, a), (_, _, b) = log.op_errors
        assert a["cpp_type"] == "c10::Error" and a["cpp_file"] is None and a["cpp_line"] is None and a["native"]
        assert b["cpp_type"] == "std::runtime_error" and b["message"].endswith("std::runtime_error raised")
    finally:
        cap.close()


REAL_FAILURES = {
    "add_shape": (lambda: torch.ones(3) + torch.ones(4), RuntimeError, "aten.add.Tensor", "must match the size"),
    "mm_shape": (lambda: torch.mm(torch.ones(2, 3), torch.ones(2, 3)), RuntimeError, "aten.mm.default", "cannot be multiplied"),
    "view_noncontig": (lambda: torch.ones(4, 6).t().view(24), RuntimeError, "aten.view.default", "view size is not compatible"),
    "int_iadd_float": (lambda: torch.ones(3, dtype=torch.long).add_(1.5), RuntimeError, "aten.add_.Tensor", "can't be cast"),
    "inv_singular": (lambda: torch.linalg.inv(torch.zeros(2, 2)), torch.linalg.LinAlgError, "linalg", "singular"),
}


@pytest.mark.parametrize("case", sorted(REAL_FAILURES))
def test_real_failing_ops(cap, case):
    fn, py_type, op, fragment = REAL_FAILURES[case]
    with pytest.raises(py_type) as ei:
        fn()
    untraced = str(ei.value)
    with traced(cap) as log:
        with pytest.raises(py_type) as ei:
            fn()
    assert str(ei.value) == untraced
    assert log.op_errors, "the dispatch mode saw the failing op"
    op_name, etype, info = log.op_errors[-1]
    assert op in op_name and etype is py_type and fragment in info["message"]
    # The enclosing torch-level call sees the same exception and the same facts.
    [(call, ctype, cinfo)] = log.call_errors
    assert ctype is py_type and cinfo == info
    if cap.native:
        assert info["native"] and info["cpp_type"] in ("c10::Error", "c10::LinAlgError")
        assert info["cpp_file"].endswith(".cpp") and info["cpp_line"] > 0 and info["cpp_function"]
    else:
        assert not info["native"] and info["cpp_file"] is None


def test_errors_raised_before_dispatch(cap):
    leaf = torch.ones(2, requires_grad=True)
    with traced(cap) as log:
        with pytest.raises(RuntimeError, match="leaf Variable"):
            leaf.add_(1)
        with pytest.raises(TypeError) as ei:
            torch.add(torch.ones(2), "x")   # argument parsing: before any mode
    assert log.op_errors == []                # never reached an ATen op
    [(call, etype, info)] = log.call_errors   # the leaf check: seen at the call level
    assert call == "add_" and etype is RuntimeError and "leaf Variable" in info["message"]
    assert info["native"] is False and info["cpp_type"] is None  # torch's own translation path
    info = cap.error_info(ei.value)           # what a cell-level handler would ask
    assert info["py_type"] == "TypeError" and info["message"] == str(ei.value) and not info["native"]


def test_stale_error_not_attributed(ext, T):
    """A slot left by an earlier, swallowed error must not describe a later exception."""
    cap = NativeCapture(ext)
    try:
        with traced(cap) as log:
            try:
                T.raise_error(_x(), "index")
            except IndexError:
                pass
            with pytest.raises(RuntimeError):
                torch.ones(2, requires_grad=True).add_(1)   # no op in between clears nothing
        info = log.call_errors[-1][2]
        assert info["native"] is False and info["cpp_type"] is None
    finally:
        cap.close()


# ---------------------------------------------------------------------------
# warnings
# ---------------------------------------------------------------------------

def _neg_runs(T, kind, what="warn"):
    """torch.neg(x) whose aten.neg runs a test op: inside a real binding's PyWarningHandler."""
    op = T.warn if what == "warn" else T.raise_error
    return {torch.ops.aten.neg.default: lambda x: op(x, kind)}


WARN_KINDS = [
    ("plain", "UserWarning", False, False, "plain warning"),
    ("deprecation", "DeprecationWarning", True, False, "deprecation warning"),
    ("verbatim", "UserWarning", False, True, "verbatim warning"),
]


@pytest.mark.parametrize("kind,category,deprecation,verbatim,fragment", WARN_KINDS, ids=[k[0] for k in WARN_KINDS])
def test_warning_kinds(cap, T, kind, category, deprecation, verbatim, fragment):
    line = cpp_line_of(f'"tensorscope_test: {fragment}"')
    x = _x()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with traced(cap, substitute=_neg_runs(T, kind)) as log:
            torch.neg(x); here = sys._getframe().f_lineno  # noqa: E702
    mine = [w for w in shown if fragment in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in shown]   # Python saw it exactly once
    assert mine[0].category.__name__ == category
    if cap.native:
        [(op, w, bw)] = log.op_warnings
        assert op == "aten.neg.default" and not bw and log.call_warnings == []
        assert w["native"] is True and w["cpp_function"] == "warn"
        if not verbatim:   # attributed to the user's line, as without tracing
            assert (mine[0].filename, mine[0].lineno) == (__file__, here)
    else:
        assert log.op_warnings == []
        [(call, w)] = log.call_warnings
        assert call == "neg" and w["native"] is False
    assert w["message"] == f"tensorscope_test: {fragment}"
    assert w["category"] == category and w["deprecation"] is deprecation and w["verbatim"] is verbatim
    assert os.path.basename(w["cpp_file"]) == "test_ops.cpp" and w["cpp_line"] == line


def test_native_warning_fields_direct(ext, T):
    """Test ops called directly (torch.ops: no PyWarningHandler): every warning captured, chained to stderr as untraced."""
    cap = NativeCapture(ext)
    try:
        with traced(cap) as log:
            T.warn(_x(), "twice")
            T.warn(_x(), "once0")
            T.warn(_x(), "once0")       # TORCH_WARN_ONCE: once per process
            T.warn(_x(), "none")
    finally:
        cap.close()
    assert log.op_warning_messages() == ["tensorscope_test: first of two", "tensorscope_test: second of two",
                                         "tensorscope_test: warn once (site 0)"]


def test_warn_once_fallback(T):
    cap = FallbackCapture()
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            with traced(cap, substitute=_neg_runs(T, "once1")) as log:
                torch.neg(_x())
                torch.neg(_x())
    finally:
        cap.close()
    assert [w["message"] for _c, w in log.call_warnings] == ["tensorscope_test: warn once (site 1)"]


def test_warning_and_error_in_one_op(cap, T):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with traced(cap, substitute=_neg_runs(T, "warn_then_raise", what="raise")) as log:
            with pytest.raises(RuntimeError, match="error after a warning"):
                torch.neg(_x())
    assert sum("warning before an error" in str(w.message) for w in shown) == 1
    [(_op, _t, info)] = log.op_errors
    assert "error after a warning" in info["message"]
    got = [w for _o, w, _b in log.op_warnings] + [w for _c, w in log.call_warnings]
    assert [w["message"] for w in got] == ["tensorscope_test: warning before an error"]


def _std_warns():
    return torch.tensor([1.0]).std()


def _out_resize():
    return torch.add(torch.ones(3), torch.ones(3), out=torch.empty(5))


REAL_WARNINGS = {
    "std_dof": (_std_warns, "aten.std.correction", "degrees of freedom", "ReduceOps.cpp"),
    "out_resize": (_out_resize, "aten.add.out", "was resized", "Resize.cpp"),
}


@pytest.mark.parametrize("case", sorted(REAL_WARNINGS))
def test_real_op_warnings(cap, case):
    fn, op, fragment, cpp_file = REAL_WARNINGS[case]
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with traced(cap) as log:
            fn()
    assert sum(fragment in str(w.message) for w in shown) == 1
    if cap.native:
        [(op_name, w, _bw)] = log.op_warnings
        assert op_name == op and log.call_warnings == []
        assert w["cpp_function"]   # only the native path knows the C++ function
    else:
        [(_call, w)] = log.call_warnings
    assert fragment in w["message"] and "Triggered internally" not in w["message"]
    assert os.path.basename(w["cpp_file"]) == cpp_file and w["cpp_line"] > 0


def test_default_filter_dedup_like_untraced(ext):
    """Under the 'default' action Python shows a warning once per *location*;
    the native redirect keeps the user's locations, so tracing shows what untraced code shows."""
    def run():
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("default")
            for _ in range(2):
                torch.tensor([1.0]).std()
                torch.tensor([2.0]).std()
        return [(w.filename, w.lineno) for w in shown]

    untraced = run()
    cap = NativeCapture(ext)
    try:
        with traced(cap):
            got = run()
    finally:
        cap.close()
    assert len(untraced) == 2 and got == untraced


def test_python_level_warning_in_call(cap):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with traced(cap) as log:
            torch.nn.functional.softmax(torch.ones(2, 2))   # warnings.warn in torch's Python code
    assert sum("Implicit dimension" in str(w.message) for w in shown) == 1
    [(call, w)] = log.call_warnings
    assert call == "softmax" and w["native"] is False and w["cpp_file"] is None and "Implicit dimension" in w["message"]


def test_filter_ignore(cap):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("ignore")
        with traced(cap) as log:
            _std_warns()
    assert shown == []
    if cap.native:   # captured before Python's filters: the trace still knows
        assert [op for op, _w, _b in log.op_warnings] == ["aten.std.correction"]
    else:            # the fallback only sees what Python shows
        assert log.call_warnings == [] and log.op_warnings == []


def test_filter_error(cap):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with traced(cap) as log:
            with pytest.raises(UserWarning, match="degrees of freedom"):
                _std_warns()
    if cap.native:
        # Handed to the outer Tensor.std binding's handler, the warning is raised
        # when that binding returns, as untraced: after the function mode's call
        # ended, so only a cell-level handler sees the exception.
        assert [op for op, _w, _b in log.op_warnings] == ["aten.std.correction"]
        assert log.call_errors == []
    else:
        [(call, etype, info)] = log.call_errors
        assert call == "std" and etype is UserWarning
        assert info["py_type"] == "UserWarning" and not info["native"]


class _WarnInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        torch.std(g.sum().reshape(1))   # std of one element warns (the value is unused)
        return g * 2


def test_warnings_during_backward(cap):
    x = torch.ones(3, requires_grad=True)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with traced(cap) as log:
            _WarnInBackward.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert sum("degrees of freedom" in str(w.message) for w in shown) == 1
    if cap.native:
        [(op, w, bw)] = log.op_warnings
        assert op == "aten.std.correction" and bw is True and w["native"]
    else:
        assert [(c, "degrees of freedom" in w["message"]) for c, w in log.call_warnings] == [("backward", True)]


# ---------------------------------------------------------------------------
# threads, restoration, counter
# ---------------------------------------------------------------------------

def test_threads_are_isolated(ext, T):
    results, errors = {}, []
    barrier = threading.Barrier(3)

    def worker(i):
        try:
            cap = NativeCapture(ext)
            try:
                with traced(cap) as log:
                    barrier.wait(timeout=30)
                    for _ in range(50):
                        T.warn(_x(), "plain" if i == 0 else "twice")
                        try:
                            T.raise_error(_x(), "index" if i == 0 else "value")
                        except (IndexError, ValueError):
                            pass
                results[i] = log
            finally:
                cap.close()
            assert ext.depth() == 0
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    barrier.wait(timeout=30)
    for _ in range(10):   # this thread is traced by nobody: nothing of it may show up
        T.warn(_x(), "deprecation")
    for t in ts:
        t.join(60)
    assert not errors, errors
    assert results[0].op_warning_messages() == ["tensorscope_test: plain warning"] * 50
    assert results[1].op_warning_messages() == ["tensorscope_test: first of two", "tensorscope_test: second of two"] * 50
    assert {i["cpp_type"] for _o, _t, i in results[0].op_errors} == {"c10::IndexError"}
    assert {i["cpp_type"] for _o, _t, i in results[1].op_errors} == {"c10::ValueError"}
    assert len(results[0].op_errors) == len(results[1].op_errors) == 50


def test_close_restores_everything(ext, T):
    import warnings as w_mod

    before = w_mod._showwarnmsg
    cap = NativeCapture(ext, cpp_errors=True)
    assert TAP.installed and ext.counter_users() == 1
    cap.op_begin()
    cap.op_begin()        # an interrupted trace: ops left open
    cap.call_begin(torch.add)
    cap.close()
    cap.close()           # idempotent
    assert ext.depth() == 0 and ext.counter_users() == 0 and w_mod._showwarnmsg is before
    n = ext.constructed()
    T.swallow(_x(), 3)
    assert ext.constructed() == n          # torch's fetcher is back: nothing counts
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        _std_warns()
    assert sum("degrees of freedom" in str(w.message) for w in shown) == 1   # torch's handler is back
    assert cap.op_end() is None and cap.error_info(ValueError("x")) is not None


def test_swallowed_counter(ext, T):
    cap = NativeCapture(ext, cpp_errors=True)
    try:
        with traced(cap):
            T.swallow(_x(), 7)
            with pytest.raises(IndexError):
                T.raise_error(_x(), "index")      # surfaced: not swallowed
            with pytest.raises(RuntimeError):
                torch.ones(2, requires_grad=True).add_(1)   # surfaced before dispatch
        assert cap.constructed_count() == 9
        assert cap.swallowed_count() == 7
    finally:
        cap.close()
    assert cap.swallowed_count() == 7   # stable after close
    plain = NativeCapture(ext)
    try:
        assert plain.swallowed_count() is None
    finally:
        plain.close()
    fb = FallbackCapture(cpp_errors=True)
    assert fb.swallowed_count() is None and "native" in fb.reason
    fb.close()


def _frames(what):
    """A c10 backtrace's frame lines without addresses."""
    import re

    return [re.sub(r" \+ 0x[0-9a-f]+ \(0x[0-9a-f]+ in ", " (", line) for line in what.splitlines()]


class _EngineStub:
    """What arm_error_sites needs of the engine when none runs (the reader is then unused)."""

    class ext:
        readers = []

        @classmethod
        def set_site_reader(cls, r):
            cls.readers.append(r)


def test_error_sites_fetcher_is_restored_and_changes_no_text(ext, T):
    """Armed, the fetcher wraps c10's default backtrace: the text any what() shows is unchanged;
    disarmed, c10's default is back (same type, same text)."""
    if ext.cpp_stacktraces:
        pytest.skip("TORCH_SHOW_CPP_STACKTRACES set: sites are never armed (see the subprocess test)")
    t0, w0 = ext.fetcher_probe()
    assert t0.startswith("c10::get_lazy_backtrace")
    cap = NativeCapture(ext)
    try:
        assert cap.arm_error_sites(_EngineStub) and cap.sites_reason == "ok"
        assert _EngineStub.ext.readers[-1] is ext.site_reader
        t1, w1 = ext.fetcher_probe()
        assert t1.endswith("SiteBacktrace") and _frames(w1) == _frames(w0)
        T.swallow(_x(), 3)
        with pytest.raises(IndexError):
            T.raise_error(_x(), "index")
        assert ext.site_count() == 0     # every error gone: nothing remembered
    finally:
        cap.close()
    assert _EngineStub.ext.readers[-1] is None
    t2, w2 = ext.fetcher_probe()
    assert t2 == t0 and _frames(w2) == _frames(w0)


def test_error_sites_with_the_counter(ext, T):
    """Sites and the opt-in counter share the fetcher: each keeps working while the other
    comes and goes, and c10's default is back when both left."""
    if ext.cpp_stacktraces:
        pytest.skip("TORCH_SHOW_CPP_STACKTRACES set")
    t0, w0 = ext.fetcher_probe()
    counting = NativeCapture(ext, cpp_errors=True)
    sites = NativeCapture(ext)
    try:
        assert _frames(ext.fetcher_probe()[1]) == _frames(w0)   # the counting fetcher's text too
        assert sites.arm_error_sites(_EngineStub)
        with traced(counting):
            T.swallow(_x(), 4)
        assert counting.constructed_count() == 4
        assert ext.fetcher_probe()[0].endswith("SiteBacktrace")
        counting.close()
        assert ext.fetcher_probe()[0].endswith("SiteBacktrace")   # sites still armed
    finally:
        counting.close()
        sites.close()
    assert ext.fetcher_probe()[0] == t0 and ext.counter_users() == 0


def test_error_sites_disarmed_after_an_interrupted_trace(ext):
    """A trace left by KeyboardInterrupt restores c10's default fetcher and the engine's reader."""
    import tensorscope
    from tensorscope.recording.engines import _native_ext

    if ext.cpp_stacktraces or _native_ext(wait=True)[0] is None:
        pytest.skip("needs the native engine without TORCH_SHOW_CPP_STACKTRACES")
    t0, _ = ext.fetcher_probe()
    with pytest.raises(KeyboardInterrupt):
        with tensorscope.trace(engine="native", leaks=False):
            assert ext.fetcher_probe()[0].endswith("SiteBacktrace")
            raise KeyboardInterrupt
    assert ext.fetcher_probe()[0] == t0 and ext.site_count() == 0


def test_unbalanced_calls_are_harmless(ext):
    cap = NativeCapture(ext)
    try:
        assert cap.op_end() is None          # nothing open
        assert cap.call_end(12345) is None   # unknown token
        assert cap.error_info(None) is None
    finally:
        cap.close()




# ---------------------------------------------------------------------------
# build cache and failure paths
# ---------------------------------------------------------------------------

def test_build_cache_reused(ext):
    meta = _build.cached(_build.HOOKS)
    assert meta is not None and meta["seconds"] > 0
    code = textwrap.dedent("""
        import json, torch
        from tensorscope.native import _build
        mod, reason = _build.ensure(_build.HOOKS)
        print(json.dumps({"ok": mod is not None, "compiled": _build._STATES["hooks"].compiled, "reason": reason}))
    """)
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # loaded from the cache, not compiled (how long a load takes is measured nowhere in tests)
    assert r["ok"] and not r["compiled"] and "cache" in r["reason"], (r, meta)
    assert "tensorscope:" not in out.stderr   # no build message when nothing is built


def test_build_key_tracks_source():
    a = _build.build_key(_build.HOOKS, b"int a;")
    b = _build.build_key(_build.HOOKS, b"int b;")
    assert a != b and len(a) == 16 and a == _build.build_key(_build.HOOKS, b"int a;")
    assert _build.build_key(_build.test_ops_spec(TEST_OPS_CPP), b"int a;") != a


def test_build_failure_is_reported_and_remembered(tmp_path, monkeypatch, capfd):
    _skip_without_toolchain()
    src = tmp_path / "broken.cpp"
    src.write_text("this is not C++;\n")
    spec = _build.LibSpec("broken", "tensorscope_broken_test", str(src), True, "broken test library")
    monkeypatch.setenv("TENSORSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(_build._STATES, "broken", _build._LibState())
    mod, reason = _build.ensure(spec)
    assert mod is None and reason.startswith("build failed:") and "broken.cpp" in reason
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("tensorscope:")]
    assert len(lines) == 2 and "compiling" in lines[0] and "unavailable" in lines[1] and "fallback" in lines[1]
    d = _build.build_dir(spec)
    assert os.path.exists(os.path.join(d, "failed.json")) and os.path.exists(os.path.join(d, "build.log"))
    # A new process (fresh state) does not spend the compile time again.
    monkeypatch.setitem(_build._STATES, "broken", _build._LibState())
    mod, reason = _build.ensure(spec)
    assert mod is None and "earlier build failed" in reason and "--force" in reason
    assert "compiling" not in capfd.readouterr().err
    assert _build.lib_status(spec)["state"] == "fallback"


def test_no_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("TENSORSCOPE_CACHE", str(tmp_path / "cache"))
    spec = _build.LibSpec("nocxx", "tensorscope_nocxx_test", "hooks.cpp", True, "test library")
    monkeypatch.setitem(_build._STATES, "nocxx", _build._LibState())
    assert "no C++ compiler" in _build.lib_status(spec)["reason"]
    mod, reason = _build.ensure(spec, announce=False)
    assert mod is None and "no C++ compiler" in reason


def test_build_in_another_thread_does_not_block(monkeypatch):
    """While another thread compiles the hooks, a capture uses the fallback instead of waiting."""
    st = _build._LibState()
    monkeypatch.setitem(_build._STATES, "hooks", st)
    monkeypatch.delenv(tn.FORCE_ENV, raising=False)
    started, release = threading.Event(), threading.Event()

    def slow_load(spec, state, **kw):
        state.state, state.reason = "building", "compiling"
        started.set()
        release.wait(30)
        state.state, state.reason = "failed", "test: never built"

    monkeypatch.setattr(_build, "_load", slow_load)
    builder = threading.Thread(target=_build.ensure, args=(_build.HOOKS,), kwargs={"announce": False}, daemon=True)
    builder.start()
    assert started.wait(30)
    try:
        assert tn.status()["state"] == "building"
        c = tn.open_capture(native=True)
        try:
            assert c.native is False and "still compiling" in c.reason
        finally:
            c.close()
    finally:
        release.set()
        builder.join(60)
    assert not builder.is_alive() and st.state == "failed"


# ---------------------------------------------------------------------------
# fallback parsing, TORCH_SHOW_CPP_STACKTRACES
# ---------------------------------------------------------------------------

def test_split_triggered():
    assert split_triggered("msg (Triggered internally at /a/b/F.cpp:12.)") == ("msg", "/a/b/F.cpp", 12)
    assert split_triggered("plain") == ("plain", None, None)
    assert split_triggered("odd (Triggered internally at nowhere.)") == ("odd (Triggered internally at nowhere.)", None, None)


def test_cpp_stacktraces_env_subprocess(ext, T):
    """TORCH_SHOW_CPP_STACKTRACES=1 (set before importing torch): the fallback reads the
    C++ location from the message; the native message stays without backtrace."""
    code = textwrap.dedent(r"""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import torch, tensorscope.native as tn
        from tensorscope.native._capture import NativeCapture
        from tensorscope.native._fallback import FallbackCapture
        from tests.helpers.native_helpers import TEST_OPS_CPP, traced
        T = tn.load_test_ops(TEST_OPS_CPP)
        mod, _ = tn._build.ensure(tn._build.HOOKS)
        out = {}
        for name, make in (("fallback", FallbackCapture), ("native", lambda: NativeCapture(mod, cpp_errors=True))):
            cap = make()
            with traced(cap) as log:
                try:
                    T.raise_error(torch.ones(2), "index")
                except IndexError as e:
                    text = str(e)
                T.swallow(torch.ones(2), 2)
            out[name] = dict(log.op_errors[-1][2], raw=text, swallowed=cap.swallowed_count())
            cap.close()
        print(json.dumps(out))
    """)
    env = dict(os.environ, TORCH_SHOW_CPP_STACKTRACES="1", TORCH_DISABLE_ADDR2LINE="1")
    env.pop(tn.FORCE_ENV, None)
    out = subprocess.run([PY, "-c", code, ROOT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    line = cpp_line_of('"tensorscope_test: c10::IndexError raised')
    fb, nat = r["fallback"], r["native"]
    assert "Exception raised from" in fb["raw"]
    assert fb["native"] is False and fb["cpp_type"] == "c10::IndexError"
    assert os.path.basename(fb["cpp_file"]) == "test_ops.cpp" and fb["cpp_line"] == line
    assert fb["cpp_function"] == "raise_error" and fb["message"] == "tensorscope_test: c10::IndexError raised"
    assert nat["native"] is True and nat["message"] == fb["message"] and nat["cpp_line"] == line
    assert nat["swallowed"] == 2


def test_cpp_stacktraces_native_engine_subprocess(ext):
    """TORCH_SHOW_CPP_STACKTRACES=1: torch's own fetcher stays (sites are not armed), the
    message is untraced's, and the location comes from it under both engines."""
    code = textwrap.dedent(r"""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import torch, tensorscope
        from tensorscope.native import _build
        mod, _ = _build.ensure(_build.HOOKS)
        def run():
            try:
                torch.randn(2, 3) @ torch.randn(4, 5)
            except RuntimeError as e:
                return str(e)
        before = mod.fetcher_probe()[0]
        untraced = run()
        out = {"before": before, "untraced_head": untraced.splitlines()[0]}
        for eng in ("python", "native"):
            with tensorscope.trace(engine=eng, leaks=False) as t:
                text = run()
            [e] = [e for e in t.errors.to_pylist() if e["kind"] == "exception"]
            out[eng] = dict(e, raw_head=text.splitlines()[0], raised_from="Exception raised from" in text,
                            fetcher=mod.fetcher_probe()[0])
        print(json.dumps(out))
    """)
    env = dict(os.environ, TORCH_SHOW_CPP_STACKTRACES="1", TORCH_DISABLE_ADDR2LINE="1")
    env.pop(tn.FORCE_ENV, None)
    out = subprocess.run([PY, "-c", code, ROOT], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert "PrecomputedLazyValue" in r["before"]          # torch's eager fetcher
    for eng in ("python", "native"):
        e = r[eng]
        assert e["fetcher"] == r["before"] and e["raised_from"] and e["raw_head"] == r["untraced_head"]
        assert e["message"] == r["untraced_head"] and e["cpp_type"] == "c10::Error"
        assert e["cpp_file"].endswith("LinearAlgebra.cpp") and e["cpp_line"] > 0
    assert (r["python"]["cpp_file"], r["python"]["cpp_line"]) == (r["native"]["cpp_file"], r["native"]["cpp_line"])


def test_test_ops_cpp_lines_exist():
    for _kind, _t, _c, fragment in ERROR_KINDS:
        cpp_line_of(f'"tensorscope_test: {fragment}')
    assert os.path.exists(TEST_OPS_CPP)
