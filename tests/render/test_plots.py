"""Plots render to PNG under Agg with the expected artists, through the object-oriented API only."""
from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

import tensorscope
from tensorscope.render.plots import PlotAccessor, timeline_png
from tests.helpers.synthetic import make_trace, table

PNG = b"\x89PNG\r\n\x1a\n"


def StandIn(**tables):
    return make_trace({}, **tables)


def sample(with_kernels=True, with_memory=True):
    ops = table("ops", [dict(seq=i, op=op, start_ns=1_000 + 10_000 * i, cpu_ns=dur, phase=ph, module=mod,
                            flops=fl, bytes_read=br, bytes_written=bw, cuda_ns=cu, is_noise=False)
                       for i, (op, dur, ph, mod, fl, br, bw, cu) in enumerate([
                           ("aten.addmm.default", 8_000, "forward", "0", 1000, 400, 100, 5_000),
                           ("aten.relu.default", 2_000, "forward", "1", 10, 100, 100, 1_000),
                           ("aten.addmm.default", 7_000, "forward", "2", 1000, 400, 100, 4_000),
                           ("aten.mm.default", 9_000, "backward", "2", 2000, 800, 400, None),
                           ("aten.threshold_backward.default", 1_000, "backward", None, -1, 200, 100, None)])])
    calls = table("calls", [dict(call_id=0, depth=0, name="linear", start_ns=500, dur_ns=9_000),
                           dict(call_id=1, depth=1, name="t", start_ns=600, dur_ns=300),
                           dict(call_id=2, depth=0, name="backward", start_ns=30_000, dur_ns=20_000)])
    kernels = table("kernels", [dict(seq=0, name="gemm", device=0, stream=7, start_ns=2_000, dur_ns=5_000),
                               dict(seq=3, name="gemm2", device=0, stream=13, start_ns=32_000, dur_ns=6_000),
                               dict(seq=3, name="bad", device=0, stream=13, start_ns=None, dur_ns=5)]) if with_kernels else None
    memory = table("memory", [dict(seq=i, device=d, live_bytes=v, delta_bytes=0)
                             for i, d, v in [(0, "cpu", 1 << 20), (1, "cpu", 3 << 20), (2, "cuda:0", 1 << 22),
                                             (4, "cpu", 2 << 20)]]) if with_memory else None
    return StandIn(ops=ops, calls=calls, **({"kernels": kernels} if kernels is not None else {}),
                   **({"memory": memory} if memory is not None else {}))


def _png(fig):
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    data = buf.getvalue()
    assert data.startswith(PNG)
    return data


def _rows(ax):
    return [c for c in ax.collections if isinstance(c, PolyCollection)]


def test_timeline_has_call_op_and_stream_rows():
    fig = PlotAccessor(sample()).timeline()
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    # top to bottom: calls by depth, ops, then one row per (device, stream)
    assert labels == ["cuda:0 s13", "cuda:0 s7", "ATen ops", "calls d1", "calls d0"]
    rows = _rows(ax)
    assert [len(r.get_paths()) for r in rows] == [2, 1, 5, 1, 1]          # the bad-stamp kernel is not drawn
    assert "GPU kernels" in ax.get_title()
    _png(fig)


def test_timeline_without_kernels_and_bar_cap():
    fig = PlotAccessor(sample(with_kernels=False)).timeline(max_bars=2)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["calls d0", "calls d1", "ATen ops"][::-1]
    assert len(_rows(ax)[-1].get_paths()) == 2 and "longest 2 of 5 ops" in ax.get_title()


@pytest.mark.parametrize("by,expect", [
    ("cpu_ns", ["aten.addmm.default", "aten.mm.default", "aten.relu.default", "aten.threshold_backward.default"]),
    ("cuda_ns", ["aten.addmm.default", "aten.relu.default"]),
    ("flops", ["aten.addmm.default", "aten.mm.default", "aten.relu.default"]),
    ("bytes", ["aten.mm.default", "aten.addmm.default", "aten.threshold_backward.default", "aten.relu.default"]),
])
def test_top_ops_bars(by, expect):
    fig = PlotAccessor(sample()).top_ops(by=by)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()][::-1] == expect       # largest on top
    assert len(ax.patches) == len(expect)
    _png(fig)


def test_top_ops_limit_and_bad_key():
    ax = PlotAccessor(sample()).top_ops(n=2).axes[0]
    assert len(ax.patches) == 2
    with pytest.raises(ValueError, match="by must be one of"):
        PlotAccessor(sample()).top_ops(by="gpu")


def test_memory_lines_per_device_and_empty_message():
    ax = PlotAccessor(sample()).memory().axes[0]
    assert sorted(line.get_label() for line in ax.lines) == ["cpu", "cuda:0"]
    cpu = [line for line in ax.lines if line.get_label() == "cpu"][0]
    assert list(cpu.get_xdata()) == [0, 1, 4] and list(cpu.get_ydata()) == [1, 3, 2]
    empty = PlotAccessor(sample(with_memory=False)).memory()
    assert "no memory view" in empty.axes[0].texts[0].get_text()
    _png(empty)


def test_modules_bar():
    ax = PlotAccessor(sample()).modules().axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()][::-1]
    assert labels == ["2", "0", "1", "(no module)"]
    widths = [p.get_width() for p in ax.patches][::-1]
    assert widths == pytest.approx([0.016, 0.008, 0.002, 0.001])
    assert "no cuda_ns" not in ax.get_title()


def test_timeline_png_size_and_bytes():
    data = timeline_png(sample(), width_px=500)
    assert data.startswith(PNG)
    import struct

    w, h = struct.unpack(">II", data[16:24])
    assert w == 500 and 100 < h < 300


def test_plots_of_a_real_trace():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with tensorscope.trace() as t:
        m(torch.randn(3, 8)).sum().backward()
    for fig in (t.plot.timeline(), t.plot.top_ops(), t.plot.top_ops(by="cuda_ns"), t.plot.memory(), t.plot.modules()):
        assert isinstance(fig, Figure)
        _png(fig)
    ax = t.plot.top_ops(by="cuda_ns").axes[0]
    assert "no CUDA timings" in ax.texts[0].get_text()
    html = t.summary().to_html()
    assert "data:image/svg+xml," in html and "data:image/png" not in html   # the summary draws SVG images; t.plot is matplotlib


def test_library_never_touches_pyplot_state():
    had_pyplot = "matplotlib.pyplot" in sys.modules
    before = sys.modules["matplotlib.pyplot"].get_fignums() if had_pyplot else None
    t = sample()
    figs = [PlotAccessor(t).timeline(), PlotAccessor(t).top_ops(), PlotAccessor(t).memory(), PlotAccessor(t).modules()]
    timeline_png(t)
    assert all(isinstance(f, Figure) for f in figs)
    if had_pyplot:      # another test imported it: our figures must not be registered with it
        assert sys.modules["matplotlib.pyplot"].get_fignums() == before
    else:
        assert "matplotlib.pyplot" not in sys.modules
    import tensorscope.render.plots as P

    with open(P.__file__) as f:
        assert "pyplot" not in f.read().replace("no ``pyplot``", "")


def test_figures_display_as_png_without_a_backend():
    """IPython's own formatter (what a kernel sends) gives image/png for every plot, no ``%matplotlib``."""
    from IPython.core.formatters import DisplayFormatter

    acc = PlotAccessor(sample())
    for fig in (acc.timeline(), acc.top_ops(), acc.memory(), acc.modules()):
        data, _ = DisplayFormatter().format(fig)
        assert data["image/png"].startswith(PNG) and data["image/png"] == fig._repr_png_()
        assert data["text/plain"].startswith("<tensorscope plot ") and fig.axes[0].get_title() in data["text/plain"]


def test_memory_of_a_categorised_trace_is_stacked_by_category_with_the_peak_marked():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with tensorscope.trace() as t:
        m(torch.randn(16, 8)).sum().backward()
        opt.step()
    ax = t.plot.memory().axes[0]
    areas = [c for c in ax.collections if isinstance(c, PolyCollection)]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    used = {r for r in t.tensors.column("category").to_pylist()}
    assert len(areas) == len(labels) == len(used)
    assert {"parameters", "gradients", "optimizer state", "activations (saved for backward)"} <= set(labels)
    peak = [p for p in t.memory_timeline.to_pylist() if p["is_peak"]][0]
    assert [line.get_xdata()[0] for line in ax.lines] == [peak["seq"]]
    assert "peak" in ax.texts[0].get_text() and peak["op"] in ax.texts[0].get_text()
    _png(ax.figure)
