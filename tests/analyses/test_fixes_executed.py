"""Every layout fix the advisor lists is executed here and changes what its finding said (issue 29).

Each case traces a workload whose cause is known by construction, reads the layout finding and its
fix, applies the fix's code to the workload, traces again and checks the finding is gone (or its
count went down as it says). Also: the advice follows the parameters' actual memory format (a model
that already is channels_last is never told to convert), no mixed-formats finding without a
convolution that mixes, and one copy is one finding.
"""
from __future__ import annotations

import torch

import tensorscope

CL = torch.channels_last


def _layout(t):
    return [f for f in t.advice().findings.to_pylist() if f["kind"] == "layout"]


def _net(cl_model: bool):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    return net.to(memory_format=CL) if cl_model else net


def _run(net, x):
    with tensorscope.trace(leaks=False) as t:
        net(x).sum().backward()
    return t


def test_nchw_model_fed_channels_last_convert_the_model_fix_runs():
    x = torch.randn(2, 3, 16, 16).to(memory_format=CL)
    net = _net(False)
    (f,) = [f for f in _layout(_run(net, x)) if "convolutions" in f["subject"]]
    assert f["fix"].startswith("convert the model too: model.to(memory_format=torch.channels_last)")
    net = net.to(memory_format=CL)                          # the fix
    assert _layout(_run(net, x)) == []


def test_channels_last_model_fed_nchw_convert_the_input_fix_runs():
    x = torch.randn(2, 3, 16, 16)
    net = _net(True)
    (f,) = [f for f in _layout(_run(net, x)) if "convolutions" in f["subject"]]
    # the weights already are channels_last: the input is what to convert, never the model
    assert f["fix"].startswith("convert the input too: x.to(memory_format=torch.channels_last)"), f["fix"]
    assert "model.to(" not in f["fix"]
    x = x.to(memory_format=CL)                              # the fix
    assert _layout(_run(net, x)) == []


def test_a_channels_last_model_with_a_flatten_head_gets_one_finding_and_no_convert_the_model():
    """Issue 29: "convert the model too" for a model that already was channels_last, beside "0
    convolution(s) mixing", and the one flatten copy counted twice (format change + hidden copy)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=CL)
    head = torch.nn.Linear(8 * 14 * 14, 10)
    x = torch.randn(4, 3, 16, 16).to(memory_format=CL)
    with tensorscope.trace(leaks=False) as t:
        head(torch.relu(conv(x)).flatten(1)).sum().backward()
    fs = _layout(t)
    assert not [f for f in fs if "convolutions" in f["subject"] or "convert the model" in f["fix"]], fs
    (f,) = fs                                               # one copy: one finding
    assert "flatten" in f["seen"] and f["n_rows"] == 1, f
    kinds = [r["kind"] for r in t.layout_changes.to_pylist() if r["call"] == "flatten"]
    assert kinds == ["hidden_copy"], kinds
    # the fix: flatten the channels-last order, a view (the head is trained on (h, w, c) order)
    assert f["fix"].startswith("x.permute(0, 2, 3, 1).flatten(1) is a view")
    with tensorscope.trace(leaks=False) as t2:
        head(torch.relu(conv(x)).permute(0, 2, 3, 1).flatten(1)).sum().backward()
    assert _layout(t2) == []
    assert not [r for r in t2.layout_changes.to_pylist() if r["kind"] == "hidden_copy"]


def test_a_hidden_copy_in_a_loop_contiguous_once_fix_runs():
    a = torch.randn(256, 128)
    with tensorscope.trace(leaks=False) as t:
        for _ in range(4):
            a.t().reshape(-1)
    (f,) = _layout(t)
    assert f["seen"].startswith("4x reshape() copied") and f["fix"].startswith("make the tensor contiguous once")
    with tensorscope.trace(leaks=False) as t2:
        at = a.t().contiguous()                             # the fix: once, before the loop
        for _ in range(4):
            at.reshape(-1)
    fs = _layout(t2)
    assert [f["n_rows"] for f in fs] == [1], fs             # 4 copies → the 1 made on purpose
    assert "reshape" not in fs[0]["seen"]


def test_a_format_change_convert_the_other_operand_fix_runs():
    x = torch.randn(2, 3, 8, 8).to(memory_format=CL)
    c = torch.randn(2, 3, 8, 8)
    with tensorscope.trace(leaks=False) as t:
        for _ in range(2):
            c + x                                           # the first (contiguous) operand decides: x's layout is lost
    (f,) = _layout(t)
    assert "format change" in f["subject"] and f["fix"].startswith("keep one memory format end to end")
    c = c.to(memory_format=CL)                              # the fix: convert the other operand once
    with tensorscope.trace(leaks=False) as t2:
        for _ in range(2):
            c + x
    assert _layout(t2) == []
