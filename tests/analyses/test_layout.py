"""layout_changes: memory-format changes, hidden copies and non-dense inputs, on real traces."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tensorscope
from tensorscope import schema as S
from tensorscope.analyses.layout import layout_changes, non_dense_kind

CL = torch.channels_last


def _x(*shape):
    torch.manual_seed(0)
    return torch.randn(*shape).to(memory_format=CL)


def _changes(t, kind=None):
    rows = t.layout_changes.to_pylist()
    return [r for r in rows if kind is None or r["kind"] == kind]


def _lost(t):
    """Rows that dropped channels_last: format changes, and hidden copies that changed the format (one
    event, one row: the copy names the change in its from/to formats)."""
    return [r for r in _changes(t) if r["kind"] in ("format_change", "hidden_copy")
            and r["from_format"] == "channels_last" and r["to_format"] != "channels_last"]


def test_schema_and_empty_trace():
    with tensorscope.trace() as t:
        pass
    assert t.layout_changes.schema.equals(S.LAYOUT_CHANGES, check_metadata=False)
    assert t.layout_changes.num_rows == 0
    assert layout_changes(S.empty("ops"), S.empty("calls")).num_rows == 0


def test_conv_bn_pool_upsample_pad_preserve_channels_last():
    x = _x(2, 3, 8, 8)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1).to(memory_format=CL)
    bn = torch.nn.BatchNorm2d(4).eval()
    with tensorscope.trace() as t:
        y = conv(x)
        y = bn(y)
        y = F.max_pool2d(y, 2)
        y = F.avg_pool2d(y, 2, stride=1)
        y = F.interpolate(y, scale_factor=2)
        y = F.pad(y, (1, 1, 1, 1))
        y = torch.relu(y)
    assert y.is_contiguous(memory_format=CL)
    assert _changes(t, "format_change") == []
    # the ops really ran on channels_last tensors (the test would pass vacuously otherwise)
    fmts = {f for r in t.ops.to_pylist() for f in r["out_formats"]}
    assert "channels_last" in fmts


@pytest.mark.parametrize("name, fn, call", [
    ("layer_norm", lambda x: F.layer_norm(x, (x.shape[-1],)), "layer_norm"),
    ("softmax1", lambda x: x.softmax(dim=1), "softmax"),
    ("sum", lambda x: x.sum(dim=0, keepdim=True), "sum"),
    ("matmul", lambda x: x @ torch.ones(x.shape[-1], 6), "matmul"),
])
def test_ops_that_return_contiguous_drop_channels_last(name, fn, call):
    x = _x(2, 3, 4, 5)
    with tensorscope.trace() as t:
        y = fn(x)
    assert not y.is_contiguous(memory_format=CL)
    lost = _lost(t)
    assert len(lost) == 1, lost
    r = lost[0]
    assert r["to_format"] == "contiguous" and r["call"] == call
    assert r["source_line"] is not None and r["source_file"] == __file__
    assert r["bytes"] > 0


def test_first_operand_decides_binary_op_ties():
    x = _x(2, 3, 4, 5)
    c = torch.randn(2, 3, 4, 5)
    with tensorscope.trace() as keep:
        y = x + c
    with tensorscope.trace() as drop:
        z = c + x
    assert y.is_contiguous(memory_format=CL) and z.is_contiguous()
    assert _lost(keep) == []
    lost = _lost(drop)
    assert [(r["op"], r["bytes"]) for r in lost] == [("aten.add.Tensor", 2 * 3 * 4 * 5 * 4)]


def test_cat_mixed_formats_is_contiguous_all_channels_last_is_not():
    x = _x(2, 3, 4, 5)
    c = torch.randn(2, 3, 4, 5)
    with tensorscope.trace() as t:
        torch.cat([x, c])
        torch.cat([c, x])
        torch.cat([x, x])
    lost = _lost(t)
    assert [r["op"] for r in lost] == ["aten.cat.default"] * 2
    assert all(r["bytes"] == 4 * 3 * 4 * 5 * 4 for r in lost)


def test_reshape_merging_hw_is_a_view_but_flatten_copies():
    x = _x(2, 3, 4, 5)
    with tensorscope.trace() as view:
        v = x.reshape(2, 3, 20)
    assert v.data_ptr() == x.data_ptr()
    assert _changes(view) == []
    with tensorscope.trace() as copy:
        f = x.flatten(1)
    assert f.data_ptr() != x.data_ptr()
    hidden = _changes(copy, "hidden_copy")
    assert len(hidden) == 1
    h = hidden[0]
    assert h["call"] == "flatten" and h["bytes"] == 2 * 3 * 4 * 5 * 4
    assert "(60, 1, 15, 3)" in h["reason"] and "(2, 60)" in h["reason"]
    assert [(r["from_format"], r["to_format"]) for r in _lost(copy)] == [("channels_last", "contiguous")]


def test_transpose_reshape_hidden_copy_bytes_and_reason():
    a = torch.randn(3, 4)
    with tensorscope.trace() as t:
        a.t().reshape(-1)
        a.reshape(-1)             # a view: nothing to report
    hidden = _changes(t, "hidden_copy")
    assert len(hidden) == 1
    h = hidden[0]
    assert h["bytes"] == 3 * 4 * 4
    assert h["call"] == "reshape" and h["from_format"] == "strided" and h["to_format"] == "contiguous"
    assert "strides (1, 4)" in h["reason"] and "(12,)" in h["reason"]


def test_contiguous_on_channels_last_is_one_hidden_copy_that_names_the_format_change():
    # issue 29: one copy was counted twice (a format change and a hidden copy of the same op)
    x = _x(2, 3, 4, 5)
    with tensorscope.trace() as t:
        x.contiguous()
        torch.randn(2, 3).contiguous()      # already contiguous: no op at all
    rows = _changes(t)
    assert [(r["kind"], r["from_format"], r["to_format"]) for r in rows] == \
        [("hidden_copy", "channels_last", "contiguous")]
    assert "the copy is contiguous, the source channels_last" in rows[0]["reason"]


def test_size_one_dims_make_no_false_changes():
    one_c = torch.randn(2, 1, 4, 5).to(memory_format=CL)    # C == 1: both formats at once
    pooled_in = _x(2, 3, 4, 5)
    with tensorscope.trace() as t:
        F.layer_norm(one_c, (5,))
        one_c.softmax(dim=1)
        p = F.adaptive_avg_pool2d(pooled_in, 1)              # (N, C, 1, 1)
        p * 2
        p.flatten(1)
        x11 = torch.randn(2, 3, 1, 1)
        x11.contiguous(memory_format=CL) + p
    assert _changes(t, "format_change") == []
    assert _changes(t, "hidden_copy") == []
    amb = [a for r in t.ops.to_pylist() for a in r["in_ambiguous"]]
    assert any(amb)


def test_explicit_conversion_to_channels_last_is_reported_as_a_change():
    c = torch.randn(2, 3, 4, 5)
    with tensorscope.trace() as t:
        c.to(memory_format=CL)
    rows = _changes(t, "format_change")
    assert [(r["from_format"], r["to_format"], r["call"]) for r in rows] == [("contiguous", "channels_last", "to")]
    assert _changes(t, "hidden_copy") == []


def _body():
    x = _x(2, 3, 4, 5)
    c = torch.randn(2, 3, 4, 5)
    w = torch.ones(5, 6)
    lin = torch.nn.Linear(3, 2)
    F.layer_norm(x, (5,))
    x.softmax(dim=1)
    x.sum(dim=0, keepdim=True)
    x @ w
    c + x
    torch.cat([x, c])
    x.reshape(2, 3, 20)
    x.flatten(1)
    x.contiguous()
    torch.randn(3, 4).t().reshape(-1)
    lin(x.permute(0, 2, 3, 1))
    torch.einsum("nchw,wk->nchk", x, w)


def _findings(t):
    return sorted((r["kind"], r["from_format"], r["to_format"], r["bytes"], r["call"], r["source_line"])
                  for r in _changes(t))


def test_inference_mode_gives_the_same_findings_as_grad_mode():
    with tensorscope.trace() as grad:
        _body()
    with torch.inference_mode(), tensorscope.trace() as inf:
        _body()
    g, i = _findings(grad), _findings(inf)
    assert len(g) >= 8
    assert g == i
    kinds = {k for k, *_ in g}
    assert {"format_change", "hidden_copy"} <= kinds


def test_non_dense_input_to_a_compute_op():
    a = torch.randn(8, 16)
    b = torch.randn(8, 32)[:, ::2]           # (8, 16) with strides (32, 2): gapped
    e = torch.randn(1, 16).expand(8, 16)
    with tensorscope.trace() as t:
        torch.mm(b.t(), a)                    # gapped input to a matmul: reported
        torch.mm(e.t(), a)                    # expanded input: reported
        a[:, ::2] * 2                         # gapped input to a pointwise op: TensorIterator, not reported
        e + a                                 # broadcasting: not reported
        a[:, ::2].sum()
    rows = _changes(t, "non_dense_input")
    assert [(r["op"], r["from_format"]) for r in rows] == [("aten.mm.default", "gapped"),
                                                          ("aten.mm.default", "expanded")]
    assert rows[0]["bytes"] == 16 * 8 * 4 and "input 0" in rows[0]["reason"]


def test_non_dense_kind_from_strides():
    assert non_dense_kind([4, 3], [0, 1]) == "expanded"
    assert non_dense_kind([4, 3], [6, 1]) == "gapped"
    assert non_dense_kind([4, 3], [1, 1]) == "overlapping"
    assert non_dense_kind([4, 3], [1, 4]) == "dense"


def test_analysis_is_pure_and_conforms_on_a_loaded_trace(tmp_path):
    x = _x(2, 3, 4, 5)
    with tensorscope.trace() as t:
        x.flatten(1)
    before = t.layout_changes
    again = layout_changes(t.ops, t.calls)
    assert again.equals(before)
    p = t.save(str(tmp_path / "tr"))
    back = tensorscope.load(p)
    assert back.layout_changes.to_pylist() == before.to_pylist()


def test_layout_section_in_summary():
    x = _x(2, 3, 4, 5)
    with tensorscope.trace() as t:
        F.layer_norm(x, (5,))
        x.flatten(1)
    text = t.summary().to_text()
    assert "== layout ==" in text
    assert "channels_last → contiguous" in text and "hidden cop" in text
    html = t.summary().to_html()
    assert "layout" in html and "<script" not in html
    with tensorscope.trace() as clean:
        torch.randn(3) + 1
    assert "== layout ==" not in clean.summary().to_text()
