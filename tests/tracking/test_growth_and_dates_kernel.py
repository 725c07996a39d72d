"""Growth, values and creation dates in a real ipykernel (issue 29).

- ``loss = …; losses.append(loss)`` cell after cell: the old loss is alive, but ``losses`` holds
  it, not ``loss``: ``global loss`` is never "growing 4 B/cell".
- a still-alive 4 B ``loss`` with no graph is a value (kind ``value``), not a leak finding.
- tensors made before ``enable_discovery()`` are never dated with the cell that enabled it.
"""
from __future__ import annotations

import pytest

from tests.helpers.kernel_utils import Kernel

pytestmark = pytest.mark.kernel

SETUP = r'''
%load_ext tensorscope
import torch
import tensorscope
import tensorscope.tracking.leaks as L
'''


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    kern = Kernel(cwd=str(tmp_path_factory.mktemp("growth")))
    r = kern.run(SETUP)
    assert r.status == "ok", r.error
    yield kern
    kern.close()


def ok(k, code):
    r = k.run(code)
    assert r.status == "ok", (code, r.error)
    return r


def test_a_rebound_scalar_whose_old_value_another_holder_keeps_is_not_growing(k):
    ok(k, "m = torch.nn.Linear(32, 1)\nxs = torch.randn(64, 32)\nhist = []")
    ok(k, "%tensorscope on -q")
    try:
        for _ in range(3):
            ok(k, "loss = m(xs).pow(2).mean()\nloss.backward()\nhist.append(loss.detach())")
    finally:
        ok(k, "%tensorscope off")
    rows = k.value("[(r['holder'], r['holder_kind'], r['growing'], r['growth_bytes_per_cell'], r['expected']) "
                   "for r in tensorscope.last().leaks.to_pylist()]")
    loss = [r[1:] for r in rows if r[0].startswith("global loss")]   # "global loss; also global hist[2]"
    # before: ("global", True, 4, False): the old loss is alive, but in hist
    assert loss == [("value", False, None, True)], rows
    text = k.value("tensorscope.last().summary().to_text()")
    assert "growing 4 B" not in text and "global loss " not in text and "global loss\n" not in text, text
    # the whole-notebook report: nothing here grew by 4 B a cell
    groups = k.value("[(g.holder, g.holder_kind, g.growth_bytes) for g in L.find_leaks(shell=get_ipython()).groups "
                     "if g.holder.startswith(('global loss', 'global hist'))]")
    assert groups and all(g[2] is None for g in groups), groups
    ok(k, "del m, xs, hist, loss")


def test_tensors_made_before_discovery_are_not_dated_with_its_cell(k):
    n1 = ok(k, "early = torch.zeros(43_210)").execution_count
    n2 = ok(k, "L.enable_discovery(get_ipython())\nsame_cell = torch.zeros(12_345)").execution_count
    try:
        n3 = ok(k, "late = torch.zeros(23_456)").execution_count
        assert n1 < n2 < n3
        rows = k.value("{r['holder']: r['cell'] for r in L.find_leaks(shell=get_ipython()).table.to_pylist() "
                       "if r['holder'] in ('global early', 'global same_cell', 'global late')}")
        # before: early and same_cell were dated n2 (the enabling cell's scan saw the whole heap)
        assert rows == {"global early": None, "global same_cell": None, "global late": n3}, rows
        notes = k.value("L.find_leaks(shell=get_ipython()).notes")
        assert any(f"made before discovery was enabled (in cell {n2})" in n for n in notes), notes
    finally:
        ok(k, "L.disable_discovery(get_ipython())\ndel early, same_cell, late")


def test_a_graph_chained_across_cells_is_growing_with_its_own_number(k):
    ok(k, "m2 = torch.nn.Linear(32, 256)\nxs2 = torch.randn(64, 32)\ntotal = 0")
    ok(k, "%tensorscope on -q")
    try:
        for _ in range(3):   # `total = total + loss`: each cell's graph keeps every earlier one
            ok(k, "total = total + m2(xs2).relu().mean()")
    finally:
        ok(k, "%tensorscope off")
    rows = k.value("[(r['holder_kind'], r['growing'], r['growth_bytes_per_cell'], r['nbytes']) "
                   "for r in tensorscope.last().leaks.to_pylist() if r['holder'].startswith('global total')]")
    graph = [r for r in rows if r[0] == "autograd_graph"]
    assert graph and all(g and b >= 64 * 256 * 4 for _k, g, b, _n in graph), rows
    # the 4 B total itself: a name binds one tensor, it never keeps the old one (not "growing 4 B/cell")
    assert all(not g for kind, g, _b, _n in rows if kind != "autograd_graph"), rows
    ok(k, "del m2, xs2, total")
