"""The summary's timeline reads the calls and ops a record batch at a time (``svg.TIMELINE_ROWS``
rows): the same drawing whatever the batch size. A transformer training step gives calls and
forward and backward ops; batches of 1, 3 and 7 rows split every series across
batch boundaries (a wrong merge, such as the scale or the mark counts taken per batch, changes the
paths or their titles)."""
from __future__ import annotations

import re

import pytest
import torch

import tensorscope
from tensorscope.render import svg


@pytest.fixture(scope="module")
def trace():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), layer, torch.nn.Linear(16, 2))
    x = torch.randn(2, 4, 8)
    with tensorscope.trace() as t:
        for _ in range(3):
            model(x).square().mean().backward()
    return t.result


@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("hovers", [0, 20])
def test_the_timeline_is_the_same_in_any_batches(trace, rows, hovers, monkeypatch):
    whole = svg.timeline_svg(trace, hovers=hovers)
    assert whole is not None
    titles = re.findall(r"<title>([^<]*) marks?, ", whole)
    assert any("call" in x.lower() for x in titles) and "calls (depth 0)" in whole
    assert "backward" in whole.lower()
    monkeypatch.setattr(svg, "TIMELINE_ROWS", rows)
    assert svg.timeline_svg(trace, hovers=hovers) == whole


def test_the_marks_and_their_time_are_counted_over_every_batch(trace, monkeypatch):
    monkeypatch.setattr(svg, "TIMELINE_ROWS", 2)
    got = svg.timeline_svg(trace)
    rows = zip(trace.ops.column("phase").to_pylist(), trace.ops.column("start_ns").to_pylist())
    n = sum(1 for phase, start in rows if phase != "backward" and start is not None)
    assert n > 2 and f"ATen op, forward: {n} marks" in got
