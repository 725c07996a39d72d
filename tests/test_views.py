"""The display objects: the memory views are TableViews (compact, escaped tables that still answer as the
pyarrow.Table they wrap), the plots display as PNG; checked in process and, for what a notebook shows,
in a real ipykernel through jupyter_client (the mime types of execute_result)."""
from __future__ import annotations

import base64

import pyarrow as pa
import pytest
import torch

import tensorscope
from tensorscope.render.views import HEAD, TAIL, TableView
from tests.helpers.kernel_utils import Kernel

PNG = b"\x89PNG\r\n\x1a\n"


def _trace():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    x = torch.randn(4, 8)
    with tensorscope.trace() as tr:
        m(x).sum().backward()
    return tr.result


def test_views_are_tables_that_display():
    t = _trace()
    for view, schema in ((t.memory_timeline, "memory_timeline"), (t.memory_at(), "memory_at"),
                         (t.module_memory, "module_memory"), (t.allocator_timeline, "allocator_timeline")):
        assert isinstance(view, TableView)
        table = view.to_arrow()
        assert isinstance(table, pa.Table)
        from tensorscope import schema as S

        assert table.schema.names == getattr(S, schema.upper()).names
        # what callers did with the pyarrow.Table still works on the view
        assert view.num_rows == table.num_rows == len(view)
        assert view.to_pylist() == table.to_pylist()
        assert view.equals(table) and view == table and view.equals(view)
        assert pa.table(view).equals(table)           # the Arrow C stream
        assert view.column_names == table.column_names
        df = view.to_pandas()
        assert list(df.columns) == table.column_names and len(df) == table.num_rows
        text, html = repr(view), view._repr_html_()
        assert text.splitlines()[0].startswith(f"t.{schema}") and f"{table.num_rows} row" in text.splitlines()[0]
        assert ".to_arrow()" in text and ".to_pandas()" in html
    tl = t.memory_timeline
    assert tl.num_rows > HEAD + TAIL + 1
    assert f"… {tl.num_rows - HEAD - TAIL} more rows" in repr(tl)
    body = tl._repr_html_().split("<tbody>")[1]
    assert body.count("<tr>") == HEAD + TAIL + 1
    peak = [r for r in tl.to_pylist() if r["is_peak"]]
    assert len(peak) == 1 and tl.filter(tl.column("is_peak")).to_pylist() == peak
    # a category with no bytes anywhere is named, not drawn as a column of zeros
    zero = [c for c in tl.column_names if c.endswith("_bytes") and not any(tl.column(c).to_pylist())]
    assert zero and all(f"<th>{c}</th>" not in tl._repr_html_() for c in zero)
    assert ", ".join(zero) in repr(tl)
    adv = t.advice()   # the advisor's result: its findings as the views give their table
    assert adv.to_arrow() is adv.findings and list(adv.to_pandas().columns) == adv.findings.column_names
    # memory_at(seq) out of range stays an IndexError
    with pytest.raises(IndexError):
        t.memory_at(t.ops.num_rows)


def test_view_escapes_and_formats():
    table = pa.table({"module": ["<script>alert(1)</script>", "x" * 100], "bytes": [3 * 2**20, None],
                      "cpu_ns": [1_500_000, 10], "is_peak": [True, False], "empty": pa.array([None, None], pa.int64())})
    v = TableView(table, "a <b>title</b>", ("note & more",))
    html = v._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;" in html and "a &lt;b&gt;title&lt;/b&gt;" in html
    assert "note &amp; more" in html and "3.0 MiB" in html and "1.50 ms" in html and "yes" in html
    assert "x" * 100 not in html and "…" in html
    assert "<th>empty</th>" not in html and "not shown (empty or all zero): empty" in html
    assert "2 rows x 5 columns" in repr(v)
    empty = TableView(table.slice(0, 0), "nothing")
    assert "(no rows)" in repr(empty) and "(no rows)" in empty._repr_html_()


def test_plots_are_figures_with_a_png_display():
    from matplotlib.figure import Figure

    t = _trace()
    for fig in (t.plot.memory(), t.plot.timeline(), t.plot.top_ops(), t.plot.modules(), t.plot()):
        assert isinstance(fig, Figure)
        assert fig._repr_png_().startswith(PNG)
        assert not repr(fig).startswith("<Figure size")


_SETUP = ("import torch, tensorscope\n"
          "m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))\n"
          "with tensorscope.trace() as tr:\n"
          "    m(torch.randn(4, 8)).sum().backward()\n"
          "t = tr.result")


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["", "Agg"], ids=["kernel-default-backend", "Agg"])
def test_kernel_displays(tmp_path, backend):
    """What a notebook gets: the execute_result's mime bundle of each display object, in a real kernel with
    its default matplotlib backend (MPLBACKEND unset: ipykernel's inline backend, no %matplotlib) and Agg."""
    k = Kernel(cwd=str(tmp_path), env={"MPLBACKEND": backend})
    try:
        r = k.run(_SETUP)
        assert r.status == "ok", r.error
        seen = {}
        for expr in ("t.plot.memory()", "t.plot.timeline()", "t.plot.top_ops()", "t.plot.modules()",
                     "t.memory_timeline", "t.memory_at()", "t.module_memory", "t.allocator_timeline",
                     "t.advice()"):
            r = k.run(expr)
            assert r.status == "ok", (expr, r.error)
            assert len(r.results) == 1 and not r.displays, expr
            seen[expr] = data = r.results[0]
            assert not data["text/plain"].startswith("<Figure size"), (expr, data["text/plain"])
            assert "pyarrow.Table" not in data["text/plain"].splitlines()[0], expr
            if expr.startswith("t.plot"):
                assert base64.b64decode(data["image/png"]).startswith(PNG), expr
                assert "tensorscope plot" in data["text/plain"]
            else:
                assert "text/html" in data, expr
        for expr in ("t.memory_timeline", "t.memory_at()", "t.module_memory", "t.allocator_timeline"):
            assert '<div class="ts-view-cap">' in seen[expr]["text/html"], expr
            assert seen[expr]["text/plain"].startswith(expr.split("(")[0]), expr
        assert '<table class="ts-view">' in seen["t.memory_timeline"]["text/html"]
        # the plain table is one call away, and `%matplotlib inline` changes nothing (one PNG)
        assert k.value("type(t.memory_at().to_arrow()).__name__") == "Table"
        r = k.run("%matplotlib inline\nt.plot.memory()")
        assert r.status == "ok" and len(r.results) == 1 and not r.displays
        assert base64.b64decode(r.results[0]["image/png"]).startswith(PNG)
    finally:
        k.close()
