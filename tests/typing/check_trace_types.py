"""Checked by mypy in tests/typing/test_trace_types.py, never run: what a type checker sees of the
public API. Each ``reveal_type`` is matched there against the type it must reveal."""
import pyarrow as pa
import torch

import tensorscope

with tensorscope.trace(leaks=False) as t:
    torch.ones(2).relu()
reveal_type(t)  # noqa: F821
reveal_type(t.ops)  # noqa: F821
reveal_type(t.memory_timeline)  # noqa: F821
reveal_type(t.memory_at(0))  # noqa: F821
reveal_type(t.save("run"))  # noqa: F821
reveal_type(t.saved_to)  # noqa: F821
reveal_type(tensorscope.load("run"))  # noqa: F821


def a_table(x: pa.Table) -> None:
    reveal_type(x)  # noqa: F821   what pyarrow.Table is to this checker (Any where pyarrow has no stubs)
