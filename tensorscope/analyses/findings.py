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


Pairs = Union[Sequence[tuple[int, int]], tuple[np.ndarray, np.ndarray], "Runs"]


class Runs:
    """The rows a finding names, in order, as runs of consecutive ``seq`` in one window: run ``k`` names
    ``(w[k], first[k] + i)`` for ``i < count[k]``. Exact for any sequence of (window, seq) pairs (a lone row
    is a run of one), and a few numbers for the overhead finding of a trace of small ops, which names
    nearly every row (10 M rows: a handful of runs, not 160 MB of pairs). Built a slice at a time with
    ``add``: a run that goes on in the next slice is merged across the boundary."""

    def __init__(self) -> None:
        self._w: list[np.ndarray] = []
        self._f: list[np.ndarray] = []
        self._c: list[np.ndarray] = []
        self._tail: list[list[int]] = []     # runs added a row at a time (add_one), not yet arrays

    def add_one(self, w: int, seq: int) -> None:
        """Append one row (for findings read row by row)."""
        if self._tail:
            last = self._tail[-1]
            if last[0] == w and last[1] + last[2] == seq:
                last[2] += 1
                return
        elif self._c and int(self._w[-1][-1]) == w and int(self._f[-1][-1] + self._c[-1][-1]) == seq:
            self._c[-1][-1] += 1
            return
        self._tail.append([w, seq, 1])
        if len(self._tail) >= 4096:
            self._flush()

    def _flush(self) -> None:
        if self._tail:
            a = np.array(self._tail, dtype=np.int64)
            self._w.append(a[:, 0].copy())
            self._f.append(a[:, 1].copy())
            self._c.append(a[:, 2].copy())
            self._tail = []

    def add(self, w: int, seqs: np.ndarray) -> None:
        """Append the rows ``seqs`` (in order) of window ``w``."""
        self._flush()
        seqs = np.asarray(seqs, dtype=np.int64)
        if not len(seqs):
            return
        brk = np.flatnonzero(np.diff(seqs) != 1) + 1
        starts = np.concatenate(([0], brk))
        first = seqs[starts]
        count = np.diff(np.concatenate((starts, [len(seqs)]))).astype(np.int64)
        if self._c and int(self._w[-1][-1]) == w and int(self._f[-1][-1] + self._c[-1][-1]) == int(first[0]):
            self._c[-1][-1] += count[0]       # the last run goes on in this slice
            first, count = first[1:], count[1:]
            if not len(first):
                return
        self._w.append(np.full(len(first), w, dtype=np.int64))
        self._f.append(first)
        self._c.append(count)

    def extend(self, other: Runs) -> None:
        """Append the rows ``other`` names, after these (merged where a run goes on)."""
        self._flush()
        w, f, c = (x.copy() for x in other.arrays())
        if not len(c):
            return
        if self._c and int(self._w[-1][-1]) == int(w[0]) and int(self._f[-1][-1] + self._c[-1][-1]) == int(f[0]):
            self._c[-1][-1] += c[0]
            w, f, c = w[1:], f[1:], c[1:]
        if len(c):
            self._w.append(w)
            self._f.append(f)
            self._c.append(c)

    @classmethod
    def of(cls, pairs: Pairs) -> Runs:
        if isinstance(pairs, Runs):
            return pairs
        if isinstance(pairs, tuple) and len(pairs) == 2 and isinstance(pairs[0], np.ndarray):
            w, s = np.asarray(pairs[0], np.int64), np.asarray(pairs[1], np.int64)
        else:
            a = np.array(list(pairs), dtype=np.int64).reshape(-1, 2)
            w, s = a[:, 0], a[:, 1]
        out = cls()
        edges = np.concatenate(([0], np.flatnonzero(np.diff(w) != 0) + 1, [len(w)]))
        for a_, b_ in zip(edges[:-1].tolist(), edges[1:].tolist()):
            if b_ > a_:
                out.add(int(w[a_]), s[a_:b_])
        return out

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(window, first seq, count) of each run."""
        self._flush()
        if not self._c:
            z = np.zeros(0, np.int64)
            return z, z, z
        if len(self._c) > 1:
            self._w, self._f, self._c = [np.concatenate(self._w)], [np.concatenate(self._f)], [np.concatenate(self._c)]
        return self._w[0], self._f[0], self._c[0]

    def __len__(self) -> int:
        self._flush()
        return int(sum(int(c.sum()) for c in self._c))

    def member(self, w: int, seqs: np.ndarray) -> np.ndarray:
        """Per seq of window ``w``, whether these runs name it."""
        rw, rf, rc = self.arrays()
        keys = w * (1 << 43) + np.asarray(seqs, np.int64)
        if not len(rc) or not len(keys):
            return np.zeros(len(keys), bool)
        a0 = rw * (1 << 43) + rf
        order = np.argsort(a0, kind="stable")
        a0, reach = a0[order], np.maximum.accumulate((a0 + rc)[order])
        j = np.searchsorted(a0, keys, side="right") - 1
        out: np.ndarray = (j >= 0) & (reach[np.maximum(j, 0)] > keys)
        return out

    def head(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``k`` (window, seq) pairs."""
        ws: list[int] = []
        ss: list[int] = []
        for w, f, c in zip(*(x.tolist() for x in self.arrays())):
            take = min(c, k - len(ss))
            ws += [w] * take
            ss += range(f, f + take)
            if len(ss) >= k:
                break
        return np.array(ws, np.int64), np.array(ss, np.int64)

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (window, seq) pair (for tests and small findings: one int64 pair per row)."""
        w, f, c = self.arrays()
        return np.repeat(w, c), expand_runs(f, c)

    def overlaps(self, other: Runs) -> bool:
        """Whether the two name a common (window, seq) pair (compared run against run, no row expanded)."""
        aw, af, ac = self.arrays()
        bw, bf, bc = other.arrays()
        if not len(ac) or not len(bc):
            return False
        # a row is ``w * 2**43 + seq`` (a seq is under 2**43): each run is a half-open key interval
        a0 = aw * (1 << 43) + af
        order = np.argsort(a0, kind="stable")
        a0, a1 = a0[order], (a0 + ac)[order]
        reach = np.maximum.accumulate(a1)           # the furthest end of the runs starting at or before each
        b0 = bw * (1 << 43) + bf
        b1 = b0 + bc
        j = np.searchsorted(a0, b1, side="left") - 1   # the last run of ``self`` starting before each b run ends
        ok = j >= 0
        return bool((reach[np.where(ok, j, 0)][ok] > b0[ok]).any())


def expand_runs(first: Any, count: Any) -> np.ndarray:
    """The seqs of runs ``(first[k], count[k])``, in order (``row_starts``/``row_counts`` of an ADVICE row)."""
    f, c = np.asarray(first, np.int64), np.asarray(count, np.int64)
    n = int(c.sum()) if len(c) else 0
    if not n:
        return np.zeros(0, np.int64)
    base = np.repeat(f - np.concatenate(([0], np.cumsum(c)[:-1])), c)
    out: np.ndarray = base + np.arange(n, dtype=np.int64)
    return out


def finding_rows(f: Mapping[str, Any]) -> np.ndarray:
    """Every ``ops.seq`` a finding names, in order: a row of ``advice.findings.to_pylist()`` (or a finding)."""
    if "runs" in f:
        return f["runs"].pairs()[1]    # type: ignore[no-any-return]
    return expand_runs(f["row_starts"] or [], f["row_counts"] or [])


def _evidence(runs: Runs, multi: bool, what: str = "ops seq") -> str:
    n = len(runs)
    w, s = runs.head(_LISTED)
    shown = [f"{a}/{b}" if multi else str(b) for a, b in zip(w.tolist(), s.tolist())]
    more = f" … ({n} rows)" if n > _LISTED else f" ({n} row{'s' * (n != 1)})"
    return f"{what}{' (window/seq)' if multi else ''} " + ", ".join(shown) + more


def _finding(kind: str, subject: str, seen: str, pairs: Pairs, multi: bool, cost: Optional[int],
             fix: str, steps: Optional[int], module: Optional[str] = None, file: Optional[str] = None,
             line: Optional[int] = None, what: str = "ops seq") -> dict[str, Any]:
    runs = Runs.of(pairs)
    n = len(runs)
    if module and module not in seen:
        seen += f" (module {module})"
    return {"kind": kind, "subject": subject, "seen": seen, "evidence": _evidence(runs, multi, what),
            "runs": runs, "n_rows": n,
            "per_step": (n / steps) if steps else None, "cost_ns": int(cost) if cost is not None else None,
            "fix": fix, "module": module, "source_file": file, "source_line": line}


def _advice_table(found: list[dict[str, Any]]) -> pa.Table:
    """The ADVICE table; each finding's runs (numpy) become two list cells without a Python int per row."""
    lists = ("row_starts", "row_counts")
    cols: dict[str, Any] = {f.name: [f_[f.name] for f_ in found] for f in S.ADVICE if f.name not in lists}
    runs = [f_["runs"].arrays() for f_ in found]
    lens = np.array([len(r[1]) for r in runs], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    for name, k in zip(lists, (1, 2)):
        flat = pa.array(np.concatenate([r[k] for r in runs]) if runs else np.zeros(0, np.int64), pa.int64())
        cols[name] = pa.ListArray.from_arrays(offsets, flat)
    return pa.table({f.name: cols[f.name] for f in S.ADVICE}, schema=S.ADVICE)


def _rows_of(w: int, view: OpView, names: frozenset[str], cols: list[str]) -> list[dict[str, Any]]:
    return [dict(r, window=w) for r in view.rows(view.short_in(names), cols)]
