"""The outermost module called is the parent of the top-level module paths only when it is the only
one: a model (no ops of its own) called beside a loss module gives paths ``0``, ``1``, ``2`` and
``<CrossEntropyLoss>``, and the loss is not "the whole model" (it once was, with the model's layers
as its children). The trace records the class of every outermost module it called
(``metadata.module_roots``); a trace saved without it keeps the label rule."""
from __future__ import annotations

import pytest
import torch

import tensorscope
from tensorscope.analyses.totals import module_totals, root_label


def _model_and_loss(engine: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    crit = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 1, 0])
    with tensorscope.trace(engine=engine, leaks=False) as t:
        crit(model(x), y).backward()
    return t.result


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu() * 2   # relu and mul are Net's own ops: "<Net>"


@pytest.mark.parametrize("engine", ["native", "python"])
def test_a_loss_module_beside_the_model_is_not_its_root(engine, tmp_path):
    t = _model_and_loss(engine)
    assert t.metadata.module_roots == ("Sequential", "CrossEntropyLoss")
    rows = {r["module"]: r for r in module_totals(t.ops, t.metadata.module_roots).to_pylist()}
    assert {m: (r["parent"], r["depth"]) for m, r in rows.items()} == {
        "<CrossEntropyLoss>": (None, 0), "0": (None, 0), "1": (None, 0), "2": (None, 0)}
    text = t.summary().to_text()
    assert "(the whole model)" not in text
    # saved and loaded, the same
    t.save(str(tmp_path / "t"))
    back = tensorscope.load(str(tmp_path / "t"))
    assert back.metadata.module_roots == ("Sequential", "CrossEntropyLoss")
    assert "(the whole model)" not in back.summary().to_text()


@pytest.mark.parametrize("engine", ["native", "python"])
def test_one_outermost_module_is_the_root_of_its_children(engine):
    net = Net()
    with tensorscope.trace(engine=engine, leaks=False) as t:
        net(torch.randn(4, 8)).sum().backward()
    t = t.result
    assert t.metadata.module_roots == ("Net",)
    rows = {r["module"]: (r["parent"], r["depth"]) for r in module_totals(t.ops, t.metadata.module_roots).to_pylist()}
    assert rows == {"<Net>": (None, -1), "fc": ("<Net>", 0)}
    assert "<Net>: " in t.summary().to_text() and "(the whole model)" in t.summary().to_text()


def test_the_rule():
    assert root_label(["<Net>", "fc"], ["Net"]) == "<Net>"
    assert root_label(["<Net>", "fc"], None) == "<Net>"            # an older trace: the label rule
    assert root_label(["<CrossEntropyLoss>", "0"], ["Sequential", "CrossEntropyLoss"]) is None
    assert root_label(["<Net>", "<Loss>", "fc"], None) is None
    assert root_label(["fc", "fc.0"], ["Net"]) is None              # the root ran no op of its own
