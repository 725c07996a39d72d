"""Where a tensor's value came from, read back from the ops that wrote its storage.

``producer(ops, pos, sid)``: the last row before row ``pos`` (within ``back`` rows) whose outputs hold
storage ``sid``. ``from_data(ops, pos)``: whether the value row ``pos`` reads derives from a tensor of
one dimension or more (a batch, an activation, a loss's inputs) within a few producers, or only from
0-d tensors (a step counter an optimizer keeps and increments: host bookkeeping that stays on the
CPU when the model runs on a GPU). A CPU trace's sync finding is a claim about a GPU run: it needs
this proof (advisor.py)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import schema as S

_COLS = ["seq", "op", "autograd_node", "module", "source_file", "source_line", "in_storages", "in_shapes"]


def producer(ops: pa.Table, pos: int, sid: int, back: int = 4096) -> Optional[dict[str, Any]]:
    """The last row before row ``pos`` (within ``back`` rows) that wrote storage ``sid``, as a dict of
    ``seq, op, autograd_node, module, source_file, source_line, in_storages, in_shapes`` and ``pos``."""
    lo = max(0, pos - back)
    part = ops.slice(lo, pos - lo)
    outs = part.column("out_storages").combine_chunks()
    if len(outs) == 0:
        return None
    hit = pc.list_parent_indices(outs).to_numpy()[
        np.asarray(pc.fill_null(pc.equal(pc.list_flatten(outs), sid), False).to_numpy(zero_copy_only=False), bool)]
    if not len(hit):
        return None
    got: dict[str, Any] = S.plain_strings(part.slice(int(hit[-1]), 1).select(_COLS)).to_pylist()[0]
    got["pos"] = lo + int(hit[-1])
    return got


def from_data(ops: pa.Table, pos: int, depth: int = 8, back: int = 512) -> bool:
    """Whether the value row ``pos`` reads may derive from a tensor of one dimension or more: False only
    when its 0-d inputs are proven made of 0-d tensors and Python numbers alone, following their producers
    up to ``depth`` rows (each within ``back`` rows). An in-place update's own input (``x += 1``: a counter)
    is the counter itself and not followed; an input whose producer is not found (made before, or too far
    back) is not proven, and neither is a chain longer than ``depth``."""
    r = S.plain_strings(ops.slice(pos, 1).select(["in_storages", "in_shapes"])).to_pylist()[0]
    todo: list[tuple[int, list[Any], list[Any], Optional[int]]] = [(pos, r["in_storages"] or [], r["in_shapes"] or [], None)]
    seen = 0
    while todo:
        if seen == depth:
            return True
        at, sids, shapes, own = todo.pop(0)
        seen += 1
        for sid, shape in zip(sids, shapes):
            if shape is not None and len(shape) >= 1:
                return True
            if sid is None or sid < 0 or sid == own:
                continue
            p = producer(ops, at, sid, back)
            if p is None:
                return True
            todo.append((p["pos"], p["in_storages"] or [], p["in_shapes"] or [], sid))
    return False
