"""Cell guards: trace(expect=..., max_casts=...) and %%tensorscope --expect/--max-casts."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F

import tensorscope
from tensorscope import schema as S
from tensorscope.analyses.guards import check_guards
from tensorscope.errors import GuardError, TensorscopeError

CL = torch.channels_last


def _cl(*shape):
    return torch.randn(*shape).to(memory_format=CL)


def test_channels_last_guard_fails_after_the_block_and_keeps_the_trace():
    x = _cl(2, 3, 4, 5)
    ran = []
    with pytest.raises(GuardError) as ei:
        with tensorscope.trace(expect="channels_last"):
            y = F.layer_norm(x, (5,))
            ran.append(True)                  # the block ran to the end
    assert ran == [True]
    err = ei.value
    assert isinstance(err, TensorscopeError) and isinstance(err, AssertionError)
    assert err.trace is not None and err.trace.ops.num_rows >= 1
    assert tensorscope.last() is err.trace
    (msg,) = err.failures
    assert "expect channels_last" in msg and "aten.native_layer_norm.default" in msg
    assert "layer_norm()" in msg and "channels_last -> contiguous" in msg
    assert f"{__import__('os').path.basename(__file__)}:" in msg
    assert "tensorscope guard failed" in str(err)


def test_channels_last_guard_passes_when_the_format_is_kept():
    x = _cl(2, 3, 8, 8)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1).to(memory_format=CL)
    with tensorscope.trace(expect=("channels_last",)) as t:
        F.max_pool2d(torch.relu(conv(x)), 2)
        F.adaptive_avg_pool2d(conv(x), 1).flatten(1)     # (N, C, 1, 1): ambiguous, not a loss
    assert check_guards(t.result) == []


def test_channels_last_guard_fails_when_nothing_was_channels_last():
    conv = torch.nn.Conv2d(3, 4, 3)
    with pytest.raises(GuardError) as ei:
        with tensorscope.trace(expect="channels_last"):
            conv(torch.randn(1, 3, 8, 8))
    (msg,) = ei.value.failures
    assert "no tensor in this cell was channels_last" in msg and "memory_format=torch.channels_last" in msg


def test_max_casts_counts_every_kind():
    a = torch.randn(4).half()
    b = torch.randn(4)
    def body():
        a + b              # promotion
        b.half()           # explicit
        a.clone().add_(b)  # implicit downcast
    with tensorscope.trace(max_casts=3) as ok:
        body()
    assert ok.casts.num_rows == 3
    with pytest.raises(GuardError) as ei:
        with tensorscope.trace(max_casts=2):
            body()
    (msg,) = ei.value.failures
    assert msg.startswith("max_casts=2: 3 casts ran")
    assert "promotion up x1" in msg and "implicit_downcast down x1" in msg and "explicit down x1" in msg


def test_no_nonfinite_guard_names_the_first_producer():
    a = torch.tensor([1.0, 2.0])
    with pytest.raises(GuardError) as ei:
        with tensorscope.trace(expect="no_nonfinite"):
            b = a / 0
            c = b * 2
    (msg,) = ei.value.failures
    assert "2 op(s) output NaN/Inf (1 produced them, 1 propagated)" in msg
    assert "first produced by aten.div.Tensor" in msg
    with tensorscope.trace(expect="no_nonfinite"):
        a * 2


def test_no_nonfinite_guard_cannot_check_without_the_screen():
    with pytest.raises(GuardError) as ei:
        with tensorscope.trace(expect="no_nonfinite", nonfinite=False):
            torch.randn(3) * 2
    assert "the non-finite screen was off" in ei.value.failures[0]


def test_no_hidden_copies_guard():
    a = torch.randn(3, 4)
    with pytest.raises(GuardError) as ei:
        with tensorscope.trace(expect="no_hidden_copies"):
            a.t().reshape(-1)
    (msg,) = ei.value.failures
    assert "1 hidden cop" in msg and "reshape() copied" in msg and "48 B" in msg
    with tensorscope.trace(expect="no_hidden_copies"):
        a.reshape(-1)


def test_several_guards_report_every_failure():
    x = _cl(2, 3, 4, 5)
    with pytest.raises(GuardError) as ei:
        with tensorscope.trace(expect=("channels_last", "no_hidden_copies", "no_nonfinite"), max_casts=0):
            x.flatten(1).half()
    f = ei.value.failures
    assert len(f) == 3
    assert f[0].startswith("expect channels_last") and f[1].startswith("expect no_hidden_copies")
    assert f[2].startswith("max_casts=0")


def test_a_user_exception_wins_over_guards():
    x = _cl(2, 3, 4, 5)
    with pytest.raises(ZeroDivisionError):
        with tensorscope.trace(expect="channels_last"):
            F.layer_norm(x, (5,))
            1 / 0


class _FakeTrace:
    """Just what check_guards reads: metadata and tables."""

    def __init__(self, options, **tables):
        self.metadata = {"options": options}
        for name in S.TABLES:
            setattr(self, name, tables.get(name, S.empty(name)))


def test_no_leaks_guard_reads_the_leaks_table():
    leaks = pa.Table.from_pylist([{
        "storage_id": 3, "nbytes": 4096, "device": "cpu", "dtype": "float32", "shape": [32, 32], "alloc_seq": 7,
        "alloc_op": "aten.mm.default", "cell": 4, "source_file": "cell.py", "source_line": 2,
        "holder": "global losses[0] → grad_fn … saved mat1", "holder_kind": "global", "fix": "losses.append(loss.item())",
    }], schema=S.LEAKS)
    failures = check_guards(_FakeTrace({"expect": ["no_leaks"]}, leaks=leaks))
    assert len(failures) == 1
    assert "1 storage(s)" in failures[0] and "global losses[0]" in failures[0] and "loss.item()" in failures[0]
    assert check_guards(_FakeTrace({"expect": ["no_leaks"]})) == []
    assert check_guards(_FakeTrace({})) == []


def test_guards_recheck_a_loaded_trace(tmp_path):
    x = _cl(2, 3, 4, 5)
    with pytest.raises(GuardError) as ei:
        with tensorscope.trace(expect="channels_last", max_casts=5):
            x.softmax(dim=1)
    p = ei.value.trace.save(str(tmp_path / "t"))
    back = tensorscope.load(p)
    assert check_guards(back) == ei.value.failures


# ---------------------------------------------------------------------------------------------
# the magic (in-process shell)

@pytest.fixture
def shell():
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "tensorscope")
    sh.user_ns["torch"] = torch
    yield sh
    sh.run_cell("%tensorscope off")


def test_magic_expect_channels_last_fails_the_cell(shell, capsys):
    shell.user_ns["x"] = _cl(2, 3, 4, 5)
    r = shell.run_cell("%%tensorscope --quiet --expect channels_last\n"
                       "import torch.nn.functional as F\n"
                       "y = F.layer_norm(x, (5,))\n")
    assert isinstance(r.error_in_exec, GuardError)
    assert "aten.native_layer_norm.default" in str(r.error_in_exec)
    assert "y" in shell.user_ns                     # the cell ran
    assert r.error_in_exec.trace is tensorscope.last()


def test_magic_new_options(shell):
    shell.user_ns["h"] = torch.randn(16, 16).bfloat16()
    r = shell.run_cell("%%tensorscope --quiet --numerics --no-nonfinite --max-casts 0 -o tr\nz = h @ h\n")
    assert r.error_in_exec is None, r.error_in_exec
    t = shell.user_ns["tr"]
    opts = t.metadata["options"]
    assert opts["numerics"] == "fp32" and opts["nonfinite"] is False and opts["max_casts"] == 0
    (mm,) = [row for row in t.ops.to_pylist() if row["op"] == "aten.mm.default"]
    assert mm["num_rel_err"] is not None and mm["nonfinite"] is None
    r = shell.run_cell("%%tensorscope --quiet --max-casts 0 --expect no_nonfinite\nw = h.float() / 0\n")
    assert isinstance(r.error_in_exec, GuardError)
    assert len(r.error_in_exec.failures) == 2
