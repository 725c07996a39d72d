"""An exception that leaves a traced block is recorded where the user's code raised it
(modes/source.py: user_traceback_location, shared by the session and check_substitution)."""
from __future__ import annotations

import pytest
import torch

import tensorscope
from tensorscope.modes.source import user_traceback_location


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
