"""Where the NaN/Inf of a trace came from: produced by an op, written on purpose, or passed on.

The screen records, per op, how many non-finite values its outputs held and whether its inputs
were all finite (``nonfinite_produced``). That alone calls ``torch.full(..., -inf)`` or
``scores.masked_fill(mask, -inf)`` "propagated" (their scalar is infinite) and every op
downstream of an attention mask too, so a summary would list every mask under "precision".

This pure function refines it from the ops table alone (engine-agnostic): an op that only fills
or selects values (``full``, ``scalar_tensor``, ``fill_``, ``masked_fill``, ``index_fill``,
``where`` with a 0-d operand) cannot overflow, so its ±inf is an intentional ``constant``; an op
whose non-finite inputs come (through ``in_storages``) from such constants carries them on
(``from_constant``). The rest keep the screen's verdict: ``produced`` (finite in, non-finite out:
an overflow, 0/0, log(0)...) or ``propagated`` (from the cell's inputs or a produced value).

Rows flagged ``is_noise`` (eager's bookkeeping: ``detach``, ``alias``, the ``lift_fresh`` and
``detach_`` of ``torch.tensor(...)``) are never a verdict's subject: they compute nothing. What they
hold is carried on as what it was: data lifted from Python (``torch.tensor(-inf)``) that a screened
row shows non-finite (the native engine screens the ``detach_`` after the lift) is a constant, so
the ops reading it are ``from_constant``; ``where`` with it as a 0-d operand is ``constant``.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .._common import LIFT_OPS

#: ops that write a constant given as an argument (never computing a value)
CONSTANT_OPS = frozenset({
    "full", "full_like", "new_full", "fill", "fill_", "scalar_tensor", "masked_fill", "masked_fill_",
    "index_fill", "index_fill_", "lift_fresh", "lift_fresh_copy",
})
#: ops that only move or select existing values: they cannot produce a non-finite value
SELECT_OPS = frozenset({
    "where", "triu", "tril", "triu_", "tril_", "clone", "copy", "copy_", "_to_copy", "cat", "stack", "expand",
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "contiguous", "slice", "select", "index",
    "index_select", "gather", "narrow", "unsqueeze", "squeeze", "flip", "roll", "repeat", "constant_pad_nd",
    "split", "split_with_sizes", "unbind", "detach", "alias", "as_strided", "masked_select", "unfold",
    "diagonal", "expand_as", "view_as", "flatten", "unflatten", "index_put", "index_put_", "scatter", "scatter_",
    "masked_scatter", "masked_scatter_", "take", "take_along_dim",
})
VERDICTS = ("produced", "constant", "from_constant", "propagated")


def _short(op: str) -> str:
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


def nonfinite_verdicts(ops: pa.Table) -> list[dict[str, Any]]:
    """One dict per op whose outputs held NaN/Inf, in seq order: seq, op, nonfinite, verdict,
    module, source_file, source_line."""
    if ops.num_rows == 0 or "nonfinite" not in ops.column_names or ops.column("nonfinite").null_count == ops.num_rows:
        return []
    held = pc.fill_null(pc.greater(ops.column("nonfinite"), 0), False)
    if not pc.any(held).as_py():
        return []
    # the rows that held NaN/Inf, and the lifts of Python constants (unscreened: an alias of the lifted data)
    lifted = pc.is_in(pc.cast(ops.column("op"), pa.string()), value_set=pa.array(
        sorted(f"aten.{n}.default" for n in LIFT_OPS), pa.string()))
    bad = ops.filter(pc.or_(held, pc.fill_null(lifted, False)))
    cols = [c for c in ("seq", "op", "nonfinite", "nonfinite_produced", "in_shapes", "in_storages", "out_storages",
                        "is_noise", "module", "source_file", "source_line") if c in bad.column_names]
    rows = bad.select(cols).to_pylist()
    rows.sort(key=lambda r: r["seq"])
    constant_storages = set()
    lifted = set()   # storages holding data lifted from Python, non-finite or not
    out = []
    for r in rows:
        short = _short(r["op"] or "")
        ins = [s for s in (r.get("in_storages") or []) if s is not None and s >= 0]
        outs = [s for s in (r.get("out_storages") or []) if s is not None and s >= 0]
        if r.get("is_noise") or short in LIFT_OPS:
            # bookkeeping computes nothing: never a subject. It carries on what its input was; a lift's
            # data is a constant of the program's once a screened row shows it non-finite
            if short in LIFT_OPS:
                lifted.update(outs)
            proven = (r["nonfinite"] or 0) > 0 and bool(ins) and all(s in lifted for s in ins)
            if proven or any(s in constant_storages for s in ins):
                constant_storages.update(outs)
            continue
        if not (r["nonfinite"] or 0) > 0:
            continue
        zero_d = any(sh == [] for sh in (r.get("in_shapes") or []))
        if short in CONSTANT_OPS or (short == "where" and zero_d):
            verdict = "constant"
        elif not r.get("nonfinite_produced") and ins and any(s in constant_storages for s in ins):
            verdict = "from_constant"
        elif r.get("nonfinite_produced") and short not in SELECT_OPS:
            verdict = "produced"
        else:
            verdict = "propagated"
        if verdict in ("constant", "from_constant"):
            constant_storages.update(outs)
        out.append({"seq": r["seq"], "op": r["op"], "nonfinite": r["nonfinite"], "verdict": verdict,
                    "module": r.get("module"), "source_file": r.get("source_file"), "source_line": r.get("source_line")})
    return out
