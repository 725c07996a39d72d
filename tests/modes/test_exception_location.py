"""An exception that leaves a traced block is recorded where the user's code raised it
(recording/source.py: user_traceback_location, shared by the session and check_substitution)."""
from __future__ import annotations

import pytest
import torch

import tensorscope
from tensorscope import native
from tensorscope.recording.source import user_traceback_location


def _boom():
    raise ValueError("boom")


def test_the_session_records_the_users_raise_line():
    with pytest.raises(ValueError, match="boom"):
        with tensorscope.trace(leaks=False) as t:
            torch.ones(2) + 1
            _boom()
    rows = [r for r in t.errors.to_pylist() if r["kind"] == "exception"]
    assert len(rows) == 1 and rows[0]["py_type"] == "ValueError" and rows[0]["op"] is None
    assert (rows[0]["source_file"], rows[0]["source_line"]) == (__file__, _boom.__code__.co_firstlineno + 1)


def test_the_innermost_entry_outside_torch_and_tensorscope_is_the_location():
    def raise_in_torch():
        torch.ones(2).view(3)   # raises inside torch: the user's entry is this line

    try:
        raise_in_torch()
    except RuntimeError as e:
        tb = e.__traceback__
    assert user_traceback_location(tb) == (__file__, raise_in_torch.__code__.co_firstlineno + 1)
    assert user_traceback_location(None) == (None, None)


def _mismatched_matmul():
    return torch.randn(2, 3) @ torch.randn(4, 5)   # the user's line: raises in a c10 kernel


@pytest.mark.parametrize("engine", ["python", "native"])
def test_kernel_error_has_the_user_line_and_the_cpp_location(engine):
    """Both engines: where the user called (source_*) and where C++ raised (cpp_*), with the
    c10 class; the exception the user gets is the untraced one."""
    with pytest.raises(RuntimeError) as ei:
        _mismatched_matmul()
    untraced = (str(ei.value), [(f.name, f.lineno) for f in ei.traceback[1:]])
    with tensorscope.trace(engine=engine, leaks=False) as t:
        with pytest.raises(RuntimeError) as ei:
            _mismatched_matmul()
    assert (str(ei.value), [(f.name, f.lineno) for f in ei.traceback[1:]]) == untraced
    [row] = [r for r in t.errors.to_pylist() if r["kind"] == "exception"]
    assert (row["source_file"], row["source_line"]) == (__file__, _mismatched_matmul.__code__.co_firstlineno + 1)
    assert row["py_type"] == "RuntimeError" and row["message"] == untraced[0] and row["op"] == "aten.mm.default"
    if native.forced_fallback():   # the pure-Python capture sees the Python exception only
        assert row["cpp_type"] is row["cpp_file"] is None and row["native"] is False
        return
    assert row["cpp_type"] == "c10::Error" and row["native"] is True
    assert row["cpp_file"].endswith("LinearAlgebra.cpp") and row["cpp_line"] > 0 and row["cpp_function"]


@pytest.mark.parametrize("engine", ["python", "native"])
def test_python_error_has_no_cpp_location(engine):
    """An exception raised in Python inside a traced call never borrows a C++ location, even
    right after a kernel error."""
    with pytest.raises(ValueError):
        with tensorscope.trace(engine=engine, leaks=False) as t:
            try:
                _mismatched_matmul()
            except RuntimeError:
                pass
            _boom()
    rows = [r for r in t.errors.to_pylist() if r["kind"] == "exception"]
    assert [r["py_type"] for r in rows] == ["RuntimeError", "ValueError"]
    assert rows[1]["cpp_type"] is rows[1]["cpp_file"] is rows[1]["cpp_line"] is None
