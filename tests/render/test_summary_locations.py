"""One location format everywhere: a cell's ops read ``Cell In[N], line M`` in the text summary, the report's hover
titles and the Perfetto export, never ipykernel's temp file name (``3280276230.py:4``)."""
from __future__ import annotations

import json

import torch

import tensorscope
from tensorscope._trace import Trace
from tensorscope.render.perfetto import trace_events

CELL_FILE = "/tmp/ipykernel_4242/3280276230.py"   # how ipykernel names a cell's code
CODE = ("with tensorscope.trace(leaks=False) as t:\n"
        "    w = torch.randn(256, 256, requires_grad=True)\n"
        "    y = (w @ w).relu()\n"
        "    y.sum().backward()\n"
        "    z = torch.log(torch.zeros(4) - 1)\n")


def _cell_trace():
    ns = {"torch": torch, "tensorscope": tensorscope}
    exec(compile(CODE, CELL_FILE, "exec"), ns)
    r = ns["t"].result
    assert CELL_FILE in set(r.ops.column("source_file").to_pylist())
    return Trace(r.tables, r.metadata.replace(cell_files={CELL_FILE: 7}))   # the map a notebook trace carries


def test_text_report_hovers_and_perfetto_say_cell_in_n(tmp_path):
    t = _cell_trace()
    text = t.summary().to_text()
    assert "Cell In[7], line 5" in text.splitlines()[1]   # the NaN headline line names the cell
    page = open(t.report(tmp_path / "r.html"), encoding="utf-8").read()
    assert "Cell In[7], line 3" in page and "3280276230" not in page   # hovers, tables, memory peak
    assert "<title>aten.mm.default · forward" in page
    doc = trace_events(t)
    lines = {e["args"].get("line") for e in doc["traceEvents"] if isinstance(e.get("args"), dict) and e["args"].get("line")}
    assert "Cell In[7], line 3" in lines and not any("3280276230" in x for x in lines)
    assert "3280276230" not in json.dumps(doc).replace(CELL_FILE, "")   # only the raw file column keeps the name
