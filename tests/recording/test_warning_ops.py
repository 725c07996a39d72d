"""A C++ warning raised inside an op is an ``errors`` row naming that op, in a trace held in memory
and in a spilled one alike: the op is looked up in the chunks that hold the warnings' rows only
(``Decoder.ops_at``), never a whole-trace column."""
from __future__ import annotations

import warnings

import pytest
import torch

import tensorscope


def _body() -> None:
    x = torch.ones(3)
    for i in range(5):
        for _ in range(100):
            x = x + 1
        out = torch.empty(2)   # the wrong shape: resized, with a warning from ATen (TORCH_WARN)
        (torch.sin if i % 2 else torch.cos)(x, out=out)


@pytest.mark.parametrize("engine", ["native", "python"])
@pytest.mark.parametrize("spill", [False, True])
def test_a_warning_names_the_op_that_raised_it(engine, spill):
    options = {"chunk_rows": 64, "spill_rows": 128} if spill else {}
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with tensorscope.trace(engine=engine, **options) as t:
            _body()
    assert (t.metadata["spilled_rows"] > 0) == spill
    assert len(shown) == 5   # the program's warnings reach it unchanged
    ops = t.ops.column("op").to_pylist()
    rows = [e for e in t.errors.to_pylist() if e["kind"] == "warning"]
    assert [e["op"] for e in rows] == ["aten.cos.out", "aten.sin.out"] * 2 + ["aten.cos.out"]
    assert all(ops[e["seq"]] == e["op"] and "resized" in e["message"] for e in rows)
    assert len({e["seq"] // 64 for e in rows}) == 5   # five different chunks
