"""One finding of the advisor as a row: where it happened (``Cell In[3], line 11``), the evidence
(the rows that show it, ``ops seq 4, 9 … (12 rows)``), the finding's fields, and the ``ADVICE`` table
the findings become. advisor.py decides which findings there are; this module only writes them.
"""
from __future__ import annotations

import contextvars
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np
import pyarrow as pa

from .. import schema as S
from .._location import format_location
from .opview import OpView

_LISTED = 6

#: the cell-file map of the traces being advised (``metadata["cell_files"]``), set for one advise_tables call
_CELLS: contextvars.ContextVar[Optional[Mapping[str, int]]] = contextvars.ContextVar("cells", default=None)


def _where(file: Optional[str], line: Optional[int]) -> str:
    """``Cell In[3], line 11`` or ``model.py:12`` (the summary's spelling)."""
    if file is None and line is None:
        return "line unknown"
    return format_location(file, line, _CELLS.get()) or "line unknown"


Pairs = Union[Sequence[tuple[int, int]], tuple[np.ndarray, np.ndarray]]


def _arrays(pairs: Pairs) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(pairs, tuple) and len(pairs) == 2 and isinstance(pairs[0], np.ndarray):
        return pairs[0], pairs[1]
    a = np.array(list(pairs), dtype=np.int64).reshape(-1, 2)
    return a[:, 0], a[:, 1]


def _evidence(w: np.ndarray, s: np.ndarray, multi: bool, what: str = "ops seq") -> str:
    n = len(s)
    shown = [f"{a}/{b}" if multi else str(b) for a, b in zip(w[:_LISTED].tolist(), s[:_LISTED].tolist())]
    more = f" … ({n} rows)" if n > _LISTED else f" ({n} row{'s' * (n != 1)})"
    return f"{what}{' (window/seq)' if multi else ''} " + ", ".join(shown) + more


def _finding(kind: str, subject: str, seen: str, pairs: Pairs, multi: bool, cost: Optional[int],
             fix: str, steps: Optional[int], module: Optional[str] = None, file: Optional[str] = None,
             line: Optional[int] = None, what: str = "ops seq") -> dict[str, Any]:
    w, s = _arrays(pairs)
    if module and module not in seen:
        seen += f" (module {module})"
    return {"kind": kind, "subject": subject, "seen": seen, "evidence": _evidence(w, s, multi, what),
            "rows": s, "rows_w": w, "n_rows": len(s),
            "per_step": (len(s) / steps) if steps else None, "cost_ns": int(cost) if cost is not None else None,
            "fix": fix, "module": module, "source_file": file, "source_line": line}


def _advice_table(found: list[dict[str, Any]]) -> pa.Table:
    """The ADVICE table; each finding's rows (numpy) become one list cell without a Python int per row."""
    cols: dict[str, Any] = {f.name: [f_[f.name] for f_ in found] for f in S.ADVICE if f.name != "rows"}
    lens = np.array([len(f_["rows"]) for f_ in found], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    flat = pa.array(np.concatenate([np.asarray(f_["rows"], dtype=np.int64) for f_ in found]) if found
                    else np.zeros(0, np.int64))
    cols["rows"] = pa.ListArray.from_arrays(offsets, flat)
    return pa.table({f.name: cols[f.name] for f in S.ADVICE}, schema=S.ADVICE)


def _rows_of(w: int, view: OpView, names: frozenset[str], cols: list[str]) -> list[dict[str, Any]]:
    return [dict(r, window=w) for r in view.rows(view.short_in(names), cols)]
