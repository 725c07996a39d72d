"""Pages generated from the code when the site builds, so they cannot drift from it.

* ``_generated/options.md``: one row per field of ``TraceOptions`` and ``DisplayOptions``
  (flag, keyword, default, help), read from ``tensorscope.options``' declarations.
* ``_generated/tables.md``: every table of ``tensorscope.schema`` (recorded, derived, the
  dataset's ``ranks`` and the analysis views), every column with its Arrow type and the
  comment the schema declares it with.
* ``_generated/cli.md``: the help of every ``python -m tensorscope`` subcommand, from its parser.
* ``api/index.md``: the API reference page, an autosummary of ``tensorscope.__all__`` (autosummary
  writes one page per name under ``api/generated/``).

Run by Sphinx (``builder-inited``) or by hand: ``python docs/_ext/tsgen.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import os
import re
import textwrap
from contextlib import redirect_stdout
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
OUT = DOCS / "_generated"


def _cell(s: object) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def options_md() -> str:
    from tensorscope import options as O

    rows = ["| flag | `trace()` keyword | default | meaning |", "|---|---|---|---|"]
    for cls in O.OPTION_CLASSES:
        for f in dataclasses.fields(cls):
            md = f.metadata
            if "help" not in md:
                continue
            flag = O.cli_flag(f)[0]
            if md.get("metavar"):
                flag += " " + md["metavar"]
            elif md.get("type") not in (None,):
                flag += " " + f.name.upper()
            kw = f"`{f.name}=`" if cls is O.TraceOptions else f"`DisplayOptions({f.name}=…)`"
            default = f.default if f.default is not dataclasses.MISSING else "–"
            default = "–" if default is None else default
            rows.append(f"| `{_cell(flag)}` | {kw} | `{_cell(repr(default) if isinstance(default, str) and default != '–' else default)}` "
                        f"| {_cell(md['help'].replace('%%', '%'))} |")
    return "\n".join(rows) + "\n"


_SCHEMA_LINE = re.compile(r'^\s*(?P<var>[A-Z_]+)\s*=\s*_schema\(\s*"(?P<name>[a-z_]+)"')
_FIELD_LINE = re.compile(r'^\s*\(\s*"(?P<col>[A-Za-z_0-9]+)"\s*,[^#]*?\)\s*,?\s*(#\s*(?P<doc>.*))?$')
_COMMENT_LINE = re.compile(r"^\s*#\s*(?P<doc>.*)$")


def type_name(t: object) -> str:
    """A short spelling of an Arrow type: ``dictionary<values=string, …>`` is a string column."""
    s = str(t)
    s = re.sub(r"dictionary<values=string, indices=int32, ordered=0>", "string", s)
    s = s.replace("item: ", "")
    return s


def schema_comments() -> dict[str, dict[str, str]]:
    """``{table: {column: comment}}`` read from the schema sources (the comment each column is declared with)."""
    import tensorscope.schema as S

    out: dict[str, dict[str, str]] = {}
    for path in sorted(Path(S.__file__).parent.glob("*.py")):
        table = None
        last = None
        for line in path.read_text(encoding="utf-8").splitlines():
            m = _SCHEMA_LINE.match(line)
            if m:
                table, last = m.group("name"), None
                out.setdefault(table, {})
                continue
            if table is None:
                continue
            if line.strip().startswith("])"):
                table, last = None, None
                continue
            m = _FIELD_LINE.match(line)
            if m:
                last = m.group("col")
                out[table][last] = (m.group("doc") or "").strip()
                continue
            m = _COMMENT_LINE.match(line)
            if m and last is not None and out[table][last]:
                out[table][last] += " " + m.group("doc").strip()
    return out


def _schemas() -> list[tuple[str, str, object]]:
    import tensorscope.schema as S
    import tensorscope.schema.views as V

    found: list[tuple[str, str, object]] = []
    for name, schema in S.TABLES.items():
        kind = "recorded" if name in S.RECORDED else "derived" if name in S.DERIVED else "table"
        found.append((name, kind, schema))
    found.append(("ranks", "dataset", S.RANKS))
    seen = {n for n, _, _ in found}
    for var in sorted(vars(V)):
        schema = getattr(V, var)
        meta = getattr(schema, "metadata", None)
        if var.isupper() and hasattr(schema, "names") and hasattr(schema, "field"):
            name = var.lower()
            if meta and b"name" in meta:
                name = meta[b"name"].decode()
            if name not in seen:
                found.append((name, "view", schema))
                seen.add(name)
    return found


def tables_md() -> str:
    import tensorscope.schema as S

    comments = schema_comments()
    parts = [f"Schema version **{S.SCHEMA_VERSION}**. Generated from `tensorscope.schema` when this site was built.\n"]
    what = {"recorded": "recorded while the trace runs",
            "derived": "derived from the recorded tables when the trace ends",
            "table": "a table of every trace",
            "dataset": "datasets only (`tensorscope.open_dataset`): one row per trace a rank wrote",
            "view": "returned by an analysis (not stored with the trace)"}
    for name, kind, schema in _schemas():
        parts.append(f"(table-{name.replace('_', '-')})=\n### `{name}`\n\n{what[kind].capitalize()}.\n")
        parts.append("| column | type | declared as |\n|---|---|---|")
        for f in schema:  # type: ignore[attr-defined]
            doc = comments.get(name, {}).get(f.name, "")
            parts.append(f"| `{f.name}` | `{_cell(type_name(f.type))}` | {_cell(doc)} |")
        parts.append("")
    return "\n".join(parts) + "\n"


def cli_md() -> str:
    from tensorscope.__main__ import _parser

    os.environ["COLUMNS"] = "100"
    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    parts = ["```text", p.format_usage().strip(), "```", ""]
    for name, sp in sub.choices.items():
        parts.append(f"(cli-{name})=\n### `{name}`\n\n{_cell(helps.get(name) or '')}\n")
        text = sp.format_help()
        if name == "build-native":
            from tensorscope.native import build_native_main

            buf = io.StringIO()
            try:
                with redirect_stdout(buf):
                    build_native_main(["--help"])
            except SystemExit:
                pass
            text = buf.getvalue() or text
        parts += ["```text", text.rstrip(), "```", ""]
    return "\n".join(parts) + "\n"


_GROUP_TITLES = {
    "record": "Record",
    "results": "Results",
    "options": "Options",
    "leaks": "Leaks",
    "compare": "Compare",
    "errors": "Errors",
    "environment": "Environment and the IPython extension",
}


def api_md() -> str:
    import tensorscope

    parts = [textwrap.dedent("""\
        # API reference

        Every public name of the `tensorscope` package (`tensorscope.__all__`), by what it is for
        (`tensorscope.GROUPS`), generated from the docstrings when this site was built. `import tensorscope`
        is cheap: torch, pyarrow and IPython are imported on first use of a name that needs them. The
        other exceptions are in `tensorscope.errors`; a name that moved off the top level still works
        as `tensorscope.<name>` and warns (DeprecationWarning) with the module it lives in now.
        """)]
    for group, names in tensorscope.GROUPS.items():
        shown = [n for n in names if not n.startswith("_")]
        if not shown:
            continue
        parts.append(f"\n## {_GROUP_TITLES.get(group, group.capitalize())}\n\n```{{eval-rst}}\n"
                     ".. currentmodule:: tensorscope\n\n.. autosummary::\n   :toctree: generated\n   :nosignatures:\n\n"
                     + "\n".join("   " + n for n in shown) + "\n```\n")
    parts.append(textwrap.dedent("""
        ## The command line

        `python -m tensorscope` (also installed as the `tensorscope` command): see the
        {ref}`command reference <cli-reference>`.

        ## The IPython extension

        `%load_ext tensorscope` registers the `%%tensorscope` cell magic and the `%tensorscope` line
        magic (see {doc}`../guide/usage`); `tensorscope.load_ipython_extension` is what it calls.
        """))
    return "".join(parts)


def generate() -> list[Path]:
    OUT.mkdir(exist_ok=True)
    written = []
    for path, fn in ((OUT / "options.md", options_md), (OUT / "tables.md", tables_md), (OUT / "cli.md", cli_md),
                     (DOCS / "api" / "index.md", api_md)):
        path.parent.mkdir(exist_ok=True)
        text = fn()
        if not path.exists() or path.read_text(encoding="utf-8") != text:   # unchanged files keep their mtime
            path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def _on_init(app: object) -> None:
    generate()


def option_fields_doc(cls: type) -> list[str]:
    """Lines listing every field of an options dataclass: default, command-line flag and help."""
    from tensorscope import options as O

    lines = ["", ".. rubric:: Fields", ""]
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        help_ = f.metadata["help"].replace("%%", "%").replace("*", "\\*")
        lines.append(f"- ``{f.name}`` (default ``{default!r}``, flag ``{O.cli_flag(f)[0]}``): {help_}")
    return lines + [""]


def _on_docstring(app: object, what: str, name: str, obj: object, options: object, lines: list[str]) -> None:
    from tensorscope import options as O

    if what == "class" and obj in O.OPTION_CLASSES:
        lines.extend(option_fields_doc(obj))  # type: ignore[arg-type]


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("builder-inited", _on_init)
    app.connect("autodoc-process-docstring", _on_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    for p in generate():
        print(p)
