"""The summary's advisor section: each finding with what was seen, the rows, the cost and the fix.

``advice_section(t)`` asks the trace for its advice (``t.advice()``, computed by
``tensorscope._advice`` and ``analyses/advisor.py``) and draws it with ``advice_to_section``,
which ``Advice.to_text()/to_html()`` use too; the roofline is an inline SVG (render/roofline.py),
drawn only for HTML. Every string goes through the section drawing (escaped).
"""
from __future__ import annotations

from typing import Any, Optional

from .._common import fmt_ns
from .section import Section

TITLE = "why is it slow: the advisor"


def peaks_line(peaks: Any) -> list[str]:
    from .env import peak_text

    return [f"{dev}: {peak_text(p)}" for dev, p in sorted((peaks or {}).items())]


def advice_to_section(a: Any) -> Section:
    rows = []
    for r in a.findings.to_pylist():
        per = f" ({r['per_step']:g}/step)" if r.get("per_step") is not None else ""
        rows.append((r["kind"], r["seen"], r["evidence"] + per, fmt_ns(r["cost_ns"]), r["fix"]))
    notes: list[str] = list(a.notes)
    outs = [o for o in a.outside or [] if o]
    if outs:
        span = sum(o["span_ns"] for o in outs)
        outside = sum(o["outside_ns"] for o in outs)
        tiny = sum(o.get("tiny_ops") or 0 for o in outs)
        per = f", {tiny / a.steps:g} per step" if a.steps else ""
        notes.append(f"{100 * outside / span if span else 0:.0f}% of the time from the first op to the last "
                     f"({fmt_ns(outside)} of {fmt_ns(span)}) was outside ops; {tiny} tiny ops{per}")
    if a.n_windows > 1:
        notes.append(f"read {a.n_windows} traced windows" + (f", {a.steps} steps" if a.steps else ""))
    if not rows:
        notes.append("no finding: no sync, layout conversion, tiny-op storm, idle time or dominant op "
                     "that the rows prove")
    if a.peaks:
        notes.append(f"peaks ({a.peaks_source}): " + " | ".join(peaks_line(a.peaks)))
    else:
        notes.append(f"peaks: {a.peaks_source}; the roofline has no roof")
    svg = None
    if a.roofline.num_rows:
        from .roofline import roofline_svg

        svg = lambda: roofline_svg(a.roofline, a.peaks)  # noqa: E731
    return Section(TITLE, rows, ("finding", "seen", "rows", "cost", "fix"), notes, svg=svg)


def advice_section(t: Any) -> Optional[Section]:
    if t.ops.num_rows == 0 or not hasattr(t, "advice"):
        return None
    return advice_to_section(t.advice())
