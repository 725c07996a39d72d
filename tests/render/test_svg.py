"""The summary's inline SVG views (timeline, icicle), their legends, escaping, and time per module."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

import tensorscope
from tensorscope.render.summary import modules_section
from tensorscope.render.svg import COLORS, icicle_svg, icicle_tree, timeline_svg
from tests.helpers import ROOT


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
        self.heads = torch.nn.ModuleDict({"<img src=x onerror=alert(1)>": torch.nn.Linear(8 * 4 * 4, 3)})

    def forward(self, x):
        return self.heads["<img src=x onerror=alert(1)>"](self.features(x).flatten(1))


def _trace():
    m = Net()
    with tensorscope.trace(leaks=False) as t:
        m(torch.randn(2, 3, 8, 8)).sum().backward()
    return t.result


def _fills(svg):
    # data marks are the rects with a hover title (timeline: title inside, icicle: title before in its <g>)
    bars = set(re.findall(r'fill="(#[0-9a-f]{6})"><title>', svg))
    bars |= set(re.findall(r'</title><rect [^>]*fill="(#[0-9a-f]{6})"', svg))
    legend = set(re.findall(r'<rect x="[^"]+" y="[^"]+" width="10" height="10" fill="(#[0-9a-f]{6})"/>', svg))
    return bars, legend


def _room_for(t, module, px):
    """A width at which ``module``'s icicle bar is at least ``px`` wide (widths follow measured CPU time)."""
    root = icicle_tree(t)
    stack, share = [root], 0.0
    while stack:
        n = stack.pop()
        if n.kind == "module" and n.name == module:
            share = max(share, n.ns / root.ns)
        stack.extend(n.children.values())
    assert share > 0, f"{module} not in the icicle tree"
    return max(720, int(px / share) + 2)


def test_summary_html_draws_both_views_as_escaped_svg_with_legends():
    t = _trace()
    # the notebook summary draws each view as an <img> of an SVG data URI (it survives JupyterLab's sanitizer)
    imgs = re.findall(r'<img class="ts-img" [^>]*src="data:image/svg\+xml,([^"]*)"', t.summary().to_html())
    assert len(imgs) == 3 and "<svg" not in t.summary().to_html()   # timeline, memory, roofline (icicle: report)
    # the report (full=True) draws them inline, with their hover titles
    from tensorscope.render.summary import summarize

    html = summarize(t, full=True).to_html()
    svgs = re.findall(r"<svg.*?</svg>", html, re.S)
    memory = [s for s in svgs if s.startswith('<svg class="tensorscope-memory"')]
    roofline = [s for s in svgs if s.startswith('<svg class="tensorscope-roofline"')]
    # timeline, icicle, the memory timeline and the advisor's roofline
    assert len(memory) == 1 and len(roofline) == 1 and len(svgs) == 4
    assert "<script" not in html and "<img" not in html and "data:image/png" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    timeline, icicle = [s for s in svgs if s not in memory and s not in roofline]
    for svg in (timeline, icicle):
        bars, legend = _fills(svg)
        assert bars and bars <= legend, (bars, legend)  # every colour drawn has a legend entry
    assert "<title>aten.convolution.default · forward" in timeline
    assert "ATen op, backward" in timeline
    # widths are time shares: a module drawn under 1 px is left out, so (on a loaded machine, where one op can
    # take most of the cell) draw at a width that gives features.0 room for its label, whatever the timings were
    icicle = icicle_svg(t, width=_room_for(t, "features.0", 100))
    assert "<title>module features.0" in icicle and ">features.0<" in icicle.replace("</text>", "<")
    # hover titles carry shapes and the user line
    assert "in [2, 3, 8, 8]" in icicle and "test_svg.py:" in icicle


def test_icicle_widths_are_proportional_to_time():
    t = _trace()
    root = icicle_tree(t)
    ops = [o for o in t.ops.to_pylist() if not o["is_noise"]]
    assert root.ns == sum(o["cpu_ns"] for o in ops)
    net = next(c for c in root.children.values() if c.name == "<Net>")   # the outermost module holds the others
    feats = next(c for c in net.children.values() if c.name == "features")
    assert feats.ns == sum(o["cpu_ns"] for o in ops if (o["module"] or "").startswith("features"))
    assert sum(c.ns for c in feats.children.values()) == feats.ns
    svg = icicle_svg(t, width=_room_for(t, "features", 40))
    rects = re.findall(r'<g><title>(module features ·|cell:)[^<]*</title><rect x="[^"]+" y="[^"]+" width="([^"]+)"',
                       svg)
    w = {k: float(v) for k, v in rects}
    assert abs(w["module features ·"] / w["cell:"] - feats.ns / root.ns) < 0.01


def test_time_per_module_rolls_children_up_with_qualified_names():
    t = _trace()
    sec = modules_section(t)
    rows = {r[0]: r for r in sec.rows}
    assert set(rows) == {"features", "heads"}   # the top level; children expand on demand
    kids = dict(sec.children)
    label = next(k for k in kids if k.startswith("features:"))
    rows.update({r[0].strip(): r for r in kids[label]})
    assert {"features", "features.0", "features.1", "features.2"} <= set(rows)
    assert "0" not in rows
    ops = t.ops.to_pylist()
    feats = sum(o["cpu_ns"] for o in ops if (o["module"] or "").startswith("features."))
    from tensorscope.render.summary import fmt_ns

    assert rows["features"][1] == fmt_ns(feats)           # total: children included
    assert rows["features"][2] == fmt_ns(0)               # the Sequential itself runs nothing
    assert sec.notes[0].startswith("<Net>: ")   # the whole model: one line
    # the same cell gives the same rows, in the same order (ties by name)
    assert [r[0] for r in modules_section(t).rows] == [r[0] for r in sec.rows]


def test_no_memory_chart_for_a_few_bytes():
    with tensorscope.trace(leaks=False) as t:
        torch.ones(1) + 1
    html = t.summary().to_html()
    assert "tensorscope-memory" not in html and "memory (storages this trace saw)" in html


def test_views_on_empty_and_kernel_free_traces():
    with tensorscope.trace(leaks=False) as t:
        pass
    assert timeline_svg(t.result) is None and icicle_svg(t.result) is None
    assert "<svg" not in t.summary().to_html()
    # many ops: one path per series, its size bounded by the picture, not by the number of ops
    with tensorscope.trace(leaks=False) as t:
        x = torch.zeros(4)
        for _ in range(3000):
            x = x + 1
    n = t.ops.num_rows
    assert n > 3000
    svg = timeline_svg(t.result, width=400)
    assert svg.count("<path") == svg.count('fill="#3b75af"><title>') + svg.count("fill=\"#8c8c8c\"><title>") <= 6
    assert f"ATen op, forward: {n} marks" in svg and len(svg) < 12_000
    # the report's hovers: the longest ops drawn again, each with its title
    assert timeline_svg(t.result, width=400, hovers=50).count("<rect") - svg.count("<rect") == 50
    assert set(COLORS) >= {"forward", "backward", "compiled", "call", "kernel", "module"}


def test_display_path_never_imports_matplotlib():
    code = ("import sys, torch, tensorscope\n"
            "with tensorscope.trace(leaks=False) as t:\n"
            "    torch.randn(4, 4).relu().sum()\n"
            "h = t.result._repr_mimebundle_()['text/html']\n"
            "assert 'data:image/svg+xml,' in h\n"
            "print('matplotlib' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
