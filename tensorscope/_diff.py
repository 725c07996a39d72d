"""``tensorscope.diff(a, b) -> TraceDiff``: two runs compared (computation in ``analyses/diff.py``,
drawing in ``render/diff.py``). Named ``_diff`` so the module never shadows the function."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from ._common import Displayable, fmt_bytes, fmt_ns

if TYPE_CHECKING:
    from ._trace import Trace


def as_trace(x: Any) -> Trace:
    """A Trace from a Trace, a finished ``trace()`` object, or a saved trace directory."""
    from ._trace import Trace

    if isinstance(x, Trace):
        return x
    result = getattr(type(x), "result", None)
    if isinstance(result, property):
        return x.result
    if isinstance(x, (str, os.PathLike)):
        from ._trace import load

        return load(x)
    raise TypeError(f"expected a tensorscope Trace or a saved trace directory, got {type(x).__name__}")


def diff(a, b) -> TraceDiff:
    """Compare run ``a`` with run ``b`` (Traces, ``trace()`` objects or saved directories).

    Matched by (module, phase, op), casts and layout changes by kind, never by row,
    so different cells and lengths compare. The biggest changes come first.
    """
    from .analyses.diff import compare

    ta, tb = as_trace(a), as_trace(b)
    table, tot_a, tot_b = compare(ta, tb)
    return TraceDiff(table, tot_a, tot_b, trace_label(ta, "a"), trace_label(tb, "b"))


def trace_label(t, default: str) -> str:
    """How a compared trace is named: the directory it was saved to, else its cell, else ``default``."""
    md = t.metadata or {}
    saved = getattr(t, "saved_to", None) or md.get("saved_to")   # where the trace is kept
    if saved:
        return os.path.basename(str(saved).rstrip("/")) or default
    if md.get("cell") is not None:
        return f"cell [{md['cell']}]"
    return default


class TraceDiff(Displayable):
    """``a`` → ``b``: ``table`` (one row per (section, key)), ``totals_a``/``totals_b``, text and HTML."""

    def __init__(self, table: pa.Table, totals_a: dict[str, Any], totals_b: dict[str, Any], label_a: str,
                 label_b: str):
        self.table = table
        self.totals_a = totals_a
        self.totals_b = totals_b
        self.label_a = label_a
        self.label_b = label_b

    def changed(self) -> pa.Table:
        """Rows that appeared, disappeared, changed count or bytes, or got slower/faster (20% and 50 µs)."""
        if self.table.num_rows == 0:
            return self.table
        return self.table.filter(pc.not_equal(self.table.column("status"), "same"))

    def regressions(self, time: float = 0.2, memory: float = 0.1) -> list[str]:
        """Baseline-guard failures (see ``analyses.diff.regressions``), as sentences."""
        from .analyses.diff import regressions

        out = []
        for r in regressions(self.totals_a, self.totals_b, time=time, memory=memory):
            pct = f"{100.0 * (r['after'] - r['before']) / r['before']:+.0f}%" if r["before"] else "from 0"
            if r["what"] == "time":
                out.append(f"CPU time in ops regressed {pct} ({fmt_ns(r['before'])} → {fmt_ns(r['after'])}; "
                           f"threshold +{r['threshold']:.0%})")
            else:
                out.append(f"peak memory on {r['device']} regressed {pct} ({fmt_bytes(r['before'])} → "
                           f"{fmt_bytes(r['after'])}; threshold +{r['threshold']:.0%})")
        return out

    def to_text(self, limit: int = 25) -> str:
        from .render.diff import diff_text

        return diff_text(self, limit)

    def to_html(self, limit: int = 25) -> str:
        from .render.diff import diff_html

        return diff_html(self, limit)

    def __repr__(self):
        return f"<TraceDiff {self.label_a} → {self.label_b}: {self.changed().num_rows} changes>"
