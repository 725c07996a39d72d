"""The cell summary: sections of rows, drawn as text or as self-contained HTML.

A section is computed by a function ``trace -> Section | None`` registered in
``SECTIONS`` (other modules add theirs with ``register_section``); the text and
HTML renderers draw every section the same way. Every string that reaches HTML
is escaped here, in one place (``_e``): op names, module names, messages and
cell source are user-controlled. No CDN, no server, no file: inline CSS only.
"""
from __future__ import annotations

import html
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
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


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


def _location(file, line) -> str:
    if file is None:
        return ""
    import os

    base = os.path.basename(file)
    return f"{base}:{line}" if line is not None else base


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
    if md.get("opaque_ops"):
        notes.append(f"{md['opaque_ops']} forward op(s) ran outside any torch-level call the function mode saw: "
                     "typically torch.compile'd code, which runs compiled and opaque (only the ops the compiled "
                     "artifact dispatches are visible, not what it fused), or code called from C++.")
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
    import pyarrow as pa

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
def modules_section(t, k: int = 8) -> Optional[Section]:
    ops = t.ops
    if ops.num_rows == 0:
        return None
    with_mod = ops.filter(pc.invert(pc.is_null(ops.column("module"))))
    if with_mod.num_rows == 0:
        return None
    g = with_mod.group_by(["module", "phase"]).aggregate([("cpu_ns", "sum"), ("cpu_ns", "count")])
    g = g.sort_by([("cpu_ns_sum", "descending")]).slice(0, k)
    rows = [(r["module"], r["phase"], str(r["cpu_ns_count"]), fmt_ns(r["cpu_ns_sum"])) for r in g.to_pylist()]
    return Section("time per module", rows, ("module", "phase", "ops", "CPU"))


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
            where.append(f"line {r['source_line']}")
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
        parts = ['<div class="tensorscope-summary" style="font-family:system-ui,sans-serif;font-size:12px;">']
        for s in self.sections:
            parts.append(f'<div style="margin:6px 0 2px;font-weight:600">{_e(s.title)}</div>')
            png = s.image_png
            if callable(png):
                try:
                    png = png()
                except Exception as e:  # an image must never hide the tables
                    png = None
                    parts.append(f'<div style="color:#a15c00">timeline image failed: {_e(e)}</div>')
            if png:
                import base64

                parts.append('<img alt="timeline" src="data:image/png;base64,'
                             + base64.b64encode(png).decode("ascii") + '"/>')
            if s.rows:
                parts.append('<table style="border-collapse:collapse">')
                if s.header:
                    parts.append("<tr>" + "".join(f'<th style="text-align:left;padding:1px 8px">{_e(h)}</th>'
                                                  for h in s.header) + "</tr>")
                for r in s.rows:
                    parts.append("<tr>" + "".join(f'<td style="padding:1px 8px;vertical-align:top">{_e(c)}</td>'
                                                  for c in r) + "</tr>")
                parts.append("</table>")
            for n in s.notes:
                parts.append(f'<div style="color:#a15c00">note: {_e(n)}</div>')
        parts.append("</div>")
        return "".join(parts)

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.to_text(), "text/html": self.to_html()}

    def __str__(self):
        return self.to_text()


def _e(s) -> str:
    return html.escape("" if s is None else str(s), quote=True)


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
                    "tensorscope.render.sections_timing")


def _load_section_modules():
    import importlib

    for m in _SECTION_MODULES:
        try:
            importlib.import_module(m)
        except ImportError:
            pass
