"""t.repro(seq, path) / python -m tensorscope repro DIR SEQ: each script runs in a fresh process
(only torch, and safetensors for captured inputs, on its path) and must reproduce the recorded
outcome. Runs under the suite's engine (TENSORSCOPE_FORCE_FALLBACK=1: python)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

import tensorscope
from tensorscope.errors import DivergeInputError
from tests.helpers import ROOT, cycles

pytest.importorskip("safetensors", reason="captured inputs are written as safetensors (tensorscope[repro])")


def _run_script(path, cwd):
    """The script in a fresh interpreter that cannot import tensorscope (no PYTHONPATH to it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-I", str(path)], capture_output=True, text=True, cwd=str(cwd), env=env,
                          timeout=300)


def _imports(path):
    mods = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mods.add(node.module)
    return mods


def _seq(t, op):
    return next(r["seq"] for r in t.ops.to_pylist() if r["op"] == op)


def test_fp16_overflow_from_captured_inputs(tmp_path):
    torch.manual_seed(0)
    a = torch.randn(8, 16).half() * 120
    b = torch.randn(16, 8).half() * 120
    with tensorscope.trace(capture="nonfinite", leaks=False) as t:
        c = a @ b
    tr = t.result
    seq = _seq(tr, "aten.mm.default")
    nf = tr.ops.column("nonfinite")[seq].as_py()
    assert nf and 0 < nf < c.numel()        # some positions overflowed, not all
    # across processes: saved, then the CLI writes the script from the directory
    tr.save(str(tmp_path / "run"))
    r = subprocess.run([sys.executable, "-m", "tensorscope", "repro", str(tmp_path / "run"), str(seq), "-o",
                        str(tmp_path / "ovf.py")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ovf.safetensors").exists()
    assert _imports(tmp_path / "ovf.py") == {"torch", "safetensors.torch"}
    out = _run_script(tmp_path / "ovf.py", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"NaN/Inf at the {nf} recorded positions" in out.stdout and "REPRODUCED" in out.stdout
    # the check can fail: other inputs put the infs elsewhere
    import safetensors.torch as st

    data = st.load_file(str(tmp_path / "ovf.safetensors"))
    data["input.0"] = (torch.ones(8, 16).half() * 0.01).view(torch.uint8).reshape(-1)
    st.save_file(data, str(tmp_path / "ovf.safetensors"))
    bad = _run_script(tmp_path / "ovf.py", tmp_path)
    assert bad.returncode == 1 and "NOT REPRODUCED" in bad.stdout


def test_shape_mismatch_error_with_random_inputs(tmp_path):
    x, y = torch.randn(3, 4), torch.randn(5, 6)
    with tensorscope.trace(leaks=False) as t:
        with pytest.raises(RuntimeError) as info:
            torch.mm(x, y)
    tr = t.result
    seq = _seq(tr, "aten.mm.default")
    path = tr.repro(seq, tmp_path / "err.py")
    assert _imports(path) == {"torch"}
    out = _run_script(path, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"reproduced the error: RuntimeError: {str(info.value).splitlines()[0]}" in out.stdout


def test_channels_last_hidden_copy_strides_and_offsets(tmp_path):
    base = torch.randn(3, 3, 4, 4).to(memory_format=torch.channels_last)

    def program():
        x = base[1:]                 # a view with a storage offset
        return x.reshape(2, -1)      # channels_last: reshape copies (a hidden copy)

    with tensorscope.trace(leaks=False) as t0:
        program()
    rows = [r for r in t0.result.ops.to_pylist() if r["hidden_copy"]]
    assert rows, "reshape of a channels_last tensor made no hidden copy"
    seq = rows[0]["seq"]
    with tensorscope.trace(capture=[seq], leaks=False) as t:
        program()
    tr = t.result
    caps = tr.table("captures").to_pylist()
    inp = [c for c in caps if c["kind"] == "input"]
    assert inp and inp[0]["storage_offset"] == 48 and inp[0]["stride"] == [48, 1, 12, 3]
    path = tr.repro(seq, tmp_path / "copy.py")
    out = _run_script(path, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    want = tr.ops.column("out_strides")[seq].as_py()[0]
    assert f"strides {want}" in out.stdout


def test_capture_bytes_exceeded_is_a_note(tmp_path):
    a = torch.randn(64, 64).half() * 100
    with tensorscope.trace(capture="nonfinite", capture_bytes=100, leaks=False) as t:
        a @ a
    tr = t.result
    assert any("capture_bytes=100 reached" in n for n in tr.metadata.notes)
    seq = _seq(tr, "aten.mm.default")
    path = tr.repro(seq, tmp_path / "r.py")   # still written: random values, said so
    text = open(path).read()
    assert "capture_bytes (100) reached" in text
    out = _run_script(path, tmp_path)
    assert "output 0: shape [64, 64]" in out.stdout


def _caps(tr, seq, kind="input"):
    return [c for c in tr.table("captures").to_pylist() if c["seq"] == seq and c["kind"] == kind]


def test_inplace_input_is_captured_before_the_op_wrote_it(tmp_path):
    """x.mul_ overwrites its input with infs: under both engines the capture is the input as it was
    before the op (the row says so), so the script, from those bytes, makes infs at the recorded
    positions; the values the op left ([1e4, 2e4, inf]) would overflow everywhere."""
    x = torch.tensor([1.0, 2.0, 1e4]).half()
    with tensorscope.trace(capture="nonfinite", leaks=False) as t:
        x.mul_(1e4)
    tr = t.result
    seq = next(r["seq"] for r in tr.ops.to_pylist() if r["op"].startswith("aten.mul_"))
    caps = _caps(tr, seq)
    assert caps and caps[0]["note"] == "written by the op: captured before it ran", caps
    assert torch.frombuffer(bytearray(caps[0]["data"]), dtype=torch.float16).tolist() == [1.0, 2.0, 1e4]
    out = _run_script(tr.repro(seq, tmp_path / "inplace.py"), tmp_path)
    assert out.returncode == 0 and "NaN/Inf at the 1 recorded positions" in out.stdout, out.stdout + out.stderr


def test_out_arguments_after_scalars_and_lists(tmp_path):
    """out= after a wrapped number (no tensor in the call) and after a list of tensors (cat): each
    captured tensor is the one the op hook numbers it, and the output the op overwrote is captured
    as it was before; a seq asked for (capture=[seq]) is copied before too."""
    a = torch.full((4,), 300.0).half()
    o = torch.zeros(4).half()
    with tensorscope.trace(capture="nonfinite", leaks=False) as t:
        torch.mul(a, 300.0, out=o)
    tr = t.result
    seq = next(r["seq"] for r in tr.ops.to_pylist() if r["op"] == "aten.mul.out")
    caps = _caps(tr, seq)
    assert [c["note"] for c in caps] == [None, "written by the op: captured before it ran"]
    assert torch.frombuffer(bytearray(caps[1]["data"]), dtype=torch.float16).tolist() == [0.0] * 4
    out = _run_script(tr.repro(seq, tmp_path / "out.py"), tmp_path)
    assert out.returncode == 0 and "NaN/Inf at the 4 recorded positions" in out.stdout, out.stdout + out.stderr

    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    def program(dst):
        torch.cat([x, y], out=dst)

    scratch = torch.full((3,), 7.0)
    with tensorscope.trace(leaks=False) as t0:
        program(scratch)
    seq = next(r["seq"] for r in t0.result.ops.to_pylist() if r["op"] == "aten.cat.out")
    dst = torch.full((3,), 7.0)
    with tensorscope.trace(capture=[seq], leaks=False) as t:
        program(dst)
    tr = t.result
    assert tr.ops.column("op")[seq].as_py() == "aten.cat.out"
    caps = _caps(tr, seq)
    assert [c["note"] for c in caps] == [None, None, "written by the op: captured before it ran"]
    vals = [torch.frombuffer(bytearray(c["data"]), dtype=torch.float32).tolist() for c in caps]
    assert vals == [[1.0, 2.0], [3.0], [7.0, 7.0, 7.0]] and dst.tolist() == [1.0, 2.0, 3.0]
    out = _run_script(tr.repro(seq, tmp_path / "cat.py"), tmp_path)
    assert out.returncode == 0 and "REPRODUCED" in out.stdout, out.stdout + out.stderr


def test_inplace_capture_by_seq_and_on_error():
    """capture=[seq] of an in-place op whose autograd kernel records a row of its own first (the
    clone it saves), and capture="errors" of an in-place op that raised: both copied before."""
    w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)

    def program():
        h = w * 1
        h.mul_(w)
        return h

    with tensorscope.trace(leaks=False) as t0:
        program()
    ops = t0.result.ops.column("op").to_pylist()
    assert ops == ["aten.mul.Tensor", "aten.clone.default", "aten.mul_.Tensor"]
    with tensorscope.trace(capture=[2], leaks=False) as t:
        h = program()
    caps = _caps(t.result, 2)
    assert caps[0]["note"] == "written by the op: captured before it ran"
    assert torch.frombuffer(bytearray(caps[0]["data"]), dtype=torch.float32).tolist() == [1.0, 2.0, 3.0]
    assert h.tolist() == [1.0, 4.0, 9.0]
    x = torch.tensor([1.0, 2.0])
    with tensorscope.trace(capture="errors", leaks=False) as t:
        with pytest.raises(RuntimeError):
            x.add_(torch.ones(3))
    tr = t.result
    seq = next(r["seq"] for r in tr.ops.to_pylist() if r["op"] == "aten.add_.Tensor")
    assert [c["note"] for c in _caps(tr, seq)] == ["written by the op: captured before it ran", None]


def test_capture_keeps_no_reference_to_the_inputs():
    """capture= hands the op hook every aten op's inputs; an op that decomposes (linear) must not
    keep them (the native engine dropped a decomposed op's inputs without releasing them)."""
    import weakref

    import torch.nn.functional as F

    with cycles.no_collector():   # not even in a reference cycle (until a collection): eager frees them at ``del``
        for capture in ("nonfinite", "errors", "every op"):
            x, w = torch.randn(4, 8), torch.randn(3, 8)
            with tensorscope.trace(capture=capture if capture != "every op" else list(range(8)), leaks=False) as t:
                y = F.linear(x, w)
                x.mul_(2.0)
            if capture == "every op":
                assert t.result.table("captures").num_rows > 0   # the inputs were saved (copied)
            refs = [weakref.ref(x), weakref.ref(w), weakref.ref(y)]
            del x, w, y, t
            assert [r() is None for r in refs] == [True, True, True], capture


def test_bad_input(tmp_path):
    with tensorscope.trace(leaks=False) as t:
        torch.randn(4, 4).sum(dim=1)
    tr = t.result
    with pytest.raises(DivergeInputError, match="no op with seq 999"):
        tr.repro(999, tmp_path / "x.py")
    seq = _seq(tr, "aten.sum.dim_IntList")
    with pytest.raises(DivergeInputError, match=rf"'dim'.*capture=\[{seq}\]"):
        tr.repro(seq, tmp_path / "x.py")
    assert not (tmp_path / "x.py").exists()
