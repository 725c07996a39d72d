"""The summary's advisor section: each finding with what was seen, the rows, the cost and the fix.

``advice_section(t)`` asks the trace for its advice (``t.advice()``, computed by
``tensorscope._advice`` and ``analyses/advisor.py``) and draws it with ``advice_to_section``,
which ``Advice.to_text()/to_html()`` use too; the roofline is an inline SVG (render/roofline.py),
drawn only for HTML. Every string goes through the section drawing (escaped).
"""
from __future__ import annotations

from typing import Any, Optional

from .._common import fmt_ns, fmt_rate
from ..analyses.advisor import BUSY_SHARE, outside_totals
from .section import Section

TITLE = "why is it slow: the advisor"


def peaks_line(peaks: Any) -> list[str]:
    from .env import peak_text

    return [f"{dev}: {peak_text(p)}" for dev, p in sorted((peaks or {}).items())]


def outside_note(outs: list[dict[str, Any]], steps: Optional[int]) -> str:
    """The time outside ops, as measured: the gaps between ops (past tensorscope's own per-op work)
    against the wall time, and, on a busy machine, the time the thread waited for a CPU, which may
    explain some of the gaps (the ``outside_ops`` finding counts only what it cannot: the rest)."""
    tot = outside_totals(outs)
    wall, gaps, delay, waited = tot["wall"], tot["gaps"], tot["delay"], tot["waited"]
    tiny = sum(o.get("tiny_ops") or 0 for o in outs)
    text = (f"{100 * gaps / wall if wall else 0:.0f}% of the wall time ({fmt_ns(gaps)} of {fmt_ns(wall)}, enter to "
            "exit) was outside ops, past tensorscope's own per-op work")
    if waited:
        explains = "all of it" if waited >= gaps else f"{fmt_ns(waited)} of it"
        text += (f"; the thread waited {fmt_ns(delay)} for a CPU in the block (other processes' time), which may "
                 f"explain {explains}: the outside_ops finding counts the rest ({fmt_ns(gaps - waited)})")
    return text + f"; {tiny} tiny ops" + (f", {fmt_rate(tiny / steps)} per step" if steps else "")


def advice_to_section(a: Any) -> Section:
    rows = []
    for r in a.findings.to_pylist():
        per = f" ({fmt_rate(r['per_step'])}/step)" if r.get("per_step") is not None else ""
        rows.append((r["kind"], r["seen"], r["evidence"] + per, fmt_ns(r["cost_ns"]), r["fix"]))
    notes: list[str] = []
    if getattr(a, "predicted", False):
        notes.append("PREDICTED (FakeTensorMode): nothing ran, the times are not measured")
    notes += list(a.notes)
    outs = [o for o in a.outside or [] if o]
    if outs and not getattr(a, "predicted", False):
        notes.append(outside_note(outs, a.steps))
    busy = int(getattr(a, "busy_left", 0) or 0)
    if busy:
        whole = a.wall_ns and a.run_delay_ns >= BUSY_SHARE * a.wall_ns
        notes.append(f"{busy} finding{'s' * (busy != 1)} read from op times left out: the thread waited "
                     f"{fmt_ns(a.run_delay_ns)} for a CPU in the block (other processes' time, which the op times "
                     "hold), " + (f"{100 * a.run_delay_ns / a.wall_ns:.0f}% of the wall" if whole else
                                  f"as much as {'each' if busy != 1 else 'it'} cost")
                     + "; run the cell again on an idle machine")
    first = int(getattr(a, "first_run_ns", 0) or 0)
    if first and not getattr(a, "cold", False) and not getattr(a, "predicted", False):
        notes.append(f"{fmt_ns(first)} of first executions (ops.first_run: one-time initialisation) left out of "
                     "the timing findings")
    if a.n_windows > 1:
        notes.append(f"read {a.n_windows} traced windows" + (f", {a.steps} steps" if a.steps else ""))
    if not rows:
        notes.append("no finding: no sync, layout conversion, tiny-op storm, idle time or dominant op "
                     "that the rows prove")
    share = getattr(a, "min_share", None)
    if share is not None and int(getattr(a, "op_ns", 0) or 0):
        notes.append(f"performance findings cost at least {100 * share:g}% of the op time "
                     f"({fmt_ns(share * a.op_ns)}; DisplayOptions.min_finding_share)")
    if a.peaks:
        notes.append(f"peaks ({a.peaks_source}): " + " | ".join(peaks_line(a.peaks)))
    else:
        notes.append(f"peaks: {a.peaks_source}; the roofline has no roof")
    svg = None
    if a.roofline.num_rows:
        from .roofline import roofline_svg

        svg = lambda: roofline_svg(a.roofline, a.peaks)  # noqa: E731
    title = TITLE + (" (PREDICTED: no timing findings)" if getattr(a, "predicted", False) else "")
    return Section(title, rows, ("finding", "seen", "rows", "cost", "fix"), notes, svg=svg)


def advice_section(t: Any, display: Any = None) -> Optional[Section]:
    if t.ops.num_rows == 0 or not hasattr(t, "advice"):
        return None
    share = getattr(display, "min_finding_share", None) if display is not None else None
    return advice_to_section(t.advice(min_share=share) if share is not None else t.advice())
