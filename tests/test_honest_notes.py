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
        w = x[0].T
        r = repr(y)
    ops = t.ops.to_pylist()
    assert ops and all(o["call_id"] is not None and o["source_line"] is not None for o in ops), \
        [(o["op"], o["call_id"]) for o in ops]
    names = [c["name"] for c in t.calls.to_pylist()]
    assert {"__bool__", "mT", "T"} <= set(names)
    assert "__repr__" not in names and "__get__" not in names   # pure metadata queries stay unrecorded
    assert not t.metadata.get("opaque_ops")
    assert "torch.compile'd code" not in t.summary().to_text()   # no compiled-ops note (the advisor may suggest torch.compile)


def test_no_global_module_hooks_and_compiled_modules_keep_the_users_names():
    import warnings

    from torch.nn.modules import module as _mod

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with tensorscope.trace(leaks=False) as t:
        assert not _mod._global_forward_hooks and not _mod._global_forward_pre_hooks
        m(x)
    assert set(t.ops.column("module").to_pylist()) == {"0", "1", "2"}
    cm = torch.compile(m, backend="aot_eager")
    cm(x)   # compiled outside the trace
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        with tensorscope.trace(leaks=False) as t:
            y = cm(x)
    assert not [w for w in ws if "global hooks" in str(w.message)]
    mods = {m for m in t.ops.column("module").to_pylist() if m is not None}
    assert mods and not any("_orig_mod" in m or "OptimizedModule" in m or "GraphModule" in m for m in mods), mods
    # the compiled graph's ops belong to the line that called the compiled module, not to generated code
    assert {f for f in t.ops.column("source_file").to_pylist()} == {__file__}


def test_module_error_traceback_is_the_untraced_one():
    import traceback

    class Bad(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.softmax(x, dim=5)

    net = torch.nn.Sequential(torch.nn.Linear(3, 3), Bad())

    def frames(traced):
        try:
            if traced:
                with tensorscope.trace(leaks=False):
                    net(torch.randn(2, 3))
            else:
                net(torch.randn(2, 3))
        except IndexError as e:
            return [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(e.__traceback__)][1:]

    assert frames(True) == frames(False)


def test_a_submodule_called_alone_then_inside_its_root_gets_both_paths():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    x = torch.randn(2, 4)
    with tensorscope.trace(leaks=False) as t:
        m[1](x)     # on its own: it is the root
        m(x)
    mods = [r["module"] for r in t.ops.to_pylist() if r["op"] in ("aten.relu.default", "aten.addmm.default")]
    assert mods == ["0", "1", "0", "1.0", "1.1"]
