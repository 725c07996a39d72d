"""In a real ipykernel, traced cells (``%%tensorscope``, always-on, one that raises) leave nothing of
tensorscope's in a reference cycle: what a cell recorded is freed when the cell ends, not at the
collector's next full pass (tests/recording/test_no_cycles.py does the same for the Python API)."""
from __future__ import annotations

import pytest

from tests.helpers.kernel_utils import Kernel

pytestmark = pytest.mark.kernel

SETUP = r'''
%load_ext tensorscope
import gc, os, types
import torch
import tensorscope

_PKG = os.path.dirname(tensorscope.__file__)

def _ours(o):
    if isinstance(o, types.FrameType):
        return o.f_code.co_filename.startswith(_PKG)
    if isinstance(o, types.MethodType):
        o = o.__func__
    if isinstance(o, types.FunctionType):
        return o.__code__.co_filename.startswith(_PKG)
    return (type(o).__module__ or "").startswith("tensorscope")

def _found():
    gc.collect()
    out = sorted({type(o).__qualname__ if not isinstance(o, (types.FunctionType, types.FrameType)) else repr(o)[:80]
                  for o in gc.garbage if _ours(o)})
    gc.set_debug(0)
    gc.garbage.clear()
    gc.enable()
    return out

model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
x = torch.randn(8, 16)
'''

CELL = "loss = model(x).pow(2).sum()\nloss.backward()\nloss"


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    kern = Kernel(cwd=str(tmp_path_factory.mktemp("cycles")))
    r = kern.run(SETUP)
    assert r.status == "ok", r.error
    yield kern
    kern.close()


def _off(k: Kernel) -> None:
    r = k.run("gc.collect(); gc.disable(); gc.set_debug(gc.DEBUG_SAVEALL)")
    assert r.status == "ok", r.error


def test_a_traced_cell_leaves_no_reference_cycle(k):
    for _ in range(2):   # warm
        assert k.run("%%tensorscope\n" + CELL).status == "ok"
    _off(k)
    r = k.run("%%tensorscope\n" + CELL)
    assert r.status == "ok", r.error
    assert "tensorscope trace of cell" in r.html() + r.stdout   # the summary was shown
    assert k.value("_found()") == []


def test_a_traced_cell_that_raises_leaves_no_reference_cycle(k):
    bad = "%%tensorscope\nmodel(torch.randn(8, 3))"
    assert k.run(bad).status == "error"
    _off(k)
    r = k.run(bad)
    assert r.status == "error" and r.error["ename"] == "RuntimeError"
    assert k.value("_found()") == []


def test_always_on_cells_leave_no_reference_cycle(k):
    assert k.run("%tensorscope on").status == "ok"
    try:
        for _ in range(2):
            assert k.run(CELL).status == "ok"
        _off(k)
        for _ in range(2):
            assert k.run(CELL).status == "ok"
    finally:
        assert k.run("%tensorscope off").status == "ok"
    assert k.value("_found()") == []
