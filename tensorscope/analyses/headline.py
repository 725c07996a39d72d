"""The headline of a cell: at most five findings, the one to act on first, from what the analyses returned.

``headline(...)`` ranks, it does not find: its inputs are the results other analyses already
computed (the ``errors`` table, ``nonfinite_verdicts``, the ``leaks`` table, the advisor's
findings table), so every line is proved by the rows behind that result. The order:

1. exceptions the cell raised;
2. NaN/Inf an op produced from finite inputs (``produced`` verdicts; constants and what they
   carry on are not findings);
3. leaks that grow (a holder that kept more bytes cell after cell or step after step);
4. performance findings by measured cost, each at least ``min_share`` of the cell's op time
   (none on a predicted trace: its timings are not measurements);
5. warnings;
6. storages still alive that do not grow, when large (``min_leak_share`` of the peak and at least
   ``min_leak_bytes``): a still-alive 4-byte loss is not a headline.

Ties are broken by the key (kind, subject, where), so the same trace gives the same lines. Each
line is a dict: ``rank`` (the class above), ``kind``, ``what``, ``where``, ``how_much``, ``fix``
(None when nothing tested can be offered), ``cost_ns`` / ``bytes`` (the measure it was ranked by).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import pyarrow as pa

from .._common import fmt_bytes, fmt_ns
from .._location import format_location

__all__ = ["headline", "MAX_LINES"]

MAX_LINES = 5
_ELEMENT = re.compile(r"^(.*)\[(\d+)\]$")
_DEL_ITEM = re.compile(r"^del (\S+)\[(\d+)\]((?:  \(.*\))?)$")   # the leak finder's "del kept[3]  (in f())"


def _group_fix(fixes: Sequence[str], container: str) -> Optional[str]:
    """One fix for all the leaked elements of one container (their rows' fixes, largest index first,
    as the leak finder lists them): the one they share; one that rebinds or deletes the whole
    container; their ``del c[i]`` as one slice when the indices run without a gap; else every fix,
    in that order (a ``del`` of a higher index first keeps the lower ones in place)."""
    distinct = list(dict.fromkeys(f for f in fixes if f))
    if len(distinct) <= 1:
        return distinct[0] if distinct else None
    name = container.rsplit(" ", 1)[-1]   # "global kept", "f() local kept": the variable
    whole = [f for f in distinct if f.startswith((f"{name} = ", f"del {name}  (")) or f == f"del {name}"]
    if whole:
        return whole[0]
    dels = [_DEL_ITEM.match(f) for f in distinct]
    if all(dels) and len({(m.group(1), m.group(3)) for m in dels if m}) == 1:
        idx = sorted(int(m.group(2)) for m in dels if m)
        if idx == list(range(idx[0], idx[-1] + 1)):
            m0 = dels[0]
            assert m0 is not None
            return f"del {m0.group(1)}[{idx[0]}:{idx[-1] + 1}]{m0.group(3)}"
    return "; ".join(distinct)


def _where(module: Optional[str], op: Optional[str], file: Optional[str], line: Optional[int],
           cells: Optional[Mapping[str, int]]) -> str:
    parts = []
    if module:
        parts.append(f"module {module}")
    if op:
        parts.append(op)
    loc = format_location(file, line, cells) if file or line is not None else ""
    if loc:
        parts.append(loc)
    return ", ".join(parts)


def _first_line(msg: Optional[str], limit: int = 160) -> str:
    lines = (msg or "").strip().splitlines()
    s = lines[0] if lines else ""
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _errors(errors: pa.Table, cells: Optional[Mapping[str, int]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if errors.num_rows == 0:
        return out
    for r in errors.to_pylist():
        kind = r.get("kind")
        if kind not in ("exception", "warning"):
            continue
        n = int(r.get("count") or 1)
        out.append({"rank": 0 if kind == "exception" else 4, "kind": kind,
                    "what": f"{r.get('py_type') or kind}: {_first_line(r.get('message'))}",
                    "where": _where(None, r.get("op"), r.get("source_file"), r.get("source_line"), cells),
                    "how_much": "raised" if kind == "exception" else f"{n}×", "fix": None,
                    "cost_ns": None, "bytes": None})
    return out


def _nonfinite(verdicts: Sequence[Mapping[str, Any]], cells: Optional[Mapping[str, int]]) -> list[dict[str, Any]]:
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for v in verdicts:
        if v.get("verdict") != "produced":
            continue
        key = (v.get("op"), v.get("module"), v.get("source_file"), v.get("source_line"))
        groups.setdefault(key, []).append(v)
    out = []
    for (op, module, file, line), vs in groups.items():
        n = sum(int(v.get("nonfinite") or 0) for v in vs)
        seqs = ", ".join(str(v["seq"]) for v in vs[:3]) + (" …" if len(vs) > 3 else "")
        out.append({"rank": 1, "kind": "nonfinite", "what": f"NaN/Inf produced from finite inputs by {op}",
                    "where": _where(module, None, file, line, cells),
                    "how_much": f"{n:,} non-finite value{'s' * (n != 1)} in {len(vs)} op{'s' * (len(vs) != 1)} "
                                f"(seq {seqs})",
                    "fix": None, "cost_ns": None, "bytes": n})
    return out


def _leaks(leaks: pa.Table, peak_bytes: int, cells: Optional[Mapping[str, int]], min_leak_share: float,
           min_leak_bytes: int) -> list[dict[str, Any]]:
    if leaks.num_rows == 0:
        return []
    groups: dict[str, dict[str, Any]] = {}
    for r in leaks.to_pylist():
        if r.get("expected"):
            continue
        holder = (r.get("holder") or "").split("; also ")[0].split(" → grad_fn")[0] or "(no holder found)"
        m = _ELEMENT.match(holder)   # the elements of one container (kept[0], kept[1], ...): one finding
        holder = m.group(1) if m else holder
        g = groups.setdefault(holder, {"bytes": 0, "n": 0, "growth": None, "fixes": [],
                                       "file": r.get("source_file"), "line": r.get("source_line"), "items": set()})
        g["fixes"].append(r.get("fix") or "")
        if m:
            g["items"].add(int(m.group(2)))
        g["bytes"] += int(r.get("nbytes") or 0)
        g["n"] += 1
        if r.get("growing") and r.get("growth_bytes_per_cell"):
            g["growth"] = max(g["growth"] or 0, int(r["growth_bytes_per_cell"]))
    out = []
    big = max(min_leak_bytes, int(peak_bytes * min_leak_share))
    for holder, g in groups.items():
        if g["growth"] is None and g["bytes"] < big:
            continue
        grow = f", growing {fmt_bytes(g['growth'])} per cell/step" if g["growth"] is not None else ""
        items = f" ({len(g['items'])} items)" if len(g["items"]) > 1 else ""
        out.append({"rank": 2 if g["growth"] is not None else 5, "kind": "leak",
                    "what": f"still alive after the cell, held by {holder}{items}",
                    "where": _where(None, None, g["file"], g["line"], cells),
                    "how_much": f"{fmt_bytes(g['bytes'])} in {g['n']} storage{'s' * (g['n'] != 1)}{grow}",
                    "fix": _group_fix(g["fixes"], holder) if g["items"] else (g["fixes"][0] or None),
                    "cost_ns": None, "bytes": g["bytes"]})
    return out


def _performance(findings: Optional[pa.Table], op_ns: int, min_share: float,
                 cells: Optional[Mapping[str, int]]) -> list[dict[str, Any]]:
    if findings is None or findings.num_rows == 0:
        return []
    out = []
    floor = op_ns * min_share
    for r in findings.to_pylist():
        cost = r.get("cost_ns")
        if cost is None or cost <= 0 or cost < floor:
            continue
        share = f" ({100 * cost / op_ns:.0f}% of op time)" if op_ns else ""
        out.append({"rank": 3, "kind": r.get("kind") or "", "what": f"{r.get('kind')}: {r.get('seen')}",
                    # first_run is about the whole cell: its subject is a phrase, not a place
                    "where": _where(r.get("module"), None if r.get("kind") == "first_run" else r.get("subject"),
                                    r.get("source_file"), r.get("source_line"), cells),
                    "how_much": f"{fmt_ns(cost)}{share}", "fix": r.get("fix") or None, "cost_ns": int(cost),
                    "bytes": None})
    return out


def headline(*, errors: pa.Table, verdicts: Sequence[Mapping[str, Any]], leaks: pa.Table,
             findings: Optional[pa.Table], op_ns: int, peak_bytes: int = 0, predicted: bool = False,
             cells: Optional[Mapping[str, int]] = None, k: int = MAX_LINES, min_share: float = 0.01,
             min_leak_share: float = 0.01, min_leak_bytes: int = 64 * 1024) -> list[dict[str, Any]]:
    """The at most ``k`` lines, most severe and most costly first (see the module docstring)."""
    lines = _errors(errors, cells) + _nonfinite(verdicts, cells) + _leaks(leaks, peak_bytes, cells, min_leak_share,
                                                                         min_leak_bytes)
    if not predicted:
        lines += _performance(findings, op_ns, min_share, cells)
    lines.sort(key=lambda d: (d["rank"], -(d["cost_ns"] or 0), -(d["bytes"] or 0), d["kind"], d["what"], d["where"]))
    return lines[:k]
