"""A disk that fills while a trace spills: a clear SpillError after the block naming the directory
and the bytes needed, the program's results and its own exception untouched, the trace whole and
loadable.

Spilling is forced with tiny ``chunk_rows``/``spill_rows``. The disk fills for real on a tiny tmpfs
(skipped where mounting is not permitted) and, everywhere, through ``recording.spill._open`` (the
one function that opens a spill file) returning a file that takes a few bytes, then raises ENOSPC
as a full disk's ``write`` does. Each test runs under the engine the environment selects (native
by default, python under ``TENSORSCOPE_FORCE_FALLBACK=1``) and under ``engine="python"``.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import traceback
import warnings

import pytest
import torch

import tensorscope
from tensorscope.errors import ExportError, SpillError
from tensorscope.recording import session as session_mod
from tensorscope.recording import spill
from tests.helpers.disk import FullFile

SPILL = dict(chunk_rows=16, spill_rows=32, leaks=False)
STEPS = 60


def _program(raise_at=None):
    """A small training loop: its results are compared bit for bit with an untraced run."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=g, requires_grad=True)
    x = torch.randn(4, 8, generator=g)
    losses = []
    for i in range(STEPS):
        loss = (x @ w).relu().sum()
        loss.backward()
        with torch.no_grad():
            w -= 0.01 * w.grad
            w.grad = None
        losses.append(loss.detach())
        if raise_at == i:
            raise ValueError(f"step {i} diverged: loss {float(loss.detach()):.3f}")
    return torch.stack(losses), w.detach().clone()


def _call(cm, raise_at=None):
    with cm:
        return _program(raise_at)


def _untraced(raise_at=None):
    return _call(contextlib.nullcontext(), raise_at)


@pytest.fixture(params=["auto", "python"])
def engine(request):
    return request.param


@pytest.fixture(autouse=True)
def _fresh_tracer_warning(monkeypatch):
    # a contained tracer bug warns once per process: make sure this test would see it
    monkeypatch.setattr(session_mod, "_warned_tracer_bug", False)


def _reference(engine):
    """The same program traced onto a disk with room: what the trace must hold."""
    with tensorscope.trace(engine=engine, **SPILL) as t:
        _program()
    assert t.metadata["spilled_rows"] > 0 and t.metadata["tracer_errors"] == 0
    return t.result


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(suffix, files_ok, room)``: spill files whose name ends with ``suffix`` fill the
    disk: the first ``files_ok`` are written whole, the next gets ``room`` bytes. Returns the list
    of paths opened."""
    opened = []

    def install(suffix, files_ok=0, room=100):
        real = spill._open
        state = {"n": 0}

        def opener(path):
            opened.append(path)
            f = real(path)
            if not path.endswith(suffix):
                return f
            state["n"] += 1
            return f if state["n"] <= files_ok else FullFile(f, room)

        monkeypatch.setattr(spill, "_open", opener)
        return opened

    return install


def _check_error(e, spill_dir):
    msg = str(e)
    assert e.directory.startswith(str(spill_dir)) and repr(e.directory) in msg     # the directory
    assert e.needed > 0 and f"({e.needed} bytes)" in msg                           # the bytes needed
    assert "No space left on device" in msg and "spill_dir=" in msg and "spill_rows=" in msg
    assert e.free is not None and "free there" in msg
    assert isinstance(e, OSError) and isinstance(e, tensorscope.TensorscopeError)
    assert isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.ENOSPC


def _check_trace_whole(t, ref, tmp_path):
    assert t is tensorscope.last()
    assert t.metadata["tracer_errors"] == 0   # not a tensorscope bug: nothing asks to report it
    assert any("kept in memory" in n for n in t.metadata["notes"])
    cols = ["seq", "op", "phase", "in_shapes", "out_shapes", "source_line"]
    assert t.ops.select(cols).equals(ref.ops.select(cols))
    assert t.tensors.num_rows == ref.tensors.num_rows
    back = tensorscope.load(t.save(tmp_path / "saved"))
    assert back.ops.select(cols).equals(ref.ops.select(cols))
    assert any("kept in memory" in n for n in back.metadata["notes"])   # the saved trace says so too


def _no_part_left(opened):
    assert opened and all(not os.path.exists(p) for p in opened if p.endswith(".part"))


@pytest.mark.parametrize("where", ["chunks", "ops file"])
def test_a_full_disk_is_a_clear_error_and_the_trace_stays_whole(engine, where, full_disk, tmp_path):
    ref = _reference(engine)
    expected = _untraced()
    if where == "chunks":   # the third chunk file fills the disk half way
        opened = full_disk(".npz.part", files_ok=2, room=1000)
    else:                   # every chunk spills; the decoded tables do not fit at the end
        opened = full_disk(".arrow.part", room=20_000)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    cm = tensorscope.trace(engine=engine, spill_dir=str(spill_dir), **SPILL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no warning besides the error: no "internal error" one
        with pytest.raises(SpillError) as ei:
            got = None
            with cm:
                got = _program()
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, expected))   # the block ran whole
    e = ei.value
    _check_error(e, spill_dir)
    # the chunk file that filled the disk; or the first decoded table's file that did not fit
    # (calls, ops and tensors are each written into the spill directory at the end)
    assert re.search(r"chunk-000002\.npz" if where == "chunks" else r"(calls|ops|tensors)\.arrow", str(e))
    assert e.trace is cm.result
    t = e.trace
    assert t.metadata["spilled_rows"] == (32 if where == "chunks" else ref.metadata["spilled_rows"])
    _check_trace_whole(t, ref, tmp_path)
    _no_part_left(opened)
    assert os.listdir(spill_dir) == []   # the spill directory is cleaned up as usual


def test_the_users_exception_wins_and_is_untouched(engine, full_disk, tmp_path):
    def run(cm):
        try:
            _call(cm, raise_at=40)
        except ValueError as err:
            return err
        raise AssertionError("no exception")

    plain = run(contextlib.nullcontext())
    opened = full_disk(".npz.part", files_ok=1, room=10)
    with pytest.warns(RuntimeWarning, match="could not spill the trace") as rec:
        traced = run(tensorscope.trace(engine=engine, spill_dir=str(tmp_path), **SPILL))
    assert type(traced) is ValueError and str(traced) == str(plain)
    frames = [(f.name, f.line) for f in traceback.extract_tb(traced.__traceback__)]
    assert frames == [(f.name, f.line) for f in traceback.extract_tb(plain.__traceback__)]
    assert all(not isinstance(w.message, RuntimeWarning) or "could not spill" in str(w.message) for w in rec)
    t = tensorscope.last()
    assert t.errors.column("py_type").to_pylist() == ["ValueError"]
    back = tensorscope.load(t.save(tmp_path / "saved"))
    assert back.ops.num_rows == t.ops.num_rows > 32 and back.metadata["spilled_rows"] == 16
    _no_part_left(opened)


def test_a_missing_spill_directory_is_the_same_clear_error(engine, tmp_path):
    missing = tmp_path / "no" / "such"
    x = torch.ones(4)
    with pytest.raises(SpillError, match="the directory does not exist") as ei:
        with tensorscope.trace(engine=engine, spill_dir=str(missing), **SPILL):
            for _ in range(100):
                x = x + 1
    assert torch.equal(x, torch.full((4,), 101.0))
    assert ei.value.directory == str(missing) and repr(str(missing)) in str(ei.value)
    assert ei.value.needed > 0 and f"({ei.value.needed} bytes)" in str(ei.value)   # what it was about to write
    assert ei.value.trace.ops.num_rows == 100 and ei.value.trace.metadata["spilled_rows"] == 0


@contextlib.contextmanager
def _tmpfs(path, size):
    path.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root and CAP_SYS_ADMIN are needed): {r.stderr.strip()}")
    try:
        yield path
    finally:
        # lazily where busy (a trace still maps a spilled part from it): never left mounted
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def test_a_real_full_tmpfs(engine, tmp_path):
    ref = _reference(engine)
    expected = _untraced()
    with _tmpfs(tmp_path / "tiny", "64k") as disk:
        cm = tensorscope.trace(engine=engine, spill_dir=str(disk), **SPILL)
        with pytest.raises(SpillError) as ei:
            with cm:
                got = _program()
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        e = ei.value
        _check_error(e, disk)
        assert e.free < e.needed   # what the filesystem had left did not hold the file
        assert 0 < cm.result.metadata["spilled_rows"] < ref.metadata["spilled_rows"]
        assert os.listdir(disk) == []   # nothing left behind: the disk is free again
    _check_trace_whole(cm.result, ref, tmp_path)


def test_dataset_parts_that_cannot_be_written_while_recording(engine, tmp_path):
    """``dataset=`` writes spilled rows as parts while the trace records: a failure there is the
    dataset's ExportError at the end (the trace kept), not a contained tensorscope bug."""
    in_the_way = tmp_path / "file"
    in_the_way.write_text("x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ExportError, match="a file with that name exists"):
            with tensorscope.trace(engine=engine, dataset=str(in_the_way), **SPILL):
                got = _program()
    assert all(torch.equal(a, b) for a, b in zip(got, _untraced()))
    t = tensorscope.last()
    assert t.metadata["tracer_errors"] == 0 and t.ops.num_rows == _reference(engine).ops.num_rows


MAGIC_SETUP = """
import errno, os, torch, tensorscope
from tensorscope.recording import spill
_real_open = spill._open
class _Full:
    def __init__(self, f): self.f = f
    def write(self, b): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    def __getattr__(self, k): return getattr(self.f, k)
def _full_after_one(path, n=[0]):
    f = _real_open(path)
    n[0] += 1
    return f if n[0] <= 1 else _Full(f)
spill._open = _full_after_one
x = torch.ones(8, 8)
"""


@pytest.mark.kernel
def test_the_magic_reports_it_after_the_cell_and_keeps_the_value_and_trace(tmp_path):
    from tests.helpers.kernel_utils import Kernel

    k = Kernel(cwd=str(tmp_path))
    try:
        assert k.run("%load_ext tensorscope").status == "ok"
        assert k.run(MAGIC_SETUP).status == "ok"
        flags = f"-o t --chunk-rows 16 --spill-rows 32 --spill-dir {tmp_path} --no-leaks"
        r = k.run(f"%%tensorscope {flags}\nfor i in range(100):\n    x = x + 1\nx.sum().item()")
        assert r.status == "error" and r.error["ename"] == "SpillError", r.error
        assert str(tmp_path) in r.error["evalue"] and "bytes)" in r.error["evalue"]
        assert k.value("x.sum().item()") == 64 * 101.0       # the cell ran whole
        assert "tensorscope trace" in r.html()                # its summary is shown all the same
        assert k.value("t.ops.column('op').to_pylist().count('aten.add.Tensor')") == 100
        assert k.value(f"tensorscope.load(t.save({str(tmp_path / 'saved')!r})).ops.num_rows == t.ops.num_rows")
        # the cell's own exception comes first; the spill failure is a warning beside it
        r = k.run(f"%%tensorscope -q {flags}\nfor i in range(100):\n    x = x + 1\nraise KeyError('mine')")
        assert r.status == "error" and r.error["ename"] == "KeyError" and r.error["evalue"] == "'mine'"
        assert "could not spill the trace" in r.stdout
        assert k.value("x.sum().item()") == 64 * 201.0
    finally:
        k.close()


def test_tensorscope_run_says_it_and_keeps_the_scripts_status_and_dataset(tmp_path):
    import sys

    script = tmp_path / "train.py"
    script.write_text("import sys, torch\nx = torch.ones(4)\nfor _ in range(100):\n    x = x + 1\n"
                      "print(x.sum().item())\nsys.exit(3)\n")
    missing, out = tmp_path / "no" / "such", tmp_path / "ds"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-m", "tensorscope", "run", "--out", str(out), "--spill-dir", str(missing),
                        "--chunk-rows", "16", "--spill-rows", "32", "--no-leaks", str(script)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert r.returncode == 3, r.stderr                  # the script's own status
    assert r.stdout.strip() == "404.0"
    assert "tensorscope could not spill the trace to" in r.stderr and str(missing) in r.stderr
    n = tensorscope.open_dataset(out).sql("SELECT count(*) AS n FROM ops WHERE op = 'aten.add.Tensor'")["n"][0]
    assert int(n) == 100                                 # the dataset has the whole trace


def test_a_spill_file_is_whole_or_absent(tmp_path):
    d = str(tmp_path)
    with spill.spill_file(d, "a.bin", 10) as f:
        f.write(b"0123456789")
    assert os.listdir(d) == ["a.bin"] and (tmp_path / "a.bin").read_bytes() == b"0123456789"
    with pytest.raises(SpillError, match=r"disk quota is used up\) while writing b\.bin, which needed 10 B \(10 bytes\)"):
        with spill.spill_file(d, "b.bin", 10) as f:
            f.write(b"01234")
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    with pytest.raises(KeyboardInterrupt):
        with spill.spill_file(d, "c.bin", 10) as f:
            f.write(b"01234")
            raise KeyboardInterrupt
    assert os.listdir(d) == ["a.bin"]   # neither half-written file is left
