"""layout_changes finds its candidate ops a record batch at a time: the same rows whatever the batches.

The candidates (format changes, hidden copies, non-dense inputs, bookkeeping rows left out) are found
``rows`` ops at a time; here one op, three ops and a table of chunks of two ops give the
rows of one batch of every op, on a trace with every kind of row and bookkeeping ops between them.
"""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F

import tensorscope
from tensorscope.analyses.layout import layout_changes


def _trace():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    a = torch.randn(8, 16)
    gapped = torch.randn(8, 32)[:, ::2]
    with tensorscope.trace() as t:
        F.layer_norm(x, (5,))
        torch.tensor([1.0, 2.0])              # bookkeeping ops (lift_fresh, detach_) between the findings
        x.flatten(1)
        x.contiguous()
        torch.tensor([3.0])
        torch.mm(gapped.t(), a)
        torch.randn(3, 4).t().reshape(-1)
        x.softmax(dim=1)
    return t.result


@pytest.mark.parametrize("rows", [1, 3])
def test_the_candidates_read_a_batch_at_a_time_give_the_same_rows(rows):
    t = _trace()
    want = layout_changes(t.ops, t.calls)
    kinds = set(want.column("kind").to_pylist())
    assert {"format_change", "hidden_copy", "non_dense_input"} <= kinds, kinds
    assert t.ops.column("is_noise").to_pylist().count(True) >= 2
    assert layout_changes(t.ops, t.calls, rows=rows).equals(want)
    chunked = pa.Table.from_batches(t.ops.to_batches(max_chunksize=2))
    assert layout_changes(chunked, t.calls).equals(want)
