"""In a real ipykernel, traced cells (``%%tensorscope``, always-on, one that raises) leave nothing of
tensorscope's in a reference cycle: what a cell recorded is freed when the cell ends, not at the
collector's next full pass (tests/recording/test_no_cycles.py does the same for the Python API)."""
from __future__ import annotations

import pathlib

import pytest

from tests.helpers.kernel_utils import Kernel

ROOT = str(pathlib.Path(__file__).resolve().parents[2])   # the repository: tests.helpers imports from it

pytestmark = pytest.mark.kernel

SETUP = r'''
%load_ext tensorscope
import sys
sys.path.insert(0, {root!r})
import torch
from tests.helpers import cycles

model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
x = torch.randn(8, 16)
'''

CELL = "loss = model(x).pow(2).sum()\nloss.backward()\nloss"


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    kern = Kernel(cwd=str(tmp_path_factory.mktemp("cycles")))
    r = kern.run(SETUP.format(root=ROOT))
    assert r.status == "ok", r.error
    yield kern
    kern.close()


def _off(k: Kernel) -> None:
    r = k.run("cycles.start()")
    assert r.status == "ok", r.error


def test_a_traced_cell_leaves_no_reference_cycle(k):
    for _ in range(2):   # warm
        assert k.run("%%tensorscope\n" + CELL).status == "ok"
    _off(k)
    r = k.run("%%tensorscope\n" + CELL)
    assert r.status == "ok", r.error
    assert "tensorscope trace of cell" in r.html() + r.stdout   # the summary was shown
    assert k.value("cycles.found()") == []


def test_a_traced_cell_that_raises_leaves_no_reference_cycle(k):
    bad = "%%tensorscope\nmodel(torch.randn(8, 3))"
    assert k.run(bad).status == "error"
    _off(k)
    r = k.run(bad)
    assert r.status == "error" and r.error["ename"] == "RuntimeError"
    assert k.value("cycles.found()") == []


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
    assert k.value("cycles.found()") == []
