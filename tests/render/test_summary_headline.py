"""The cell summary leads with what to act on: the headline ranking, the totals line, the text order, predictions,
the module table, op totals (the ``key_averages()`` equivalent) and the standalone report. Real traces throughout."""
from __future__ import annotations

import re

import pyarrow.compute as pc
import pytest
import torch

import tensorscope
from tensorscope._trace import Trace
from tensorscope.analyses.headline import headline
from tensorscope.render.summary import modules_section, summarize


def _text_lines(t):
    return t.summary().to_text().splitlines()


def test_an_exception_is_the_first_line_with_its_op_and_place():
    with pytest.raises(RuntimeError), tensorscope.trace() as t:
        torch.ones(2) @ torch.ones(3)
    lines = _text_lines(t.result)
    assert lines[0] == "tensorscope trace: 1 thing to look at first"
    assert lines[1].startswith("  1. RuntimeError: inconsistent tensor size") and "aten.dot.default" in lines[1]
    assert "test_summary_headline.py:" in lines[1] and lines[1].endswith("raised")


def test_nan_produced_ranks_before_performance_and_a_clean_cell_says_so_in_one_line():
    with tensorscope.trace(leaks=False) as t:
        x = torch.zeros(3) - 1
        y = torch.log(x)   # NaN from finite inputs
    lines = _text_lines(t.result)
    assert "1. NaN/Inf produced from finite inputs by aten.log.default" in lines[1]
    assert "3 non-finite values in 1 op" in lines[1]
    with tensorscope.trace(leaks=False) as t:
        torch.ones(4) + 1
    first = _text_lines(t.result)
    assert first[0].startswith("tensorscope trace: clean — no exception, no NaN/Inf produced, no leak")
    assert re.match(r"  \d+ ops \(\d+ forward, 0 backward\) · .* in ops of .* wall "
                    r"(· waited .* for a CPU \(a busy machine\) )?· peak ", first[1]), first[1]
    html = t.result.summary().to_html()
    assert '<span class="ts-ok">clean' in html and "<details><summary>" in html


def test_a_growing_leak_is_one_line_for_its_container_above_performance():
    m = torch.nn.Linear(256, 256)
    kept = []
    with tensorscope.trace() as t:
        for _ in range(4):
            kept.append(m(torch.randn(64, 256)).sum())   # each loss keeps its graph (64 KiB of activations)
    head = summarize(t.result).head
    leak = [d for d in head.lines if d["kind"] == "leak"]
    assert len(leak) == 1 and head.lines[0] is leak[0]
    assert re.search(r"held by .*\bkept \(4 items\)$", leak[0]["what"]) and "growing 64.0 KiB" in leak[0]["how_much"]
    assert leak[0]["fix"] and "item()" in leak[0]["fix"]
    assert len(head.lines) <= 5
    # the same trace: the same lines
    assert summarize(t.result).head.lines == head.lines


def test_ranking_orders_by_severity_then_measured_cost_and_drops_noise():
    with tensorscope.trace() as t:
        a = torch.randn(64, 64)
        for _ in range(3):
            a = a @ a
    r = t.result
    adv = r.advice()
    op_ns = pc.sum(r.ops.column("cpu_ns")).as_py()
    lines = headline(errors=r.errors, verdicts=[], leaks=r.leaks, findings=adv.findings, op_ns=op_ns)
    costs = [d["cost_ns"] for d in lines if d["rank"] == 3]
    assert costs == sorted(costs, reverse=True)
    assert all(c >= 0.01 * op_ns for c in costs)    # below 1% of op time is not a headline
    # nothing at all above an impossible floor; a prediction never gets a timing-based line
    assert headline(errors=r.errors, verdicts=[], leaks=r.leaks, findings=adv.findings, op_ns=op_ns,
                    min_share=2.0) == []
    assert headline(errors=r.errors, verdicts=[], leaks=r.leaks, findings=adv.findings, op_ns=op_ns,
                    predicted=True) == []


def test_a_prediction_says_so_first_and_in_every_section():
    with tensorscope.trace(leaks=False) as t:
        torch.nn.Linear(8, 8)(torch.randn(4, 8)).sum()
    r = t.result
    p = Trace(r.tables, r.metadata.replace(predicted=True))
    text = p.summary().to_text().splitlines()
    assert text[0].startswith("PREDICTED (FakeTensorMode") and "predicted in ops" in text[1]
    titles = [ln for ln in text if ln.startswith("== ")]
    assert titles and all(ln.endswith("(predicted) ==") for ln in titles)
    html = p.summary().to_html()
    assert '<span class="ts-pred">PREDICTED' in html
    assert all(s.endswith("(predicted)") for s in re.findall(r"<details><summary>([^<]*)</summary>", html))


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
        self.dec = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.dec(self.enc(x))


def test_the_module_table_lists_every_top_level_module_the_same_way_each_run():
    m = Two()
    runs = []
    for _ in range(3):
        with tensorscope.trace(leaks=False) as t:
            m(torch.randn(8, 16)).sum().backward()
        runs.append(modules_section(t.result))
    for sec in runs:
        assert sorted(r[0] for r in sec.rows) == ["dec", "enc"]   # the top level, whatever took longest
        kids = dict(sec.children)
        assert {k.split(":")[0] for k in kids} == {"enc", "dec"}
        enc = next(v for k, v in kids.items() if k.startswith("enc:"))
        assert sorted(r[0].strip() for r in enc) == ["enc.0", "enc.1", "enc.2"]
    # within one trace, rows are sorted by total time, ties by name (analyses.totals.module_totals)
    from tensorscope.analyses.totals import module_totals

    mt = [r for r in module_totals(t.result.ops).to_pylist() if r["depth"] == 0]
    assert [r["module"] for r in mt] == [r["module"] for r in sorted(mt, key=lambda r: (-r["total_ns"], r["module"]))]
    assert [r[0] for r in runs[-1].rows] == [r["module"] for r in mt]
    html = summarize(t.result).to_html()
    assert '<details class="ts-sub"><summary>enc: 3 submodules</summary>' in html


def test_op_totals_is_key_averages():
    with tensorscope.trace(leaks=False) as t:
        a = torch.randn(32, 32)
        for _ in range(5):
            a = torch.relu(a @ a)
    r = t.result
    tot = r.op_totals()
    ops = [o for o in r.ops.to_pylist() if not o["is_noise"]]
    by = {}
    for o in ops:
        by.setdefault(o["op"], []).append(o["cpu_ns"])
    got = {row["op"]: row for row in tot.to_pylist()}
    assert set(got) == set(by)
    for op, ns in by.items():
        assert got[op]["calls"] == len(ns) and got[op]["cpu_ns"] == sum(ns) and got[op]["max_cpu_ns"] == max(ns)
    assert tot.column("cpu_ns").to_pylist() == sorted(tot.column("cpu_ns").to_pylist(), reverse=True)
    assert got["aten.mm.default"]["calls"] == 5 and got["aten.mm.default"]["flops"] == 5 * 2 * 32 ** 3
    assert abs(sum(tot.column("share").to_pylist()) - 1.0) < 1e-9
    shapes = r.op_totals(by=("op", "in_shapes"))
    assert "[32, 32], [32, 32]" in shapes.filter(pc.equal(shapes.column("op"), "aten.mm.default")).column(
        "in_shapes").to_pylist()
    with pytest.raises(KeyError, match="no ops column 'nope'"):
        r.op_totals(by="nope")


class Evil(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module("<img src=x onerror=alert(1)>", torch.nn.Linear(64, 64))

    def forward(self, x):
        return getattr(self, "<img src=x onerror=alert(1)>")(x)


def test_report_is_one_standalone_escaped_page_with_everything_open(tmp_path):
    m = Evil()
    with tensorscope.trace(leaks=False) as t:
        m(torch.randn(128, 64)).sum().backward()
    path = t.result.report(tmp_path / "cell.html")
    page = open(path, encoding="utf-8").read()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "<details open>" in page and "<details>" not in page
    assert page.count("<svg") >= 3 and "<title>aten.addmm.default · forward" in page   # inline, with hovers
    from tensorscope.errors import ExportError

    with pytest.raises(ExportError, match="cannot write the report"):
        t.result.report(tmp_path / "missing" / "dir" / "cell.html")


def test_a_containers_leaked_elements_get_one_fix_that_releases_them_all():
    """Each leaked element's row says ``del kept[i]``; the container's one headline line gives one fix
    for all of them (here a slice), and running it frees every storage the line counts."""
    import gc
    import weakref

    from tensorscope.tracking.leaks import fix_code

    m = torch.nn.Linear(16, 16)
    kept = [m(torch.randn(4, 16)).sum().detach()]   # from before the trace: not this cell's to release
    with tensorscope.trace() as t:
        for _ in range(3):
            loss = m(torch.randn(4, 16)).sum()
            loss.backward()   # frees the graph: each loss keeps its own 4 bytes
            kept.append(loss)
        del loss
    (leak,) = [d for d in summarize(t.result).head.lines if d["kind"] == "leak"]
    assert re.search(r"held by .*\bkept \(3 items\)$", leak["what"]), leak
    assert [r["fix"].split("  (")[0] for r in t.result.leaks.to_pylist() if not r["expected"]] == \
        ["del kept[3]", "del kept[2]", "del kept[1]"]
    assert leak["fix"].split("  (")[0] == "del kept[1:4]"
    refs = [weakref.ref(x.untyped_storage()) for x in kept]
    exec(fix_code(leak["fix"]), {}, scope := {"kept": kept})
    gc.collect()
    assert scope["kept"] is kept and len(kept) == 1   # the earlier element stays
    assert [r() is None for r in refs] == [False, True, True, True]
