"""How ``save`` writes a table's parquet file and how ``load`` maps a big one (real files, both engines).

Integer columns are delta-encoded, the rest dictionary-encoded with one Arrow dictionary per file
(every row group reads back with it: what lets ``load`` map the row groups into one Arrow IPC file);
a column null on every row is left out of the mapped file and becomes shared null chunks.
"""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import torch

import tensorscope
from tensorscope import schema as S
from tensorscope.io import parquet as P


def _record(n_steps: int = 30):
    a, b = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.float64)
    with tensorscope.trace(leaks=False) as t:
        for i in range(n_steps):
            a.add(1)
            if i >= n_steps // 2:    # ops of the later row groups only: their dictionaries must not differ
                a.mul(b)
                a.float().double()
    return t.result


def test_save_delta_encodes_integer_columns_and_keeps_one_dictionary_per_file(tmp_path):
    t = _record()
    path = P.save(t, tmp_path / "run", row_group_rows=9)
    pf = pq.ParquetFile(os.path.join(path, "ops.parquet"))
    assert pf.num_row_groups > 4
    md = pf.metadata
    cols = {md.schema.column(j).path: j for j in range(md.num_columns)}
    seq = md.row_group(0).column(cols["seq"])
    assert "DELTA_BINARY_PACKED" in seq.encodings and seq.compression == "ZSTD"
    assert md.row_group(0).column(cols["op"]).has_dictionary_page
    assert md.row_group(0).column(cols["in_dtypes.list.element"]).has_dictionary_page
    first, last = pf.read_row_group(0), pf.read_row_group(pf.num_row_groups - 1)
    for name in ("op", "in_dtypes"):
        d0, d1 = (x.column(name).chunk(0) for x in (first, last))
        if name == "in_dtypes":
            d0, d1 = d0.values, d1.values
        # the whole Arrow dictionary in every row group, ops seen only later included
        assert d0.dictionary.equals(d1.dictionary)
        assert "aten.mul.Tensor" in d0.dictionary.to_pylist() if name == "op" else "float64" in d0.dictionary.to_pylist()
    back = tensorscope.load(path)
    for name in S.TABLES:
        assert back.table(name).equals(t.table(name)), name


def test_a_mapped_load_leaves_the_all_null_columns_out_of_its_file(tmp_path):
    t = _record()
    path = P.save(t, tmp_path / "run", row_group_rows=7)
    file = os.path.join(path, "ops.parquet")
    nulls = P._null_columns(pq.ParquetFile(file), S.OPS)
    ops = t.ops
    expected = {c for c in S.OPS.names if not pa_is_nested(S.OPS.field(c).type) and ops.column(c).null_count == ops.num_rows}
    assert nulls == expected and "cuda_ns" in nulls and "seq" not in nulls
    mapped = P._read_mapped(file, "ops")
    assert mapped is not None and mapped.column("seq").num_chunks > 1
    assert mapped.equals(ops) and mapped.equals(P.read(path, mmap_rows=None)[0]["ops"])
    # the null columns hold no rows of their own: chunks of one length share one array
    chunks = mapped.column("cuda_ns").chunks
    assert all(c.null_count == len(c) for c in chunks)
    same = [c for c in chunks if len(c) == len(chunks[0])]
    assert len(same) > 1 and all(c.buffers()[1].address == same[0].buffers()[1].address for c in same)
    tables, _ = P.read(path, mmap_rows=0)
    for name in S.TABLES:
        if name in tables:
            assert tables[name].equals(t.table(name)), name


def pa_is_nested(typ) -> bool:
    return bool(pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_struct(typ))
