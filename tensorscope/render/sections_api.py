"""Summary section "torch API vs ATen": the APIs whose expansion at the dispatcher is surprising.

Reads the derived ``api`` table (``analyses.api``): APIs whose ATen ops do more
work than their own op (hidden copies, extra copies, many ATen ops per call), and
the count of calls that dispatched nothing (no-op conversions). The full table is ``t.api``.
"""
from __future__ import annotations

from typing import Optional

import pyarrow.compute as pc

from .._common import fmt_ns
from .section import Section


def api_section(t) -> Optional[Section]:
    from ..analyses.api import surprising

    api = t.api
    if api.num_rows == 0:
        return None
    rows = []
    for a in surprising(api):
        ops = ", ".join(f"{op} ×{n}" for op, n in sorted(a["ops"], key=lambda x: -x[1])[:4])
        if len(a["ops"]) > 4:
            ops += f", … ({len(a['ops'])} ops)"
        rows.append((a["api"], str(a["n_calls"]), ops, fmt_ns(a["cpu_ns"]), "; ".join(a["reasons"])))
    no_op = [r for r in api.filter(pc.is_null(api.column("op"))).to_pylist()
             if not (r["name"] or "").startswith("_")]   # private torch._C helpers are PyTorch's own calls
    notes = []
    if no_op:
        names = ", ".join(f"{r['qualname']} ×{r['n_calls']}" for r in no_op[:6])
        notes.append(f"calls that dispatched no ATen op (no-op conversions or pure Python): {names}")
    if not rows and not notes:
        return None
    notes.append("every API and the ATen ops it became: t.api")
    return Section("torch API vs ATen: surprising expansions", rows,
                   ("API", "calls", "ATen ops", "CPU", "why") if rows else None, notes)
