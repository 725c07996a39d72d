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
from tests.helpers import ROOT

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


def test_inplace_capture_says_when_it_was_taken(tmp_path):
    """An in-place op overwrites its input: the python engine copies it before the op (the repro
    then makes the same infs), the native engine can only take it after (the row says so)."""
    x = torch.tensor([1e4, 2.0, 3.0]).half()
    with tensorscope.trace(capture="nonfinite", leaks=False) as t:
        x.mul_(1e4)
    tr = t.result
    caps = [c for c in tr.table("captures").to_pylist() if c["kind"] == "input"]
    assert caps and "written by the op" in (caps[0]["note"] or "")
    seq = _seq(tr, "aten.mul_.Scalar") if "aten.mul_.Scalar" in tr.ops.column("op").to_pylist() else _seq(
        tr, "aten.mul_.Tensor")
    if "before it ran" in caps[0]["note"]:
        assert tr.metadata["engine"] == "python"
        out = _run_script(tr.repro(seq, tmp_path / "inplace.py"), tmp_path)
        assert out.returncode == 0 and "NaN/Inf at the 1 recorded positions" in out.stdout, out.stdout
    else:
        assert tr.metadata["engine"] == "native" and "as the op left it" in caps[0]["note"]


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
