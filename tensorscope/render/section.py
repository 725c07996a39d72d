"""The summary's data: ``Section`` (a title, rows, notes, an optional drawing) and ``Summary``
(sections drawn as text or as self-contained HTML, every section the same way).

No CDN, no server, no file: inline CSS only (render/html.py); every string that reaches
HTML is escaped (op names, module names, messages and cell source are user-controlled).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .._common import Displayable, esc
from .html import BOX_STYLE, IMG_STYLE, NOTE_STYLE, TITLE_STYLE, html_table


@dataclass
class Section:
    """One section of a summary: a title, rows under an optional header, notes, and an optional image
    (inline SVG or PNG, drawn only in HTML)."""

    title: str
    rows: list[tuple] = field(default_factory=list)
    header: Optional[tuple[str, ...]] = None
    notes: list[str] = field(default_factory=list)
    image_png: Any = None    # PNG bytes, or a callable making them, drawn only for HTML (data URI)
    svg: Any = None          # inline SVG markup (escaped by its maker, render/svg.py), or a callable making it


@dataclass
class Summary(Displayable):
    """A result's summary as sections, drawn as text (``str``) or HTML (the notebook display)."""

    sections: list[Section]

    def to_text(self) -> str:
        out = []
        for s in self.sections:
            if not s.rows and not s.notes:
                continue   # an image-only section has nothing to say as text
            out.append(f"== {s.title} ==")
            if s.header:
                out.append("  " + " | ".join(s.header))
            for r in s.rows:
                out.append("  " + (f"{r[0]}: {r[1]}" if (s.header is None and len(r) == 2) else " | ".join(str(c) for c in r)))
            for n in s.notes:
                out.append(f"  note: {n}")
        return "\n".join(out)

    def to_html(self) -> str:
        parts = [f'<div class="tensorscope-summary" style="{BOX_STYLE}">']
        for s in self.sections:
            parts.append(f'<div style="{TITLE_STYLE}">{esc(s.title)}</div>')
            png = _made(s.image_png, "timeline image", parts)
            svg = _made(s.svg, f"{s.title} drawing", parts)
            if svg:
                parts.append(f'<div class="tensorscope-svg" style="overflow-x:auto">{svg}</div>')
            if png:
                import base64

                parts.append(f'<img alt="timeline" style="{IMG_STYLE}" src="data:image/png;base64,'
                             + base64.b64encode(png).decode("ascii") + '"/>')
            if s.rows:
                parts.append(html_table(s.header, s.rows))
            for n in s.notes:
                parts.append(f'<div style="{NOTE_STYLE}">note: {esc(n)}</div>')
        parts.append("</div>")
        return "".join(parts)


def _made(drawing, what: str, parts: list[str]):
    """A drawing given as a callable is made now, for HTML only; if that fails, a note says so
    and the section's tables still show."""
    if not callable(drawing):
        return drawing
    try:
        return drawing()
    except Exception as e:
        parts.append(f'<div style="{NOTE_STYLE}">{esc(what)} failed: {esc(e)}</div>')
        return None
