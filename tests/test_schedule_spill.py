"""``tensorscope.schedule`` when a window's trace cannot spill (its disk fills): the loop runs to its
end unchanged, the window's trace is kept whole, no further window opens, and the ``with`` statement
raises the ``SpillError`` after the loop (a ``RuntimeWarning`` when the loop raised: its exception wins).

The disk fills through ``recording.spill._open`` (the one function that opens a spill file): the
file it returns raises ENOSPC past a few bytes, as a full disk's ``write`` does. Both engines.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import tensorscope
from tensorscope.errors import SpillError
from tensorscope.recording import spill
from tests.helpers.disk import FullFile

SPILL = dict(chunk_rows=16, spill_rows=32, leaks=False)
STEPS = 12


@pytest.fixture
def full_disk(monkeypatch):
    """Call it to fill the disk: every spill file opened after it takes no byte."""
    real = spill._open
    return lambda: monkeypatch.setattr(spill, "_open", lambda path: FullFile(real(path)))


def _loop(s=None, raise_at=None):
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
            raise ValueError(f"step {i} diverged")
        if s is not None:
            s.step()
    return torch.stack(losses), w.detach().clone()


@pytest.mark.parametrize("engine", ["auto", "python"])
def test_a_full_disk_ends_the_windows_not_the_loop(engine, full_disk, tmp_path):
    expected = _loop()
    with tensorscope.schedule(wait=1, active=3, engine=engine, spill_dir=str(tmp_path), **SPILL) as ref:
        _loop(ref)   # the disk has room: what the first window must hold
    assert len(ref.traces) == 3 and ref.traces[0].metadata["spilled_rows"] > 0
    full_disk()
    got = None
    with pytest.raises(SpillError) as ei:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with tensorscope.schedule(wait=1, active=3, engine=engine, spill_dir=str(tmp_path), **SPILL) as s:
                got = _loop(s)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, expected))   # every step ran
    assert s.current_step == STEPS
    assert len(s.traces) == 1 and s.windows == [[1, 2, 3]]   # no window after the one that failed
    e = ei.value
    assert e.trace is s.traces[0] and e.directory.startswith(str(tmp_path)) and e.needed > 0
    t = s.traces[0]
    assert any("kept in memory" in n for n in t.metadata["notes"])
    cols = ["seq", "op", "phase", "in_shapes", "out_shapes"]
    assert t.ops.select(cols).equals(ref.traces[0].ops.select(cols)) and t.ops.num_rows > 32
    back = tensorscope.load(t.save(tmp_path / "saved"))
    assert back.ops.column("op").to_pylist() == t.ops.column("op").to_pylist()
    assert s.spill_error is None   # raised once, not kept


@pytest.mark.parametrize("engine", ["auto", "python"])
def test_the_loops_exception_wins(engine, full_disk, tmp_path):
    full_disk()
    with pytest.raises(ValueError, match="step 8 diverged") as ei:
        with pytest.warns(RuntimeWarning, match="could not spill the trace"):
            with tensorscope.schedule(wait=1, active=3, engine=engine, spill_dir=str(tmp_path), **SPILL) as s:
                _loop(s, raise_at=8)
    assert type(ei.value) is ValueError
    assert len(s.traces) == 1 and s.spill_error is None
