"""tensorscope.diff and the baseline guard, on real traces, saved directories and a real kernel."""
from __future__ import annotations

import pytest
import torch

import tensorscope
from tensorscope import schema as S


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 4))


def _rows(d, **where):
    return [r for r in d.table.to_pylist() if all(r[k] == v for k, v in where.items())]


def test_different_lengths_match_by_module_and_op(tmp_path):
    m = _model()
    x = torch.randn(2, 3, 8, 8)
    with tensorscope.trace(leaks=False) as a:
        m(x).sum().backward()
    m2 = _model().to(memory_format=torch.channels_last)
    with tensorscope.trace(leaks=False) as b:
        for _ in range(3):    # three steps, channels_last, a round trip through half
            m2(x.to(memory_format=torch.channels_last).half().float()).sum().backward()
    d = tensorscope.diff(a, b)
    assert d.table.schema.equals(S.DIFF, check_metadata=False)
    conv = _rows(d, section="ops", module="0", phase="forward", op="aten.convolution.default")[0]
    assert (conv["count_a"], conv["count_b"], conv["delta_count"], conv["status"]) == (1, 3, 2, "changed")
    assert conv["delta_cpu_ns"] == conv["cpu_ns_b"] - conv["cpu_ns_a"]
    # the flatten of a channels_last activation is a hidden copy that was not there before
    hc = _rows(d, section="hidden_copies", module="2", op="aten.clone.default")[0]
    assert (hc["status"], hc["count_a"], hc["count_b"]) == ("appeared", 0, 3)
    assert _rows(d, section="casts", status="appeared")
    gone = _rows(d, section="ops", module="2", phase="forward", op="aten.view.default")
    assert gone and gone[0]["status"] == "disappeared"
    assert d.totals_b["hidden_copies"] == 3 and d.totals_a["hidden_copies"] == 0
    assert d.totals_b["casts"] == 6
    assert d.totals_b["peak_bytes"]["cpu"] > d.totals_a["peak_bytes"]["cpu"]
    # biggest changes first, and the text/HTML say it (escaped)
    ch = d.changed().to_pylist()
    assert all(r["status"] != "same" for r in ch)
    text = d.to_text()
    assert "hidden copies: 0 → 3" in text and "aten.clone.default" in text
    html = d.to_html()
    assert "tensorscope diff" in html and "<script" not in html
    # the same comparison between saved directories
    pa_, pb = a.save(tmp_path / "a"), b.save(tmp_path / "b")
    d2 = tensorscope.diff(pa_, pb)
    assert d2.table.drop_columns(["cpu_ns_a", "cpu_ns_b", "delta_cpu_ns"]).sort_by("op").to_pylist() == \
        d.table.drop_columns(["cpu_ns_a", "cpu_ns_b", "delta_cpu_ns"]).sort_by("op").to_pylist()
    assert (d2.label_a, d2.label_b) == ("a", "b")


def test_a_trace_against_itself_has_no_change_and_no_regression():
    with tensorscope.trace(leaks=False) as t:
        torch.randn(8, 8) @ torch.randn(8, 8)
    d = tensorscope.diff(t, t)
    assert d.changed().num_rows == 0
    assert d.regressions() == []
    assert "the same ops" in d.to_text()


def test_leaked_bytes_and_bad_input():
    keep = []
    with tensorscope.trace() as a:
        torch.randn(10)
    with tensorscope.trace() as b:
        keep.append(torch.randn(1000))
    d = tensorscope.diff(a, b)
    assert d.totals_b["leaked_bytes"] >= 4000 and d.totals_a["leaked_bytes"] == 0
    assert "leaked bytes" in d.to_text()
    with pytest.raises(TypeError, match="Trace or a saved trace directory"):
        tensorscope.diff(a, 3)
    with pytest.raises(tensorscope.TraceFormatError):
        tensorscope.diff(a, "/nonexistent/trace/dir")


def test_baseline_guard_fails_on_memory_and_time_regression():
    with tensorscope.trace(leaks=False) as base:
        y = torch.randn(16, 16)
        y @ y
    # much more memory and work: both guards fire; the trace is kept on the error
    with pytest.raises(tensorscope.GuardError) as ei:
        with tensorscope.trace(leaks=False, baseline=base.result):
            z = torch.randn(256, 256)
            for _ in range(20):
                z = z @ z.clamp(-1, 1)
    msg = str(ei.value)
    assert "peak memory on cpu regressed" in msg and "CPU time in ops regressed" in msg
    assert "threshold +10%" in msg and "threshold +20%" in msg
    assert ei.value.trace is not None and ei.value.trace.metadata["options"]["baseline"].startswith("<tensorscope.Trace")
    # the same work as the baseline passes the memory guard (its time is left out: two runs of the same
    # microseconds of work differ by 2x on a loaded machine, and no test asserts a timing); a generous
    # threshold passes too
    with tensorscope.trace(leaks=False, baseline=base.result, baseline_time=1e6):
        y = torch.randn(16, 16)
        y @ y
    with tensorscope.trace(leaks=False, baseline=base.result, baseline_time=1e6, baseline_memory=1e6):
        torch.randn(256, 256) @ torch.randn(256, 256)


def test_bad_baseline_fails_before_running():
    ran = []
    with pytest.raises(tensorscope.TraceFormatError):
        with tensorscope.trace(baseline="/nonexistent/baseline"):
            ran.append(1)
    assert ran == []
    with pytest.raises(tensorscope.OptionsError):
        tensorscope.trace(baseline_time=-1)


@pytest.mark.kernel
def test_magics_diff_and_baseline(tmp_path):
    from tests.helpers.kernel_utils import Kernel

    k = Kernel(cwd=str(tmp_path))
    try:
        r = k.run("%load_ext tensorscope\nimport torch, tensorscope")
        assert r.status == "ok", r.error
        r = k.run("%%tensorscope -o a -q --no-leaks\ny = torch.randn(8, 8) @ torch.randn(8, 8)")
        assert r.status == "ok", r.error
        r = k.run("%%tensorscope -o b -q --no-leaks --baseline a\nbig = torch.randn(512, 512)\nbig = big @ big")
        assert r.status == "error" and r.error["ename"] == "GuardError", r.error
        assert "peak memory on cpu regressed" in r.error["evalue"]
        assert k.value("tensorscope.last().ops.num_rows > 0") is True
        r = k.run("%tensorscope diff a -1")
        assert r.status == "ok", r.error
        assert "tensorscope diff: a → -1" in r.text()
        assert "aten.mm.default" in r.text()
        r = k.run("%tensorscope diff a nosuchthing")
        assert r.status == "error" and "not a variable" in (r.error.get("evalue") or ""), r.error
        assert k.run("ran = False").status == "ok"
        r = k.run("%%tensorscope -q --baseline nosuchvar\nran = True")
        assert r.status == "error" and "nosuchvar" in (r.error.get("evalue") or "")
        assert k.value("ran") is False
    finally:
        k.close()


def test_same_count_time_shift_classification():
    from tensorscope.analyses.diff import _timing

    assert _timing(1_000_000, 1_300_000) == "slower"      # +30%, +300 µs
    assert _timing(1_000_000, 700_000) == "faster"
    assert _timing(1_000_000, 1_100_000) == "same"        # +10%: noise
    assert _timing(10_000, 40_000) == "same"              # +300% but only 30 µs
    assert _timing(None, 5) == "same"
