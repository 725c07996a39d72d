"""``TableView``: a derived table of a Trace (``t.memory_timeline``, ``memory_at()``, ``module_memory``,
``allocator_timeline``) as an object that displays itself as a compact table.

In a notebook it renders as a small HTML table (every cell escaped), elsewhere as text
(``repr``): the title, ``rows x columns``, the first and last rows, only the columns that hold
something (a column all null, or a ``*_bytes`` column all zero, is left out of the display and
named in a note), bytes and nanoseconds formatted for reading. The data itself is untouched:
``to_arrow()`` is the ``pyarrow.Table``, ``to_pandas()`` a DataFrame (nullable ints stay ints), and the
view answers what a ``pyarrow.Table`` answers (``num_rows``, ``column``, ``to_pylist``, ``filter``,
``equals``, ``pa.table(view)`` through the Arrow C stream ...), so code written against the table
keeps working.
"""
from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa

from .._common import esc, fmt_bytes, fmt_ns

__all__ = ["TableView"]

#: rows shown by the display: the first HEAD and the last TAIL (all of them when there are few)
HEAD, TAIL = 8, 2
#: longest cell text shown (the rest is elided)
CELL_CHARS = 48

_CSS = ("<style>.ts-view{font:12px/1.35 monospace;border-collapse:collapse}"
        ".ts-view th,.ts-view td{padding:1px 8px;text-align:right;border-bottom:1px solid #ddd}"
        ".ts-view th{background:#f4f4f4}.ts-view td.s,.ts-view th.s{text-align:left}"
        ".ts-view-cap{font:12px sans-serif;color:#444;margin:2px 0}</style>")


def _fmt(name: str, v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else ""
    if name.endswith("_bytes") or name == "bytes":
        return fmt_bytes(v)
    if name.endswith("_ns"):
        return fmt_ns(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    s = str(v)
    return s if len(s) <= CELL_CHARS else s[:CELL_CHARS - 1] + "…"


def _is_text(typ: pa.DataType) -> bool:
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    return bool(pa.types.is_string(typ) or pa.types.is_large_string(typ))


class TableView:
    """A ``pyarrow.Table`` that displays as a compact table (see the module docstring)."""

    __slots__ = ("_table", "title", "notes")
    _table: pa.Table

    def __init__(self, table: pa.Table, title: str, notes: tuple[str, ...] = ()) -> None:
        if isinstance(table, TableView):
            table = table.to_arrow()
        self._table = table
        self.title = title
        self.notes = tuple(notes)

    def __call__(self) -> TableView:
        """``t.memory_timeline()``: the spelling these views had when they were methods (deprecated)."""
        import warnings

        name = self.title.split(":", 1)[0]
        warnings.warn(f"{name}() is deprecated: {name} is a property (a table computed from the trace; "
                      "views that take arguments stay methods)", DeprecationWarning, stacklevel=2)
        return self

    # -- the data ----------------------------------------------------------------------------------
    def to_arrow(self) -> pa.Table:
        """The table itself (Arrow, immutable)."""
        return self._table

    def to_pandas(self, **kw: Any) -> Any:
        """A pandas DataFrame; by default nullable ints stay ints and strings are plain strings
        (as ``Trace.df``); keyword arguments go to ``pyarrow.Table.to_pandas`` instead."""
        if kw:
            return self._table.to_pandas(**kw)
        import pandas as pd

        from ..schema import plain_strings

        types = {pa.int64(): pd.Int64Dtype(), pa.int32(): pd.Int32Dtype(), pa.bool_(): pd.BooleanDtype()}
        return plain_strings(self._table).to_pandas(types_mapper=types.get)

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        return self._table.__arrow_c_stream__(requested_schema)

    def __getattr__(self, name: str) -> Any:
        # everything else a pyarrow.Table has (num_rows, column, to_pylist, filter, schema, ...)
        if name.startswith("__") or name == "_table":
            raise AttributeError(name)
        return getattr(self._table, name)

    def __len__(self) -> int:
        return int(self._table.num_rows)

    def __getitem__(self, key: Any) -> Any:
        return self._table[key]

    def equals(self, other: Any, check_metadata: bool = False) -> bool:
        if isinstance(other, TableView):
            other = other._table
        return bool(self._table.equals(other, check_metadata=check_metadata))

    def __eq__(self, other: object) -> bool:
        try:
            return self.equals(other)
        except TypeError:
            return NotImplemented

    __hash__ = None  # type: ignore[assignment]   # like a pyarrow.Table

    # -- the display ----------------------------------------------------------------------------------
    def _layout(self) -> tuple[list[str], list[int], list[str]]:
        """(columns shown, row indices shown (-1: the elision), notes)."""
        t = self._table
        shown: list[str] = []
        hidden: list[str] = []
        for f in t.schema:
            col = t.column(f.name)
            empty = col.null_count == len(col) and len(col) > 0
            if not empty and f.name.endswith("_bytes") and len(col) and pa.types.is_integer(f.type):
                import pyarrow.compute as pc

                empty = not pc.any(pc.not_equal(pc.fill_null(col, 0), 0)).as_py()
            (hidden if empty else shown).append(f.name)
        n = t.num_rows
        rows = list(range(n)) if n <= HEAD + TAIL + 1 else list(range(HEAD)) + [-1] + list(range(n - TAIL, n))
        notes = list(self.notes)
        if hidden:
            notes.append("not shown (empty or all zero): " + ", ".join(hidden))
        return shown, rows, notes

    def _cells(self, shown: list[str], rows: list[int]) -> list[Optional[list[str]]]:
        idx = [i for i in rows if i >= 0]
        if not idx:
            return [None for _ in rows]
        sub = self._table.select(shown).take(pa.array(idx, pa.int64())).to_pydict()
        out: list[Optional[list[str]]] = []
        k = 0
        for i in rows:
            if i < 0:
                out.append(None)
                continue
            out.append([_fmt(c, sub[c][k]) for c in shown])
            k += 1
        return out

    def _caption(self) -> str:
        t = self._table
        return f"{self.title}: {t.num_rows} row{'s' if t.num_rows != 1 else ''} x {t.num_columns} columns"

    def __repr__(self) -> str:
        shown, rows, notes = self._layout()
        lines = [self._caption()]
        if self._table.num_rows == 0:
            lines.append("(no rows)")
        else:
            cells = self._cells(shown, rows)
            widths = [max([len(c)] + [len(r[j]) for r in cells if r is not None]) for j, c in enumerate(shown)]
            lines.append("  ".join(c.ljust(w) for c, w in zip(shown, widths)).rstrip())
            for r in cells:
                if r is None:
                    lines.append(f"… {self._table.num_rows - HEAD - TAIL} more rows")
                else:
                    lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        lines += [f"({n})" for n in notes]
        lines.append("(.to_arrow(): the pyarrow.Table; .to_pandas(): a DataFrame)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.__repr__()

    def _repr_html_(self) -> str:
        shown, rows, notes = self._layout()
        text = {c for c in shown if _is_text(self._table.schema.field(c).type)}

        def cls(c: str) -> str:
            return ' class="s"' if c in text else ""

        parts = [_CSS, f'<div class="ts-view-cap"><b>{esc(self._caption())}</b></div>']
        if self._table.num_rows == 0:
            parts.append('<div class="ts-view-cap">(no rows)</div>')
        else:
            parts.append('<table class="ts-view"><thead><tr>')
            parts += [f"<th{cls(c)}>{esc(c)}</th>" for c in shown]
            parts.append("</tr></thead><tbody>")
            for r in self._cells(shown, rows):
                if r is None:
                    parts.append(f'<tr><td class="s" colspan="{len(shown)}">… '
                                 f"{self._table.num_rows - HEAD - TAIL} more rows</td></tr>")
                else:
                    parts.append("<tr>" + "".join(f"<td{cls(c)}>{esc(v)}</td>" for c, v in zip(shown, r)) + "</tr>")
            parts.append("</tbody></table>")
        for n in notes + [".to_arrow(): the pyarrow.Table; .to_pandas(): a DataFrame"]:
            parts.append(f'<div class="ts-view-cap">{esc(n)}</div>')
        return "".join(parts)
