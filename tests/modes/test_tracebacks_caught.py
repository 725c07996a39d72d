"""An exception caught *inside* a traced block has the untraced traceback.

``F.softmax`` (a Python-level torch function) hands itself to the function mode through
``torch.overrides.handle_torch_function``; the exception it raises then unwinds through
``handle_torch_function`` and the first ``F.softmax`` call, two entries untraced code never
has, which are created only after the mode re-raised. ``frames.clean_when_caught`` removes
them when the exception reaches the user's frame, before an ``except`` there runs. Each case
runs the same function untraced and traced and compares ``traceback.format_exception``.
"""
from __future__ import annotations

import sys
import traceback

import pytest
import torch
import torch.nn.functional as F

import tensorscope
from tensorscope.recording import frames


def _softmax_bad():
    return F.softmax(torch.randn(2, 3), dim=5)


def caught_here():
    try:
        F.softmax(torch.randn(2, 3), dim=5)
    except IndexError as e:
        return traceback.format_exception(e), [f.name for f in traceback.extract_tb(e.__traceback__)]


def caught_above():
    try:
        _softmax_bad()
    except IndexError as e:
        return traceback.format_exception(e), [f.name for f in traceback.extract_tb(e.__traceback__)]


def caught_twice():
    out = []
    for dim in (5, 7):
        try:
            F.log_softmax(torch.randn(2, 3), dim=dim)
        except IndexError as e:
            out.append(traceback.format_exception(e))
    x = torch.ones(2)   # runs on normally after the handler
    return out, float(x.sum())


#: a debugger or coverage tool owns sys.settrace: tensorscope then leaves the caught traceback as it is
needs_no_tracer = pytest.mark.skipif(sys.gettrace() is not None, reason="a trace function is installed "
                                     "(debugger, coverage): the caught-exception watch stays off")


@needs_no_tracer
@pytest.mark.parametrize("fn", [caught_here, caught_above, caught_twice])
def test_caught_inside_the_block_formats_as_untraced(fn):
    untraced = fn()
    with tensorscope.trace(leaks=False) as t:
        traced = fn()
    assert traced == untraced
    assert "handle_torch_function" not in repr(traced) and "tensorscope" not in repr(traced)
    assert t.errors.num_rows >= 1          # the error was recorded all the same
    assert sys.gettrace() is None          # the one-shot watch is gone


@needs_no_tracer
def test_the_frames_are_the_untraced_ones():
    (_text, names) = caught_here()
    assert names == ["caught_here", "softmax"]
    with tensorscope.trace(leaks=False):
        (_text, traced) = caught_here()
    assert traced == names


def test_without_the_watch_the_entries_would_show(monkeypatch):
    """The comparison above can fail: with the watch off the caught traceback has both entries."""
    monkeypatch.setattr(frames, "clean_when_caught", lambda depth: None)
    monkeypatch.setattr("tensorscope.recording.function.clean_when_caught", lambda depth: None)
    with tensorscope.trace(leaks=False):
        (_text, names) = caught_here()
    assert names == ["caught_here", "softmax", "handle_torch_function", "softmax"]


@needs_no_tracer
def test_uncaught_in_the_block_still_leaves_it_clean():
    def f():
        with tensorscope.trace(leaks=False):
            _softmax_bad()

    with pytest.raises(IndexError) as info:
        f()
    names = [x.name for x in traceback.extract_tb(info.value.__traceback__)]
    assert names[-3:] == ["f", "_softmax_bad", "softmax"]
    assert sys.gettrace() is None


@needs_no_tracer
def test_a_users_trace_function_is_left_alone():
    """A debugger or coverage tool owns sys.settrace: no watch is armed, its tracer stays, and the
    caught traceback keeps the two entries (the outer layers still clean what leaves the block)."""
    events = []

    def tracer(frame, event, arg):
        if event == "exception" and frame.f_code is caught_here.__code__:
            events.append(arg[0].__name__)
        return tracer

    sys.settrace(tracer)
    try:
        with tensorscope.trace(leaks=False):
            (_text, names) = caught_here()
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert events == ["IndexError"]
    assert names == ["caught_here", "softmax", "handle_torch_function", "softmax"]


@needs_no_tracer
def test_the_watched_frame_gets_its_trace_settings_back():
    seen = {}

    def probe():
        f = sys._getframe()
        try:
            F.softmax(torch.randn(2, 3), dim=5)
        except IndexError:
            seen["after"] = (f.f_trace, f.f_trace_lines, f.f_trace_opcodes)
        return f

    untraced = sys._getframe()
    with tensorscope.trace(leaks=False):
        probe()
    assert seen["after"] == (None, True, False)
    assert untraced.f_trace is None and sys.gettrace() is None


@needs_no_tracer
@pytest.mark.kernel
def test_caught_inside_a_traced_cell_formats_as_untraced(tmp_path):
    """In a real kernel: the same cell untraced and under ``%%tensorscope``, caught in the cell."""
    from tests.helpers.kernel_utils import Kernel

    k = Kernel(cwd=str(tmp_path))
    try:
        r = k.run("%load_ext tensorscope\nimport traceback, torch\nimport torch.nn.functional as F")
        assert r.status == "ok", r.error
        body = ("try:\n    F.softmax(torch.randn(2, 3), dim=5)\nexcept IndexError as e:\n"
                "    text = [l for l in traceback.format_exception(e) if 'Cell In' not in l and '/tmp/' not in l]\n"
                "    names = [f.name for f in traceback.extract_tb(e.__traceback__)]")
        r = k.run("# %%tensorscope -q\n" + body)
        assert r.status == "ok", r.error
        untraced = k.value("(names, text)")
        r = k.run("%%tensorscope -q\n" + body)
        assert r.status == "ok", r.error
        traced = k.value("(names, text)")
        assert traced == untraced
        assert untraced[0] == ["<module>", "softmax"]
        assert k.value("__import__('sys').gettrace() is None")
    finally:
        k.close()
