"""%%tensorscope and %tensorscope in a real ipykernel, through jupyter_client."""
from __future__ import annotations

import os

import pytest

from tests.helpers.kernel_utils import Kernel

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    kern = Kernel(cwd=str(tmp_path_factory.mktemp("kernel")))
    r = kern.run("%load_ext tensorscope\nimport torch, tensorscope\nx = torch.randn(4, 4)")
    assert r.status == "ok", r.error
    yield kern
    kern.close()


def test_traced_cell_displays_last_expression_and_summary(k, tmp_path):
    save = tmp_path / "step1"
    r = k.run(f"%%tensorscope -o t --save {save}\ny = x @ x\nz = y.relu()\nz.sum().item() * 0 + 7")
    assert r.status == "ok", r.error
    assert r.text() == "7.0"                        # the last expression still displays, as Out
    assert k.value(f"Out[{r.execution_count}]") == 7.0
    assert "tensorscope trace" in r.html() and "aten.mm.default" in r.html()
    assert "saved to" in r.html()
    assert os.path.isfile(save / "ops.parquet")
    assert k.value("type(t).__name__") == "Trace"
    assert k.value("t is tensorscope.last()") is True
    assert k.value("t.ops.column('op').to_pylist()[:2]") == ["aten.mm.default", "aten.relu.default"]
    assert k.value("t.ops.column('source_line').to_pylist()[:2]") == [2, 3]   # line numbers are the cell's
    assert k.value("t.metadata['cell']") == r.execution_count
    assert k.value(f"tensorscope.load({str(save)!r}).ops.num_rows == t.ops.num_rows") is True
    # no mode is left behind once the cell finished
    assert k.value("__import__('torch').utils._python_dispatch._get_current_dispatch_mode_stack()") == []


def test_cell_that_raises_is_recorded_and_raises_unchanged(k):
    r = k.run("%%tensorscope -q -o bad\na = torch.randn(3)\nb = torch.randn(5)\nc = a + b")
    assert r.status == "error" and r.error["ename"] == "RuntimeError"
    assert "size of tensor a (3) must match" in r.error["evalue"]
    errs = k.value("[(e['py_type'], e['op'], e['source_line']) for e in bad.errors.to_pylist()]")
    assert errs[0] == ("RuntimeError", "aten.add.Tensor", 4)
    assert k.value("__import__('torch').utils._python_dispatch._get_current_dispatch_mode_stack()") == []
    r = k.run("%%tensorscope -q\nraise ValueError('plain python')")
    assert r.status == "error" and r.error["ename"] == "ValueError"
    assert k.value("tensorscope.last().errors.column('py_type').to_pylist()") == ["ValueError"]


def test_function_defined_in_an_earlier_cell(k):
    r = k.run("def helper(v):\n    w = v * 2\n    return w.exp()")
    assert r.status == "ok"
    r = k.run("%%tensorscope -q -o tf\nout = helper(x)")
    assert r.status == "ok", r.error
    rows = k.value("[(r['op'], r['source_line']) for r in tf.ops.to_pylist()]")
    assert rows == [("aten.mul.Tensor", 2), ("aten.exp.default", 3)]
    files = k.value("sorted(set(tf.ops.column('source_file').to_pylist()))")
    assert len(files) == 1 and files[0] != k.value("tf.metadata.get('cell_file', None)")


def test_magics_and_await_inside_a_traced_cell(k):
    r = k.run("%%tensorscope -q -o ta\nimport asyncio\nawait asyncio.sleep(0)\n%time q = x + 1\nq.sum()")
    assert r.status == "ok", r.error
    assert "Wall time" in r.stdout
    assert r.results, "the last expression displayed"
    assert "aten.add.Tensor" in k.value("ta.ops.column('op').to_pylist()")


def test_unknown_option_is_a_usage_error_and_runs_nothing(k):
    r = k.run("%%tensorscope --no-such-option\nprint('RAN')")
    assert "RAN" not in r.stdout
    assert r.status == "error" and r.error["ename"] == "UsageError"
    assert "unrecognized arguments" in r.error["evalue"]
    r = k.run("%%tensorscope --numerics fp99\nprint('RAN')")
    assert "RAN" not in r.stdout and r.status == "error"


def test_help_lists_every_option(k):
    r = k.run("%%tensorscope?")
    text = "".join(d.get("text/plain", "") for d in r.displays + r.results) + r.stdout
    import tensorscope.options as O

    for flags, _ in O.argparse_arguments():
        assert flags[0] in text, flags
    for flag in ("--output", "--save", "--quiet"):
        assert flag in text


def test_always_on_mode_and_history(k):
    n0 = k.value("len(tensorscope.history())")
    assert k.run("%tensorscope on").status == "ok"
    try:
        assert k.run("a1 = x * 3").status == "ok"
        r = k.run("a2 = a1.sum()\nabs(a2.item() * 0)")
        assert r.status == "ok" and r.text() == "0.0"
    finally:
        assert k.run("%tensorscope off").status == "ok"
    assert k.run("a3 = x - 1").status == "ok"
    hist = k.value("[h.ops.column('op').to_pylist() for h in tensorscope.history()]")[n0:]
    assert ["aten.mul.Tensor"] in hist and any("aten.sum.default" in h for h in hist)
    assert not any("aten.sub.Tensor" in h for h in hist)
    r = k.run("%tensorscope last")
    assert r.status == "ok" and "tensorscope trace" in "".join(d.get("text/html", "") for d in r.results)


def test_interrupted_cell_leaves_no_recorder_behind(k):
    r = k.run("%%tensorscope -q\ny = x + 1\nraise KeyboardInterrupt")
    assert r.status == "error"
    assert k.value("__import__('torch').utils._python_dispatch._get_current_dispatch_mode_stack()") == []
    assert k.value("__import__('torch').overrides._get_current_function_mode_stack()") == []
    r = k.run("%%tensorscope -q -o again\ny = x + 2")
    assert r.status == "ok" and k.value("again.ops.num_rows") == 1


def test_line_magic_save_and_help(k, tmp_path):
    k.run("%%tensorscope -q\nx.sin()")
    r = k.run(f"%tensorscope save {tmp_path / 'via_line'}")
    assert r.status == "ok" and os.path.isfile(tmp_path / "via_line" / "ops.parquet")
    r = k.run("%tensorscope help")
    assert "on [OPTIONS]" in r.stdout and "leaks" in r.stdout
    r = k.run("%tensorscope frobnicate")
    assert r.status == "error" and r.error["ename"] == "UsageError"


def test_categories_in_a_notebook_find_the_optimizer_through_the_notebooks_names(k):
    setup = ("torch.manual_seed(0)\n"
             "class Trainer:\n    pass\n"
             "trainer = Trainer()\n"
             "trainer.model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))\n"
             "trainer.opt = torch.optim.Adam(trainer.model.parameters())\n"
             "xb = torch.randn(16, 8)\n"
             "def step():\n"
             "    trainer.model(xb).square().mean().backward()\n"
             "    trainer.opt.step()\n"
             "step()")
    assert k.run(setup).status == "ok"
    r = k.run("%%tensorscope -o tm\nstep()")
    assert r.status == "ok", r.error
    assert "at the peak" in r.html() and "tensorscope-memory" in r.html() and "memory per module" in r.html()
    cats = ("{c: sum(n for n, cc in zip(tm.tensors.column('nbytes').to_pylist(), "
            "tm.tensors.column('category').to_pylist()) if cc == c) for c in "
            "('parameter', 'optimizer_state', 'gradient', 'input')}")
    got = k.value(cats)
    n_param = k.value("sum(p.untyped_storage().nbytes() for p in trainer.model.parameters())")
    n_state = k.value("sum(v.untyped_storage().nbytes() for s in trainer.opt.state.values() for v in s.values())")
    assert got["parameter"] == n_param and got["optimizer_state"] == n_state and got["gradient"] >= n_param
    assert got["input"] == 16 * 8 * 4


def test_predict_cell_runs_nothing_and_matches_the_real_cell(k):
    setup = ("torch.manual_seed(0)\n"
             "pm = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))\n"
             "popt = torch.optim.SGD(pm.parameters(), lr=0.1)\n"
             "px = torch.randn(16, 8)\nw0 = [p.detach().clone() for p in pm.parameters()]")
    assert k.run(setup).status == "ok"
    body = "pred_only = pm(px)\npred_only.square().mean().backward()\npopt.step()\n"
    r = k.run("%%tensorscope --predict -o tp\n" + body)
    assert r.status == "ok", r.error
    assert "tensorscope trace" in r.html() and "memory" in r.html()
    # nothing ran for real: no new name, weights and .grad as they were
    assert k.value("'pred_only' in globals()") is False
    assert k.value("all(torch.equal(a, b) for a, b in zip(w0, pm.parameters()))") is True
    assert k.value("[p.grad for p in pm.parameters()]") == [None] * 4
    r = k.run("%%tensorscope --engine python -o tr -q\n" + body)
    assert r.status == "ok", r.error
    assert k.value("tp.memory.column('live_bytes').to_pylist() == tr.memory.column('live_bytes').to_pylist()") is True
    assert k.value("tp.ops.num_rows == tr.ops.num_rows > 0") is True
