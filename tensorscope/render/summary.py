"""The cell summary: sections of rows, drawn as text or as self-contained HTML.

A section is computed by a function ``trace -> Section | None`` registered in
``SECTIONS`` (other modules add theirs with ``register_section``); the text and
HTML renderers draw every section the same way. Every string that reaches HTML
is escaped here, in one place (``_e``): op names, module names, messages and
cell source are user-controlled. No CDN, no server, no file: inline CSS only.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import pyarrow.compute as pc


@dataclass
class Section:
    title: str
    rows: List[Tuple] = field(default_factory=list)
    header: Optional[Tuple[str, ...]] = None
    notes: List[str] = field(default_factory=list)
    image_png: Any = None    # PNG bytes, or a callable making them, drawn only for HTML (data URI)
    svg: Any = None          # inline SVG markup (escaped by its maker, render/svg.py), or a callable making it


SECTIONS: List[Callable] = []


def register_section(fn: Callable, *, before: Optional[str] = None) -> Callable:
    if fn not in SECTIONS:
        SECTIONS.append(fn)
    return fn


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def fmt_ns(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    if n < 1e3:
        return f"{n:.0f} ns"
    if n < 1e6:
        return f"{n / 1e3:.1f} µs"
    if n < 1e9:
        return f"{n / 1e6:.2f} ms"
    return f"{n / 1e9:.2f} s"


def _location(file, line, cells=None) -> str:
    if file is None:
        return ""
    from .._location import format_location

    return format_location(file, line, cells)


@register_section
def overview(t) -> Section:
    md = t.metadata
    ops = t.ops
    n = ops.num_rows
    rows = []
    noise = pc.sum(pc.cast(ops.column("is_noise"), "int64")).as_py() or 0 if n else 0
    bwd = pc.sum(pc.cast(pc.equal(ops.column("phase"), "backward"), "int64")).as_py() or 0 if n else 0
    rows.append(("ATen ops", f"{n} ({n - bwd} forward, {bwd} backward; {noise} bookkeeping ops hidden below)"))
    rows.append(("torch-level calls", str(t.calls.num_rows)))
    if n:
        cpu = pc.sum(ops.column("cpu_ns")).as_py() or 0
        rows.append(("CPU time in ops", f"{fmt_ns(cpu)} of {fmt_ns(md.get('wall_ns'))} wall"))
        rows.append(("bytes read / written", f"{fmt_bytes(pc.sum(ops.column('bytes_read')).as_py())} / "
                                             f"{fmt_bytes(pc.sum(ops.column('bytes_written')).as_py())}"))
        fl = pc.sum(ops.column("flops")).as_py()
        if fl:
            rows.append(("FLOPs (ops with a formula)", f"{fl:,}"))
    tensors = t.tensors
    if tensors.num_rows:
        created = pc.invert(pc.is_null(tensors.column("alloc_seq")))
        nb = pc.sum(pc.filter(tensors.column("nbytes"), created)).as_py() or 0
        rows.append(("storages created", f"{pc.sum(pc.cast(created, 'int64')).as_py()} ({fmt_bytes(nb)})"))
    nat = md.get("native") or {}
    if nat:
        used = "native C++ hooks" if nat.get("used") else f"pure-Python fallback ({nat.get('reason') or nat.get('state')})"
        rows.append(("warning/error capture", used))
    if md.get("engine"):
        # the recording engine: one line, with the reason when it is the python fallback
        eng = md["engine"]
        rows.append(("recording engine", "native (C++ RecordFunction observer)" if eng == "native"
                     else f"python engine (TorchDispatchMode): {md.get('engine_reason') or 'fallback'}"))
    if md.get("saved_to"):
        rows.append(("saved to", md["saved_to"]))
    notes = []
    compiled = md.get("compiled_ops")
    if compiled is None:   # a trace saved before compiled ops were told apart
        compiled = md.get("opaque_ops") or 0
    if compiled and not t.graphs.num_rows:
        notes.append(f"{compiled} forward op(s) were dispatched by torch.compile'd code, which runs compiled and "
                     "opaque: only the ops the compiled artifact dispatches are visible, not what it fused.")
    direct = (md.get("opaque_ops") or 0) - compiled
    if direct > 0:
        notes.append(f"{direct} forward op(s) ran outside any torch-level call (called through torch.ops or from "
                     "C++): they have no call, and their line is unknown.")
    if md.get("spilled_rows"):
        notes.append(f"{md['spilled_rows']} rows were spilled to disk while recording (trace larger than spill_rows).")
    if md.get("tracer_errors"):
        notes.append(f"{md['tracer_errors']} internal tracer error(s) were contained; the trace may be incomplete.")
    for note in md.get("notes") or []:
        notes.append(note)
    cell = md.get("cell")
    return Section(f"tensorscope trace{f' of cell [{cell}]' if cell is not None else ''}", rows, None, notes)


@register_section
def top_ops(t, k: int = 10) -> Optional[Section]:
    ops = t.ops
    if ops.num_rows == 0:
        return None

    work = ops.filter(pc.invert(ops.column("is_noise")))
    if work.num_rows == 0:
        return None
    g = work.group_by("op").aggregate([("cpu_ns", "sum"), ("cpu_ns", "count"), ("bytes_written", "sum")])
    g = g.sort_by([("cpu_ns_sum", "descending")]).slice(0, k)
    total = pc.sum(work.column("cpu_ns")).as_py() or 1
    rows = []
    for r in g.to_pylist():
        rows.append((r["op"], str(r["cpu_ns_count"]), fmt_ns(r["cpu_ns_sum"]), f"{100 * r['cpu_ns_sum'] / total:.1f}%",
                     fmt_bytes(r["bytes_written_sum"])))
    return Section("top ops by CPU time", rows, ("op", "calls", "CPU", "share", "written"))


@register_section
def modules_section(t, k: int = 12) -> Optional[Section]:
    """Time per module, children rolled up into their parents (``layer4`` is its blocks' total)."""
    ops = t.ops
    if ops.num_rows == 0:
        return None
    with_mod = ops.filter(pc.invert(pc.is_null(ops.column("module"))))
    if with_mod.num_rows == 0:
        return None
    g = with_mod.group_by(["module", "phase"]).aggregate([("cpu_ns", "sum"), ("cpu_ns", "count")]).to_pylist()
    total: dict = {}
    own: dict = {}
    for r in g:
        name, ns, n, bwd = r["module"], r["cpu_ns_sum"] or 0, r["cpu_ns_count"], r["phase"] == "backward"
        own[name] = own.get(name, 0) + ns
        parts = name.split(".")
        for i in range(len(parts)):
            key = ".".join(parts[: i + 1])
            tot = total.setdefault(key, [0, 0, 0, 0])   # total ns, forward ns, backward ns, ops
            tot[0] += ns
            tot[2 if bwd else 1] += ns
            tot[3] += n
    grand = sum(own.values()) or 1
    roots = [key for key in total if key.startswith("<") and "." not in key]
    root = roots[0] if len(roots) == 1 else None   # the outermost module called: "<Net>"
    if root is not None:
        total[root] = [sum(v[i] for key, v in total.items() if "." not in key) for i in range(4)]
    children: dict = {}
    for key in total:
        parent = key.rsplit(".", 1)[0] if "." in key else (root if key != root else None)
        children.setdefault(parent, []).append(key)
    order = []

    def walk(parent):
        for key in sorted(children.get(parent, []), key=lambda c: -total[c][0]):
            order.append(key)
            walk(key)

    walk(None)
    rows = []
    for key in order[:k]:
        tot = total[key]
        rows.append((key, fmt_ns(tot[0]), fmt_ns(own.get(key, 0)), fmt_ns(tot[1]), fmt_ns(tot[2]), str(tot[3]),
                     f"{100 * tot[0] / grand:.1f}%"))
    notes = [f"{len(order) - k} more modules: t.sql(\"select module, sum(cpu_ns) from ops group by module\")"] \
        if len(order) > k else []
    return Section("time per module (children rolled up into parents)", rows,
                   ("module", "total", "self", "forward", "backward", "ops", "share"), notes)


@register_section
def errors_section(t) -> Optional[Section]:
    err = t.errors
    if err.num_rows == 0:
        return None
    rows = []
    for r in err.to_pylist()[:30]:
        where = []
        if r.get("cpp_type"):
            where.append(f"from {r['cpp_type']}")
        if r.get("cpp_file"):
            import os

            where.append(f"at {os.path.basename(r['cpp_file'])}:{r.get('cpp_line')}")
        if r.get("op"):
            where.append(f"in {r['op']}")
        if r.get("source_line") is not None:
            from .._location import format_location, trace_cells

            where.append(format_location(r.get("source_file"), r["source_line"], trace_cells(t)))
        msg = (r.get("message") or "").strip().splitlines()
        rows.append((r["kind"], r.get("py_type") or "", " ".join(where), (msg[0] if msg else "")[:300],
                     str(r.get("count") or 1)))
    return Section("exceptions and warnings", rows, ("kind", "type", "where", "message", "count"))


@dataclass
class Summary:
    sections: List[Section]

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
            parts.append(f'<div style="{TITLE_STYLE}">{_e(s.title)}</div>')
            png = s.image_png
            if callable(png):
                try:
                    png = png()
                except Exception as e:  # an image must never hide the tables
                    png = None
                    parts.append(f'<div style="color:#a15c00">timeline image failed: {_e(e)}</div>')
            svg = s.svg
            if callable(svg):
                try:
                    svg = svg()
                except Exception as e:  # a drawing must never hide the tables
                    svg = None
                    parts.append(f'<div style="color:#a15c00">{_e(s.title)} drawing failed: {_e(e)}</div>')
            if svg:
                parts.append(f'<div class="tensorscope-svg" style="overflow-x:auto">{svg}</div>')
            if png:
                import base64

                parts.append(f'<img alt="timeline" style="{IMG_STYLE}" src="data:image/png;base64,'
                             + base64.b64encode(png).decode("ascii") + '"/>')
            if s.rows:
                parts.append(html_table(s.header, s.rows))
            for n in s.notes:
                parts.append(f'<div style="{NOTE_STYLE}">note: {_e(n)}</div>')
        parts.append("</div>")
        return "".join(parts)

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.to_text(), "text/html": self.to_html()}

    def __str__(self):
        return self.to_text()


def _e(s) -> str:
    return html.escape("" if s is None else str(s), quote=True)


# -- HTML styling ---------------------------------------------------------------------------------
# Jupyter styles every output table: JupyterLab and nbconvert's lab template
# (``.jp-RenderedHTMLCommon td, th {text-align: right; white-space: normal; padding: .5em}``,
# ``table {table-layout: fixed; margin: auto}``) and the classic Notebook (``.rendered_html``) alike.
# Inline styles outrank any selector without ``!important`` and survive JupyterLab's sanitizer
# (a ``<style>`` element of an untrusted output does not), so every property those rules set is
# set here on the element itself, scoped to our own tables: text reads left-aligned, numbers
# right-aligned and never wrapped ("384.0 KiB" stays on one line), the same in a bare page.
BOX_STYLE = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:12px;line-height:1.4;text-align:left"
TITLE_STYLE = "margin:6px 0 2px;font-weight:600;text-align:left"
NOTE_STYLE = "color:#a15c00;text-align:left"
IMG_STYLE = "display:block;max-width:100%;height:auto;margin:2px 0"
TABLE_STYLE = ("border-collapse:collapse;border-spacing:0;border:none;table-layout:auto;width:auto;"
               "margin:0 0 4px 0;font-size:12px;color:inherit")
_CELL = "padding:1px 8px;border:none;line-height:1.4;max-width:none;background:transparent;"
TH_STYLE = _CELL + "text-align:left;vertical-align:bottom;font-weight:600;white-space:nowrap"
TD_STYLE = _CELL + "text-align:left;vertical-align:top;white-space:normal;overflow-wrap:break-word"
NUM_STYLE = _CELL + "text-align:right;vertical-align:top;white-space:nowrap;font-variant-numeric:tabular-nums"
KEY_STYLE = _CELL + "text-align:left;vertical-align:top;white-space:nowrap"

#: a number, optionally with a unit, a share or a range: "384.0 KiB", "12", "1.5 ms", "3.2%", "12,345"
_NUMBER = re.compile(r"^[-+−]?[\d][\d,._]*(\s?(B|KiB|MiB|GiB|TiB|ns|µs|us|ms|s|%|x|×|/cell))?$")


#: columns that hold names even when every value looks like a number (module "0", cell 3)
_TEXT_HEADERS = frozenset(("module", "op", "phase", "device", "kind", "holder", "fix", "created", "type", "where",
                           "message", "when", "cell"))


def is_number_text(v) -> bool:
    return isinstance(v, (int, float)) or (isinstance(v, str) and bool(_NUMBER.match(v.strip())))


def html_table(header: Optional[Sequence[str]], rows: Sequence[Sequence[Any]]) -> str:
    """One self-styled table: a column whose cells are all numbers (with units) is right-aligned and
    never wraps; every other column is left-aligned text. A header-less two-column table is a list of
    ``key: value`` pairs (keys on one line)."""
    ncols = max((len(r) for r in rows), default=len(header or ()))
    numeric = []
    for c in range(ncols):
        vals = [r[c] for r in rows if c < len(r) and r[c] not in (None, "", "-")]
        named = header is not None and c < len(header) and str(header[c]).lower() in _TEXT_HEADERS
        numeric.append(bool(vals) and not named and all(is_number_text(v) for v in vals))
    kv = header is None and ncols == 2
    parts = [f'<table class="tensorscope-table" style="{TABLE_STYLE}">']
    if header:
        parts.append("<thead><tr>" + "".join(
            f'<th style="{TH_STYLE}{";text-align:right" if c < ncols and numeric[c] else ""}">{_e(h)}</th>'
            for c, h in enumerate(header)) + "</tr></thead>")
    parts.append("<tbody>")
    for r in rows:
        cells = []
        for c, v in enumerate(r):
            st = NUM_STYLE if numeric[c] else (KEY_STYLE if kv and c == 0 else TD_STYLE)
            cells.append(f'<td style="{st}">{_e(v)}</td>')
        parts.append("<tr>" + "".join(cells) + "</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


def summarize(t) -> Summary:
    _load_section_modules()
    out = []
    for fn in list(SECTIONS):
        try:
            sec = fn(t)
        except Exception as e:  # a broken section must not hide the others
            sec = Section(getattr(fn, "__name__", "section"), [], None, [f"could not render: {type(e).__name__}: {e}"])
        if sec is not None:
            out.append(sec)
    return Summary(out)


_SECTION_MODULES = ("tensorscope.render.sections_precision", "tensorscope.render.sections_memory",
                    "tensorscope.render.sections_timing", "tensorscope.render.sections_compiled",
                    "tensorscope.render.sections_api")


def _load_section_modules():
    import importlib

    for m in _SECTION_MODULES:
        try:
            importlib.import_module(m)
        except ImportError:
            pass
