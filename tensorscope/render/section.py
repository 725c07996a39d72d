"""The summary's data: ``Section`` (a title, rows, notes, an optional drawing), ``Head`` (the headline
and the totals line) and ``Summary`` (drawn as text or as self-contained HTML, every section the same way).

HTML: the head first, then each section as a ``<details>`` that starts collapsed (its title is the
``<summary>``); the text in the same order. Styles are classes of one ``<style>`` block
(render/html.py ``SUMMARY_CSS``). Drawings are ``<img>`` of an SVG data URI (render/svg.py
``svg_img``): JupyterLab's sanitizer keeps an ``<img>`` of an untrusted output and strips an inline
``<svg>`` to the run-on text of its titles. No CDN, no server, no file, no script; every string that
reaches HTML is escaped (op names, module names, messages and cell source are user-controlled).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .._common import Displayable, esc
from .html import html_table, style_block
from .svg import svg_img


@dataclass
class Section:
    """One section of a summary: a title, rows under an optional header, notes, and an optional image
    (SVG or PNG, drawn only in HTML), and ``children``: (label, rows) groups shown nested under a row
    (a module's children), expanded on demand."""

    title: str
    rows: list[tuple] = field(default_factory=list)
    header: Optional[tuple[str, ...]] = None
    notes: list[str] = field(default_factory=list)
    image_png: Any = None    # PNG bytes, or a callable making them, drawn only for HTML (data URI)
    svg: Any = None          # SVG markup (escaped by its maker, render/svg.py), or a callable making it
    children: list[tuple[str, list[tuple]]] = field(default_factory=list)
    text_alt: Optional[str] = None   # what the drawing shows, as text (the text summary and the image's alt)


@dataclass
class Head:
    """What a cell's summary says first: a title line, the headline (at most five ranked findings, each a
    dict of ``analyses.headline``), one line of totals, and whether the trace is a prediction."""

    title: str
    lines: list[dict[str, Any]]
    totals: str
    predicted: bool = False
    clean: str = ""

    def text_lines(self) -> list[str]:
        pred = "PREDICTED (FakeTensorMode: shapes, bytes and FLOPs; nothing ran, no time measured) — " \
            if self.predicted else ""
        if not self.lines:
            out = [f"{pred}{self.title}: {self.clean}"]
        else:
            n = len(self.lines)
            out = [f"{pred}{self.title}: {n} thing{'s' * (n != 1)} to look at first"]
            for i, d in enumerate(self.lines, 1):
                out.append(f"  {i}. {_line(d)}")
        out.append(f"  {self.totals}")
        return out


def _line(d: dict[str, Any]) -> str:
    parts = [d["what"]]
    if d.get("where"):
        parts.append(f"at {d['where']}")
    if d.get("how_much"):
        parts.append(d["how_much"])
    s = " — ".join(parts)
    return s + (f" → fix: {d['fix']}" if d.get("fix") else "")


@dataclass
class Summary(Displayable):
    """A result's summary as sections, drawn as text (``str``) or HTML (the notebook display); with a
    ``head``, the headline comes first and every section starts collapsed."""

    sections: list[Section]
    head: Optional[Head] = None
    inline_svg: bool = False   # drawings as inline <svg> with hover titles (a standalone page: t.report)

    def _titled(self, s: Section) -> str:
        return f"{s.title} (predicted)" if self.head is not None and self.head.predicted else s.title

    def to_text(self) -> str:
        out = self.head.text_lines() if self.head is not None else []
        for s in self.sections:
            if not s.rows and not s.notes and not s.text_alt:
                continue   # an image-only section with no text form has nothing to say as text
            out.append(f"== {self._titled(s)} ==")
            if s.text_alt:
                out.append(f"  {s.text_alt}")
            if s.header and s.rows:
                out.append("  " + " | ".join(s.header))
            for r in s.rows:
                out.append("  " + _text_row(s, r))
            for _label, rows in s.children:
                for r in rows:
                    out.append("    " + _text_row(s, r))
            for n in s.notes:
                out.append(f"  note: {n}")
        return "\n".join(out)

    def to_html(self) -> str:
        parts = [f'<div class="tensorscope-summary">{style_block()}']
        collapsed = self.head is not None
        if self.head is not None:
            parts.append(_head_html(self.head))
        for s in self.sections:
            title = esc(self._titled(s))
            parts.append(f"<details><summary>{title}</summary>" if collapsed else f'<div class="ts-t">{title}</div>')
            png = _made(s.image_png, "timeline image", parts)
            svg = _made(s.svg, f"{s.title} drawing", parts)
            if svg:
                parts.append(svg if self.inline_svg else svg_img(svg, s.text_alt or s.title))
            if png:
                import base64

                parts.append(f'<img class="ts-img" alt="{esc(s.text_alt or "timeline")}" src="data:image/png;base64,'
                             + base64.b64encode(png).decode("ascii") + '"/>')
            if s.rows:
                parts.append(html_table(s.header, s.rows, classes=True))
            for label, rows in s.children:
                parts.append(f'<details class="ts-sub"><summary>{esc(label)}</summary>'
                             f"{html_table(s.header, rows, classes=True)}</details>")
            for n in s.notes:
                parts.append(f'<div class="ts-note">note: {esc(n)}</div>')
            if collapsed:
                parts.append("</details>")
        parts.append("</div>")
        return "".join(parts)


def _text_row(s: Section, r: tuple) -> str:
    return f"{r[0]}: {r[1]}" if (s.header is None and len(r) == 2) else " | ".join(str(c) for c in r)


def _head_html(h: Head) -> str:
    pred = ('<span class="ts-pred">PREDICTED (FakeTensorMode: shapes, bytes and FLOPs; nothing ran, no time '
            "measured)</span> ") if h.predicted else ""
    if not h.lines:
        return (f'<div class="ts-head">{pred}<b>{esc(h.title)}</b>: <span class="ts-ok">{esc(h.clean)}</span></div>'
                f"<div>{esc(h.totals)}</div>")
    n = len(h.lines)
    items = []
    for d in h.lines:
        cls = ' class="ts-bad"' if d["rank"] in (0, 1, 2) else ""
        s = f"<b{cls}>{esc(d['what'])}</b>"
        if d.get("where"):
            s += f" at {esc(d['where'])}"
        if d.get("how_much"):
            s += f" — {esc(d['how_much'])}"
        if d.get("fix"):
            s += f" → fix: <code>{esc(d['fix'])}</code>"
        items.append(f"<li>{s}</li>")
    return (f'<div class="ts-head">{pred}<b>{esc(h.title)}</b>: {n} thing{"s" * (n != 1)} to look at first</div>'
            f'<ol class="ts-headline">{"".join(items)}</ol><div>{esc(h.totals)}</div>')


def _made(drawing, what: str, parts: list[str]):
    """A drawing given as a callable is made now, for HTML only; if that fails, a note says so
    and the section's tables still show."""
    if not callable(drawing):
        return drawing
    try:
        return drawing()
    except Exception as e:
        parts.append(f'<div class="ts-note">{esc(what)} failed: {esc(e)}</div>')
        return None
