"""Notes and verdicts that say what happened: masks are not overflows, every op has its call and line."""
from __future__ import annotations

import torch

import tensorscope
from tensorscope.analyses.nonfinite import nonfinite_verdicts


def _attention(T=4):
    s = torch.randn(T, T)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    with tensorscope.trace(leaks=False) as t:
        causal = torch.full((T, T), float("-inf")).triu(1)
        a = torch.softmax(s + causal, -1)
        b = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
        c = torch.softmax(torch.where(mask, float("-inf"), s), -1)
        z = torch.scalar_tensor(float("-inf"))
    return t, (a, b, c, z)


def test_infinite_constants_are_not_overflows():
    t, _ = _attention()
    v = {(r["op"], r["verdict"]) for r in nonfinite_verdicts(t.ops)}
    assert ("aten.full.default", "constant") in v
    assert ("aten.masked_fill.Scalar", "constant") in v
    assert ("aten.scalar_tensor.default", "constant") in v
    assert ("aten.triu.default", "from_constant") in v and ("aten.add.Tensor", "from_constant") in v
    assert not any(verdict in ("produced", "propagated") for _op, verdict in v)
    text = t.summary().to_text()
    assert "non-finite" not in text     # attention masks are not listed under precision


def test_a_real_overflow_is_still_produced_next_to_a_mask():
    x = torch.tensor([1000.0, 1.0])
    with tensorscope.trace(leaks=False) as t:
        m = torch.full((2,), float("-inf"))
        y = torch.exp(x)          # overflows: inf from finite input
        w = y + m
    v = [(r["op"], r["verdict"]) for r in nonfinite_verdicts(t.ops)]
    assert ("aten.exp.default", "produced") in v and ("aten.full.default", "constant") in v
    text = t.summary().to_text()
    assert "non-finite produced (first)" in text and "aten.exp.default" in text
    assert "written on purpose" in text


def test_every_op_from_user_code_has_a_call_and_line():
    x = torch.randn(2, 3, 4)
    y = torch.randn(5)
    with tensorscope.trace(leaks=False) as t:
        if (y > 0).any():
            pass
        z = x.mT
        w = x.T
        r = repr(y)
    ops = t.ops.to_pylist()
    assert ops and all(o["call_id"] is not None and o["source_line"] is not None for o in ops), \
        [(o["op"], o["call_id"]) for o in ops]
    names = [c["name"] for c in t.calls.to_pylist()]
    assert {"__bool__", "mT", "T"} <= set(names)
    assert "__repr__" not in names and "__get__" not in names   # pure metadata queries stay unrecorded
    assert not t.metadata.get("opaque_ops")
    assert "torch.compile" not in t.summary().to_text()
