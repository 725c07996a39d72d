"""The casts table of a trace whose tables come in many record batches (a spilled trace: chunks of 8
rows) equals that of the same tables in one batch: candidate rows taken batch by batch
(``opview.take_table_rows``), the calls' names and autocast states read a batch at a time. Both engines."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

import tensorscope
from tensorscope.analyses import totals
from tensorscope.analyses.casts import _analyse_uncached, _calls_of
from tensorscope.analyses.opview import take_table_rows as take_chunked


def test_take_chunked_equals_take_over_one_batch():
    rng = np.random.default_rng(0)
    sizes = [5, 1, 0, 17, 3, 9]
    dicts = [pa.array([f"v{i}", f"w{i}", "x"]) for i in range(len(sizes))]    # each batch its own dictionary
    batches = [pa.record_batch({"a": pa.array(np.arange(n) + 100 * i),
                                "s": pa.DictionaryArray.from_arrays(pa.array(np.arange(n) % 3, pa.int32()), dicts[i])})
               for i, n in enumerate(sizes)]
    table = pa.Table.from_batches(batches)
    idx = rng.integers(0, table.num_rows, 40)          # unsorted, repeated, across every batch
    got = take_chunked(table, idx)
    want = table.combine_chunks().take(pa.array(idx))
    assert got.column("a").to_pylist() == want.column("a").to_pylist()
    assert got.column("s").to_pylist() == want.column("s").to_pylist()


def _traced():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with tensorscope.trace(chunk_rows=8, spill_rows=16) as t:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(x)
            y.float().double().float()
            z = x.half() + x      # a promotion
            z.sum()
    return t.result


def test_casts_of_many_batches_equal_one_batch(monkeypatch):
    t = _traced()
    monkeypatch.setattr(totals, "BATCH_ROWS", 3)
    ops, calls = t.ops, t.calls
    assert ops.column("seq").num_chunks > 1 and calls.column("call_id").num_chunks > 1
    got, pairs = _analyse_uncached(ops, calls)
    want, pairs1 = _analyse_uncached(ops.combine_chunks(), calls.combine_chunks())
    assert got.equals(want) and pairs == pairs1 > 0
    kinds = set(got.column("kind").to_pylist())
    assert {"autocast", "explicit", "promotion"} <= kinds
    assert None not in got.filter(pa.compute.equal(got.column("kind"), "explicit")).column("call").to_pylist()


def test_calls_of_names_an_id_by_its_first_call(monkeypatch):
    monkeypatch.setattr(totals, "BATCH_ROWS", 2)
    calls = pa.table({"call_id": [1, 2, None, 2, 5, -1], "name": ["a", "b", "z", "c", "e", "n"],
                      "autocast": [None, "", None, "cpu:bfloat16", None, None]})
    names, autocast = _calls_of(calls, {2, 5, 7})
    assert names == {2: "b", 5: "e"} and autocast == {2: "cpu:bfloat16"}


def test_mixed_dtype_rows_skip_single_dtype_batches_and_find_the_rest():
    from tensorscope.analyses.casts import _mixed_dtype_rows, _one_dtype

    lt = pa.list_(pa.dictionary(pa.int32(), pa.string()))

    def batch(ins, outs):
        return pa.record_batch({"in_dtypes": pa.array(ins).cast(lt), "out_dtypes": pa.array(outs).cast(lt)})

    batches = [batch([["float32", "float32"], [], None], [["float32"], ["float32"], []]),         # one dtype
               batch([["float32", "float64"], ["float32"]], [["float64"], ["float32"]]),         # row 3 mixed
               batch([["float32", None], ["float32"]], [["float32"], ["float32"]]),               # a null dtype
               batch([["int64"], ["int64"]], [["int64"], ["float32"]])]                           # row 8 mixed
    assert [_one_dtype(b) for b in batches] == [True, False, False, False]
    table = pa.Table.from_batches(batches)
    rows = [r for b in batches for r in b.to_pylist()]
    want = [i for i, r in enumerate(rows) if len({*(r["in_dtypes"] or []), *(r["out_dtypes"] or [])}) > 1]
    assert _mixed_dtype_rows(table).tolist() == want == [3, 5, 8]
