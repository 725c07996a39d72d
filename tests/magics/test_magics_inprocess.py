"""%%tensorscope and %tensorscope on an in-process IPython shell: the fast tier of the magic tests.

The same paths as tests/magics/test_magics_kernel.py (which runs them in a real ipykernel through
jupyter_client and stays the reference), without starting a kernel: a real ``InteractiveShell``
whose display publisher keeps what the cell displays. ``pytest -m "not kernel"`` runs these.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import tensorscope
from tensorscope.errors import GuardError

IPython = pytest.importorskip("IPython")

from IPython.core.displaypub import DisplayPublisher  # noqa: E402  (after the importorskip)
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402


class CapturingPublisher(DisplayPublisher):
    """Keeps every ``display()`` bundle instead of printing its text."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.bundles: List[Dict[str, Any]] = []

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kw):
        self.bundles.append(data)

    def clear_output(self, wait=False):
        pass

    def html(self) -> str:
        return "".join(b.get("text/html", "") for b in self.bundles)


@pytest.fixture
def shell():
    from traitlets.config import Config

    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    sh = InteractiveShell.instance(config=cfg)   # the autouse fixture clears the singleton afterwards
    sh.display_pub = CapturingPublisher(shell=sh)
    sh.run_line_magic("load_ext", "tensorscope")
    sh.user_ns.update(torch=torch, tensorscope=tensorscope, x=torch.randn(4, 4))
    yield sh
    sh.run_line_magic("tensorscope", "off")


def run(sh, code: str):
    return sh.run_cell(code, store_history=True)


def _clean_stacks() -> bool:
    return list(_get_current_dispatch_mode_stack()) == [] and list(_get_current_function_mode_stack()) == []


def test_traced_cell_displays_its_summary_and_keeps_its_last_expression(shell, tmp_path):
    save = tmp_path / "step1"
    r = run(shell, f"%%tensorscope -o t --save {save}\ny = x @ x\nz = y.relu()\nz.sum().item() * 0 + 7")
    assert r.error_in_exec is None and r.error_before_exec is None
    assert r.result == 7.0 and shell.user_ns["Out"][r.execution_count] == 7.0   # still Out, still displayed
    html = shell.display_pub.html()
    assert "tensorscope trace" in html and "aten.mm.default" in html and "saved to" in html
    assert os.path.isfile(save / "ops.parquet")
    t = shell.user_ns["t"]
    assert t is tensorscope.last()
    assert t.ops.column("op").to_pylist()[:2] == ["aten.mm.default", "aten.relu.default"]
    assert t.ops.column("source_line").to_pylist()[:2] == [2, 3]     # line numbers are the cell's
    assert t.metadata["cell"] == r.execution_count
    assert _clean_stacks()


def test_quiet_displays_nothing_and_options_reach_the_trace(shell):
    r = run(shell, "%%tensorscope -q --no-modules -o t\nlin = torch.nn.Linear(4, 2)\nlin(x)")
    assert r.error_in_exec is None
    assert shell.display_pub.bundles == []
    t = shell.user_ns["t"]
    assert "aten.addmm.default" in t.ops.column("op").to_pylist()
    assert set(t.ops.column("module").to_pylist()) == {None}        # --no-modules: no module recorded
    r = run(shell, "%%tensorscope -q -o t2\nlin(x)")
    assert any(m for m in shell.user_ns["t2"].ops.column("module").to_pylist())   # and by default, one is


def test_a_failing_guard_fails_the_cell_after_it_ran(shell):
    r = run(shell, "%%tensorscope -q --max-casts 0\nh = x.half()")
    assert isinstance(r.error_in_exec, GuardError)
    assert "h" in shell.user_ns                                     # the cell ran
    assert r.error_in_exec.trace is tensorscope.last()


def test_bad_options_are_a_usage_error_and_run_nothing(shell):
    for line in ("%%tensorscope --no-such-option", "%%tensorscope --numerics fp99"):
        r = run(shell, f"{line}\nran = True")
        assert isinstance(r.error_in_exec or r.error_before_exec, UsageError), line
        assert "ran" not in shell.user_ns, line


def test_an_error_in_the_cell_is_recorded_and_raised_unchanged(shell):
    r = run(shell, "%%tensorscope -q -o bad\na = torch.randn(3)\nb = torch.randn(5)\nc = a + b")
    assert isinstance(r.error_in_exec, RuntimeError)
    assert "size of tensor a (3) must match" in str(r.error_in_exec)
    errs = [(e["py_type"], e["op"], e["source_line"]) for e in shell.user_ns["bad"].errors.to_pylist()]
    assert errs[0] == ("RuntimeError", "aten.add.Tensor", 4)
    assert _clean_stacks()
    r = run(shell, "%%tensorscope -q\nraise ValueError('plain python')")
    assert isinstance(r.error_in_exec, ValueError)
    assert tensorscope.last().errors.column("py_type").to_pylist() == ["ValueError"]


def test_an_interrupted_cell_leaves_no_recorder_behind(shell):
    r = run(shell, "%%tensorscope -q\ny = x + 1\nraise KeyboardInterrupt")
    assert isinstance(r.error_in_exec, KeyboardInterrupt)
    assert _clean_stacks()
    r = run(shell, "%%tensorscope -q -o again\ny = x + 2")
    assert r.error_in_exec is None and shell.user_ns["again"].ops.num_rows == 1


def test_on_traces_every_cell_into_history_until_off(shell):
    n0 = len(tensorscope.history())
    run(shell, "%tensorscope on")
    try:
        assert run(shell, "a1 = x * 3").error_in_exec is None
        r = run(shell, "a2 = a1.sum()\nabs(a2.item() * 0)")
        assert r.error_in_exec is None and r.result == 0.0
    finally:
        run(shell, "%tensorscope off")
    assert run(shell, "a3 = x - 1").error_in_exec is None
    ops = [h.ops.column("op").to_pylist() for h in tensorscope.history()[n0:]]
    assert ["aten.mul.Tensor"] in ops and any("aten.sum.default" in o for o in ops)
    assert not any("aten.sub.Tensor" in o for o in ops)


def test_last_returns_the_latest_trace_and_says_when_there_is_none(shell, monkeypatch):
    from tensorscope.recording import history

    monkeypatch.setattr(history, "_last", None)
    r = run(shell, "%tensorscope last")
    assert isinstance(r.error_in_exec, UsageError) and "no trace yet" in str(r.error_in_exec)
    run(shell, "%%tensorscope -q\nx.sin()")
    r = run(shell, "%tensorscope last")
    assert r.error_in_exec is None and r.result is tensorscope.last()
    bundle, _ = shell.display_formatter.format(r.result)               # what Out[n] displays
    assert "tensorscope trace" in bundle["text/html"]


def test_line_magic_save_help_and_an_unknown_subcommand(shell, tmp_path, capsys):
    run(shell, "%%tensorscope -q\nx.cos()")
    assert run(shell, f"%tensorscope save {tmp_path / 'via_line'}").error_in_exec is None
    assert os.path.isfile(tmp_path / "via_line" / "ops.parquet")
    run(shell, "%tensorscope help")
    assert "on [OPTIONS]" in capsys.readouterr().out
    r = run(shell, "%tensorscope frobnicate")
    assert isinstance(r.error_in_exec, UsageError)


def test_help_lists_every_option(shell, capsys):
    import tensorscope.options as O

    run(shell, "%%tensorscope?")
    text = capsys.readouterr().out + "".join(b.get("text/plain", "") for b in shell.display_pub.bundles)
    for flags, _ in O.argparse_arguments():
        assert flags[0] in text, flags
    for flag in ("--output", "--save", "--quiet"):
        assert flag in text


def test_expect_no_syncs_fails_a_cell_with_item_and_the_summary_shows_the_advisor(shell):
    r = run(shell, "%%tensorscope -q --expect no_syncs\nfor _ in range(3):\n    v = x.sum().item()")
    assert isinstance(r.error_in_exec, GuardError)
    msg = str(r.error_in_exec)
    assert "expect no_syncs" in msg and "Tensor.item" in msg and "3x" in msg and ":3)" in msg
    r = run(shell, "%%tensorscope\nfor _ in range(3):\n    v = x.sum().item()")
    assert r.error_in_exec is None
    html = shell.display_pub.html()
    assert "why is it slow: the advisor" in html and "read it once after the loop" in html
    assert f"Tensor.item at Cell In[{r.execution_count}], line 3 ran 3x" in html
    rep = run(shell, "%tensorscope env").result
    assert "peaks cpu" in str(rep) and "GFLOP/s" in rep.to_html()
