"""An op whose 4-d inputs mix channels_last and contiguous runs a strided path, many times slower per byte
than with one format: the advisor names it (a ``layout`` finding) only when the trace holds the proof,
the same op and dtype with one format, and its fix is executed here. A channels_last CNN with global
average pooling read "below_roof: threshold_backward ... 4% of the roof; likely: ... a competing load",
while its ReLU backward got a contiguous gradient (from the pool's backward) beside a channels_last
activation: 1.2 ms a call against 34 us for the calls with one format."""
from __future__ import annotations

import pyarrow.compute as pc
import pytest
import torch
import torch.nn.functional as F

import tensorscope
from tensorscope.analyses.advisor import BUSY_SHARE, cpu_wait

ENGINES = ("native", "python")


class WholeMapAvgPool(torch.nn.Module):
    """The fix the finding offers for global average pooling: avg_pool2d over the whole map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x, x.shape[-2:])


def _cnn(pool: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), pool, torch.nn.Flatten(),
                            torch.nn.Linear(32, 10))
    return m.to(memory_format=torch.channels_last)


def _train(engine: str, m: torch.nn.Module) -> tensorscope.Trace:
    x = torch.randn(16, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (16,))

    def steps() -> None:
        for _ in range(3):
            F.cross_entropy(m(x), y).backward()
    for _ in range(2):   # the second trace is warm
        with tensorscope.trace(engine=engine, leaks=False) as t:
            steps()
    return t.result


def _busy(t: tensorscope.Trace) -> bool:
    """Whether a thread of the process waited for a CPU long enough that the advisor reads no timing
    (another process took a core: every op time holds it); the test then checks that it says so."""
    adv = t.advice()
    if adv.busy_left or cpu_wait(t.metadata) >= BUSY_SHARE * t.metadata.wall_ns:
        assert not _mixes(t) and (adv.busy_left == 0 or "read from op times left out" in adv.to_text())
        return True
    return False


def _mixes(t: tensorscope.Trace) -> list[dict]:
    return [f for f in t.advice().findings.to_pylist() if f["kind"] == "layout" and "mixing" in f["subject"]]


def _mixed_rows(t: tensorscope.Trace, op: str) -> list[dict]:
    ops = t.ops.filter(pc.equal(t.ops.column("op").cast("string"), op))
    rows = ops.select(["seq", "in_formats", "in_shapes", "cpu_ns", "bytes_read", "bytes_written"]).to_pylist()
    return [r for r in rows if {"channels_last", "contiguous"} <= {f for f, s in zip(r["in_formats"], r["in_shapes"])
                                                                   if len(s) == 4}]


@pytest.mark.parametrize("engine", ENGINES)
def test_global_pooling_into_channels_last_is_a_layout_finding_whose_fix_removes_it(engine):
    t = _train(engine, _cnn(torch.nn.AdaptiveAvgPool2d(1)))
    mixed = _mixed_rows(t, "aten.threshold_backward.default")
    assert len(mixed) == 3                                 # the last ReLU's backward, once a step
    if _busy(t):
        return
    (f,) = _mixes(t)
    adv = t.advice()
    i = adv.findings.column("subject").to_pylist().index(f["subject"])
    assert adv.rows(i).tolist() == [r["seq"] for r in mixed]   # exactly those rows
    assert f["subject"] == "threshold_backward mixing memory formats"
    assert "3 of threshold_backward's calls (float32) got channels_last and contiguous inputs" in f["seen"]
    assert "made by div (MeanBackward1)" in f["seen"]
    assert 0 < f["cost_ns"] < sum(r["cpu_ns"] for r in mixed)
    assert f["fix"].startswith("global average pooling hands back a contiguous gradient: pool with "
                               "torch.nn.functional.avg_pool2d(x, x.shape[-2:])")
    # one event, one finding: no roofline finding on the same rows beside it
    assert not [g for g in adv.findings.to_pylist() if g["kind"] in ("below_roof", "memory_bound")
                and "threshold_backward" in g["subject"]]

    # the fix, executed: the same model pooled with avg_pool2d over the whole map
    fixed = _train(engine, _cnn(WholeMapAvgPool()))
    assert _mixed_rows(fixed, "aten.threshold_backward.default") == []   # the rows say it, whatever the timing
    assert _mixes(fixed) == []
    a, b = _cnn(torch.nn.AdaptiveAvgPool2d(1)), _cnn(WholeMapAvgPool())
    x = torch.randn(4, 3, 32, 32).to(memory_format=torch.channels_last)
    torch.testing.assert_close(a(x), b(x))                 # the same model


@pytest.mark.parametrize("engine", ENGINES)
def test_a_forward_mix_names_where_the_contiguous_input_is_made_and_converting_it_there_removes_it(engine):
    a = torch.randn(8, 64, 32, 32, dtype=torch.bfloat16).to(memory_format=torch.channels_last)

    def run(fix: bool) -> tensorscope.Trace:
        for _ in range(2):
            with tensorscope.trace(engine=engine, leaks=False) as t:
                b = torch.randn(8, 64, 32, 32, dtype=torch.bfloat16)   # contiguous
                if fix:
                    b = b.contiguous(memory_format=torch.channels_last)
                for _ in range(4):
                    a.add(b)                                # mixed unless fixed
                    a.add(a)                                # one format: the proof
        return t.result

    t = run(False)
    if _busy(t):
        return
    (f,) = _mixes(t)
    assert "4 of add's calls (bfloat16)" in f["seen"] and "for its 4 calls with one format" in f["seen"]
    assert "the contiguous input is made by randn at test_layout_mix.py:" in f["seen"]
    assert f["fix"].startswith("convert the contiguous input once where it is made (randn at test_layout_mix.py:")
    assert f["fix"].endswith(".contiguous(memory_format=torch.channels_last)")
    assert _mixes(run(True)) == []


def test_no_proof_no_finding():
    """Only mixed calls, none with one format: the rows prove no slowdown, so no layout-mix finding."""
    a = torch.randn(8, 64, 32, 32).to(memory_format=torch.channels_last)
    b = torch.randn(8, 64, 32, 32)
    for _ in range(2):
        with tensorscope.trace(leaks=False) as t:
            for _ in range(4):
                a.add(b)
    assert _mixes(t.result) == []
