"""The memory digest (one bounded sweep of the ops) says what the memory timeline and ``memory_peak`` say.

The summary reads a trace's memory peaks, the chart and the headline's peak from
``memory_digest`` instead of building ``memory_timeline`` and ``memory``; here each is compared
with the same read from the full tables, over blocks of a few ops (many blocks, chart columns
spanning blocks) and one block, on a trace whose peak is tied across bookkeeping ops.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorscope
from tensorscope.analyses.memory import memory_peak, memory_table
from tensorscope.analyses.memory_categories import memory_timeline, peaks
from tensorscope.analyses.memory_digest import digest_memory_peak, digest_peaks, memory_digest
from tensorscope.render.svg_memory import chart_columns, memory_digest_svg, memory_timeline_svg


def _training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(16, 6)
    kept = []
    with tensorscope.trace() as t:
        for _ in range(4):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            kept.append(loss.detach())
    return t.result


def _flat():
    """Every op allocates and frees the same bytes: the peak is tied over every op, bookkeeping ones too."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with tensorscope.trace() as t:
        for _ in range(50):
            a.add(b)
            torch.tensor([1.0, 2.0])
    return t.result


@pytest.fixture(scope="module")
def traces():
    return [_training(), _flat()]


@pytest.mark.parametrize("block,step", [(1, 1), (7, 3), (1 << 16, 1 << 16)])
@pytest.mark.parametrize("columns", [3, 10, 10_000])
def test_the_digest_reads_what_the_timeline_and_memory_peak_read(traces, block, step, columns):
    for t in traces:
        dg = memory_digest(t.tensors, t.ops, columns, block=block, step=step)
        tl = memory_timeline(t.tensors, t.ops)
        assert digest_peaks(dg, t.ops) == peaks(tl)
        want = memory_peak(memory_table(t.tensors, t.ops.num_rows), t.ops, t.tensors)
        assert digest_memory_peak(dg, t.ops, t.tensors) == want
        assert want and all(p["peak_bytes"] > 0 for p in want.values())


@pytest.mark.parametrize("px", [1, 3, 200])
def test_the_digest_draws_the_timeline_chart(traces, px):
    for t in traces:
        dg = memory_digest(t.tensors, t.ops, chart_columns(px_per_column=px), block=5)
        for hovers in (True, False):
            want = memory_timeline_svg(t.memory_timeline.to_arrow(), hovers=hovers, px_per_column=px)
            assert want.startswith("<svg")
            assert memory_digest_svg(dg, t.ops, hovers=hovers) == want


def test_the_chart_columns_hold_the_largest_op_of_each(traces):
    t = traces[0]
    dg = memory_digest(t.tensors, t.ops, 10, block=3)
    (p,) = dg["devices"]
    tl = memory_timeline(t.tensors, t.ops)
    total = tl.column("live_bytes").to_numpy()
    edges = np.linspace(0, t.ops.num_rows, 11).astype(np.int64)
    assert p["drawn"].tolist() == [int(a + np.argmax(total[a:b])) for a, b in zip(edges[:-1], edges[1:])]
    assert p["drawn_live"].sum(axis=0).tolist() == total[p["drawn"]].tolist()


def test_an_empty_trace_has_an_empty_digest():
    with tensorscope.trace() as t:
        pass
    t = t.result
    dg = memory_digest(t.tensors, t.ops, 10)
    assert dg["devices"] == [] and digest_peaks(dg, t.ops) == [] and memory_digest_svg(dg, t.ops) == ""


def test_a_peak_first_reached_by_a_bookkeeping_op_is_named_after_the_next_op_at_it():
    """Built tables (the analyses are pure functions of them): cpu's peak starts at a noise op (a
    detach), a second device peaks later; both read the same from the digest in every block size."""
    import pyarrow as pa

    from tensorscope import schema as S

    names = ["aten.add.Tensor", "aten.detach.default", "aten.mul.Tensor", "aten.detach.default",
             "aten.relu.default", "aten.sum.default"]
    ops = S.conform("ops", pa.table({
        "seq": pa.array(range(6), pa.int64()), "op": names, "phase": ["forward"] * 6,
        "is_noise": [False, True, False, True, False, False], "module": [None, None, "fc", "fc", "fc", None],
        "source_file": ["<cell>"] * 6, "source_line": pa.array([1, 2, 3, 4, 5, 6], pa.int64())}))
    tensors = S.conform("tensors", pa.table({
        "storage_id": pa.array([1, 2, 3], pa.int64()), "nbytes": pa.array([100, 300, 50], pa.int64()),
        "alloc_seq": pa.array([None, 1, 4], pa.int64()), "free_seq": pa.array([None, 3, None], pa.int64()),
        "device": ["cpu", "cpu", "cuda:0"], "category": ["input", "activation", "activation"]}))
    want = memory_peak(memory_table(tensors, 6), ops, tensors)
    assert want["cpu"]["peak_seq"] == 2 and want["cpu"]["peak_op"] == "aten.mul.Tensor"
    assert want["cuda:0"]["peak_seq"] == 4
    tl = memory_timeline(tensors, ops)
    for block in (1, 2, 4, 100):
        for columns in (1, 2, 6):
            dg = memory_digest(tensors, ops, columns, block=block)
            assert digest_memory_peak(dg, ops, tensors) == want
            assert digest_peaks(dg, ops) == peaks(tl)
            assert dg["devices"][0]["peak_seq"] == 1   # the timeline's is_peak: the first op at the peak
            want_svg = memory_timeline_svg(tl, px_per_column=(720 - 64) // columns)
            assert memory_digest_svg(dg, ops) == want_svg != ""
