"""``tensorscope.diverge(a, b) -> Divergence``: where two runs part ways (computation in
``analyses/diverge.py``, drawing in ``render/diverge.py``). Named ``divergence`` so the module never
shadows the function. Built on recorded traces: the runs may come from two processes or machines
(saved directories), or from this process's history (indices into ``tensorscope.history()``)."""
from __future__ import annotations

import os
from typing import Any, Optional

import pyarrow as pa

from ._common import Displayable
from ._diff import trace_label


def resolve(x: Any, label: str) -> Any:
    """A Trace from a Trace, a ``trace()`` object, a saved directory or a history index."""
    from ._diff import as_trace
    from .errors import DivergeInputError

    if isinstance(x, int) and not isinstance(x, bool):
        from .recording.history import history

        h = history()
        try:
            return h[x]
        except IndexError:
            raise DivergeInputError(f"run {label}: no trace at history index {x} (this process remembers "
                                    f"{len(h)})") from None
    if isinstance(x, (str, os.PathLike)) and not os.path.isdir(x):
        raise DivergeInputError(f"run {label}: {os.fsdecode(x)!r} is not a saved trace directory")
    try:
        return as_trace(x)
    except TypeError as e:
        raise DivergeInputError(f"run {label}: {e}") from None


def diverge(a: Any, b: Any, *, rtol: Optional[float] = None) -> Divergence:
    """Align the ops of run ``a`` and run ``b`` and say where their values part ways.

    ``a``/``b``: Traces, ``trace()`` objects, saved trace directories or ``history()`` indices, each
    recorded with ``fingerprints=True``. ``rtol``: the relative difference beyond which an aligned
    op diverged (default: the tolerance of the finer of its two dtypes).
    """
    from . import schema as S
    from .analyses.diverge import check, diverge_tables
    from .errors import DivergeInputError

    if rtol is not None and not (isinstance(rtol, (int, float)) and not isinstance(rtol, bool) and rtol >= 0):
        raise DivergeInputError(f"rtol must be a number >= 0, not {rtol!r}")
    ta, tb = resolve(a, "a"), resolve(b, "b")
    va = str((ta.metadata or {}).get("schema_version") or S.SCHEMA_VERSION)
    vb = str((tb.metadata or {}).get("schema_version") or S.SCHEMA_VERSION)
    if S.parse_version(va)[0] != S.parse_version(vb)[0]:
        raise DivergeInputError(f"the two traces have different schemas ({va} and {vb}): "
                                "record both runs with the same tensorscope")
    check(ta.ops, f"a (schema {va})")
    check(tb.ops, f"b (schema {vb})")
    pairs, structure, facts = diverge_tables(ta.ops, tb.ops, rtol)
    return Divergence(pairs, structure, facts, trace_label(ta, "a"), trace_label(tb, "b"))


class Divergence(Displayable):
    """Run ``a`` against run ``b``: ``pairs`` (one row per aligned pair of ops, schema
    ``DIVERGE_PAIRS``), ``structure`` (the ops only one run made), ``first`` (the first divergence,
    a dict, or None), ``grew`` (where a propagated error jumped), ``facts`` (counts)."""

    def __init__(self, pairs: pa.Table, structure: pa.Table, facts: dict[str, Any], label_a: str, label_b: str):
        self.pairs = pairs
        self.structure = structure
        self.facts = facts
        self.label_a = label_a
        self.label_b = label_b

    @property
    def table(self) -> pa.Table:
        """The aligned pairs (Arrow)."""
        return self.pairs

    def _row(self, k: int) -> dict[str, Any]:
        return {name: self.pairs.column(name)[k].as_py() for name in self.pairs.column_names}

    @property
    def first(self) -> Optional[dict[str, Any]]:
        """The first aligned op whose outputs differ beyond the threshold while its inputs agree
        (cause ``numeric``) or come from ops only one run ran (``structural``); None if none."""
        k = self.facts.get("first")
        return None if k is None else self._row(k)

    @property
    def grew(self) -> list[dict[str, Any]]:
        """Propagated divergences whose error is 10x their inputs' or more, in run a's order."""
        return [self._row(k) for k in self.facts.get("grew", [])]

    def diverged(self) -> pa.Table:
        """The pairs that diverged."""
        import pyarrow.compute as pc

        return self.pairs.filter(pc.equal(self.pairs.column("status"), "diverged"))

    def to_text(self, limit: int = 10) -> str:
        from .render.diverge import diverge_text

        return diverge_text(self, limit)

    def to_html(self, limit: int = 10) -> str:
        from .render.diverge import diverge_html

        return diverge_html(self, limit)

    def __repr__(self) -> str:
        f = self.first
        where = f"first at a#{f['seq_a']} {f['op']}" if f else "no divergence"
        return f"<Divergence {self.label_a} → {self.label_b}: {self.facts['aligned']} aligned, {where}>"
