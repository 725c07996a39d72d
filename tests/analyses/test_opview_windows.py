"""The advisor's window views: a window that is one slice keeps its views (a small trace is read once
per kind of view, not once per finding); a bigger one is read a slice at a time each time."""
from __future__ import annotations

from types import MappingProxyType

import numpy as np
import torch

import tensorscope
from tensorscope.analyses.advisor import advise_tables
from tensorscope.analyses.opview import views, window_views


def _ops():
    a = torch.randn(6, 6)
    with tensorscope.trace() as tr:
        for _ in range(20):
            a = (a @ a).relu().add(1).sum(0, keepdim=True).expand(6, 6).contiguous()
    return tr.result


def _same(got, want) -> None:
    got, want = list(got), list(want)
    assert [v.offset for v in got] == [v.offset for v in want]
    for g, w in zip(got, want):
        assert g.names == w.names
        assert np.array_equal(g.codes, w.codes) and np.array_equal(g.noise, w.noise) and np.array_equal(g.seq, w.seq)


def test_a_one_slice_window_keeps_its_views_a_bigger_one_does_not():
    t = _ops()
    n = t.ops.num_rows
    for warm in (False, True):
        win = {"ops": t.ops, "batch_rows": None}
        first = window_views(win, warm)
        assert window_views(win, warm) is first, "kept"
        _same(first, views(t.ops, None, warm))
        small = {"ops": t.ops, "batch_rows": n // 3}
        got = window_views(small, warm)
        assert not isinstance(got, list) and "_views" not in small, "nothing per row kept"
        _same(got, views(t.ops, n // 3, warm))
    # a window the caller does not let the advisor write into: read as views, nothing kept
    assert not isinstance(window_views(MappingProxyType({"ops": t.ops}), False), list)


def test_the_advice_equals_whatever_the_slices():
    t = _ops()
    win = {"ops": t.ops, "calls": t.calls, "tensors": t.tensors, "metadata": t.metadata}
    whole = advise_tables([win], {}, min_share=0.0)
    for rows in (7, 64, t.ops.num_rows):
        got = advise_tables([win], {}, min_share=0.0, batch_rows=rows)
        assert got["findings"].equals(whole["findings"]) and got["op_ns"] == whole["op_ns"], rows
