"""The layers of tensorscope, read from the code: the import graph, its violations, the picture.

    python tools/architecture.py            # the picture of the house (docs/development/architecture.md holds it)
    python tools/architecture.py --check    # exit 1 and name every offending import
    python tools/architecture.py --write    # regenerate the picture inside docs/development/architecture.md
    python tools/architecture.py --edges    # every import between layers, with file and line

Every ``import``/``from … import`` of a tensorscope module counts (and ``import_module`` /
``__import__`` of a literal name): at module level, inside functions (a function-level import
still makes one module depend on another; it only moves *when* the dependency is paid) and under
``if TYPE_CHECKING:`` (a type named for the checker is a dependency of the design all the same).
A module belongs to the layer of the longest prefix listed in ``LAYERS`` that names it; a
subpackage is placed whole (one layer per folder), a module of the package root by itself.
Rules:

1. an import goes to the same layer or one below (``ALLOWED_UP`` lists the exceptions, each
   with its reason);
2. the import graph has no cycle (the ``ALLOWED_UP`` edges left out);
3. a private name (``_x``) or a private module (``pkg._x``) is imported only inside its own
   package; the private modules of the package root (``_trace``, ``_env``, ...) are package
   internals open to all of tensorscope (``KNOWN_PRIVATE`` lists what is still to fix);
4. inside a layer, the pairs in ``APART`` never import each other one way (the engines: what both
   need is in a module below them).

Standard library only, and nothing of tensorscope is imported: the graph comes from ``ast``.
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import sys
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "tensorscope"

Layers = tuple[tuple[str, tuple[str, ...], str], ...]

#: bottom first: (name, module prefixes, role). The longest matching prefix decides; the bare
#: package name matches only its ``__init__`` (a new top-level module must be given a layer here).
LAYERS: Layers = (
    ("foundation", ("tensorscope.errors", "tensorscope._version", "tensorscope._common", "tensorscope._location",
                    "tensorscope.schema", "tensorscope.options", "tensorscope.metadata", "tensorscope._tensormeta"),
     "errors, the version, shared tables and formatters, locations, Arrow schemas, options; "
     "_tensormeta.py is pure (shape, stride) arithmetic (no torch) shared by the recorder and the analyses"),
    ("native", ("tensorscope.native",),
     "the C++ hooks and engine behind one facade, with the pure-Python fallback"),
    ("io", ("tensorscope.io",),
     "a trace's tables and metadata to parquet files and back, multi-rank dataset parts; "
     "knows tables, never the Trace class"),
    ("analyses", ("tensorscope.analyses",),
     "pure functions Table -> Table (analyses/sql.py: DuckDB over in-memory tables)"),
    ("render", ("tensorscope.render",),
     "draws tables and results as text, HTML, SVG, Perfetto JSON, matplotlib figures; "
     "takes its input as arguments and imports no data producer"),
    ("results", ("tensorscope._trace", "tensorscope._dataset", "tensorscope._env", "tensorscope._peaks",
                 "tensorscope._advice", "tensorscope.repro"),
     "the immutable Trace (and load), an opened multi-rank Dataset, the environment report: data "
     "objects whose displays call render"),
    ("compare", ("tensorscope._diff",),
     "diff(a, b) of two finished traces (in memory or saved)"),
    ("observers", ("tensorscope.tracking", "tensorscope.timing"),
     "what the recording uses to watch a program: storage and leak tracking, CUDA/kernel timing"),
    ("recording", ("tensorscope.recording",),
     "trace(): the session, the engines behind one seam, the context and buffers, the python engine's "
     "modes and the probes, the decoder; builds the Trace, keeps the history"),
    ("api", ("tensorscope.substitution", "tensorscope.prediction", "tensorscope.windows", "tensorscope.divergence"),
     "built on the public trace(): check_substitution, predict, schedule (windowed tracing), diverge (two runs "
     "aligned by their fingerprints; history indices)"),
    ("frontends", ("tensorscope", "tensorscope.__main__", "tensorscope.cli", "tensorscope.magics"),
     "the package facade (lazy re-exports), python -m tensorscope, the CLI, the IPython magics"),
)

#: function-level imports allowed to go up a layer: (importer, imported) -> why
ALLOWED_UP: dict[tuple[str, str], str] = {}

#: (importer prefix, imported prefix) -> why: imports forbidden inside a layer, whatever the layers say
APART: dict[tuple[str, str], str] = {
    ("tensorscope.recording.engines.native", "tensorscope.recording.engines.python"):
        "each engine is one unit: what both need (op facts, FLOPs, the screen's op classes) is "
        "recording/opfacts.py, below both",
}

#: private names still imported across packages: (importer, "module.name") -> what to do. Each is a
#: name to make public in its own module (a rename in a module another change was rewriting meanwhile)
KNOWN_PRIVATE: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One import statement between two tensorscope modules, as the layering check reads it."""

    importer: str          # module that imports
    imported: str          # module imported (a submodule when ``from pkg import submodule``)
    name: Optional[str]    # the name taken (None for ``import x``)
    path: str              # file, relative to the repository root
    line: int
    lazy: bool             # inside a function
    written: str           # the statement as written, one name: "from ..native import _build"
    typing_only: bool = False   # under ``if TYPE_CHECKING:``: never runs

    def where(self) -> str:
        how = " (type checking only)" if self.typing_only else " (in a function)" if self.lazy else ""
        return f"{self.path}:{self.line}: {self.written}{how}"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: pathlib.Path = ROOT, package: str = PACKAGE) -> dict[str, pathlib.Path]:
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def imports(root: pathlib.Path = ROOT, package: str = PACKAGE) -> list[Import]:
    """Every import of a ``package`` module by a ``package`` module, module-level and in functions."""
    mods = modules(root, package)
    out: list[Import] = []
    for mod, path in mods.items():
        out.extend(_imports_in(mod, path, root, mods, package))
    return out


def _imports_in(mod: str, path: pathlib.Path, root: pathlib.Path, mods: dict[str, pathlib.Path],
                package: str) -> list[Import]:
    is_pkg = path.name == "__init__.py"
    rel = str(path.relative_to(root))
    out: list[Import] = []
    todo: list[tuple[ast.AST, bool, bool]] = [(ast.parse(path.read_text(encoding="utf-8"), filename=rel), False,
                                                False)]
    while todo:
        node, lazy, typing_only = todo.pop()
        checked_body = node.body if isinstance(node, ast.If) and _is_type_checking(node.test) else []
        for child in ast.iter_child_nodes(node):
            only = typing_only or any(child is s for s in checked_body)
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name == package or a.name.startswith(package + "."):
                        out.append(Import(mod, a.name, None, rel, child.lineno, lazy, f"import {a.name}", only))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target == package or target.startswith(package + "."):
                    for a in child.names:
                        sub = f"{target}.{a.name}"
                        written = f"from {'.' * child.level}{child.module or ''} import {a.name}"
                        out.append(Import(mod, sub if sub in mods else target, a.name, rel, child.lineno, lazy,
                                          written, only))
            elif isinstance(child, ast.Call):
                dyn = _dynamic_target(child, package)
                if dyn is not None:
                    out.append(Import(mod, dyn if dyn in mods else dyn.rpartition(".")[0], None, rel,
                                      child.lineno, lazy, f"import_module({dyn!r})", only))
            todo.append((child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)), only))
    out.sort(key=lambda i: (i.line, i.imported, i.name or ""))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:`` (its body never runs; an ``else`` does)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _dynamic_target(call: ast.Call, package: str) -> Optional[str]:
    """``importlib.import_module("tensorscope.x")`` / ``__import__("tensorscope.x")`` with a literal
    name: an import all the same (a string must not hide a dependency from the check)."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
            and (arg.value == package or arg.value.startswith(package + ".")):
        return arg.value
    return None


def layer_of(module: str, layers: Layers = LAYERS) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes, _) in enumerate(layers):
        for p in prefixes:
            # the package itself names only its __init__: a new top-level module gets a layer on purpose
            inside = "." in p and module.startswith(p + ".")
            if (module == p or inside) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def _private(imp: Import, package: str) -> Optional[str]:
    """The private part an import reaches into across packages, or None."""
    def pkg_of(m: str) -> str:       # "tensorscope.recording.engines.python.dispatch" -> "tensorscope.recording"; root modules -> root
        parts = m.split(".")
        sub = ".".join(parts[:2])
        return sub if len(parts) >= 2 and sub in _PKG_DIRS else parts[0]

    src, dst = pkg_of(imp.importer), pkg_of(imp.imported)
    if src == dst or dst == package:
        return None   # inside one package, or the root's own private modules
    for part in imp.imported.split(".")[2:]:
        if part.startswith("_") and not part.startswith("__"):
            return imp.imported
    if imp.name and imp.name.startswith("_") and not imp.name.startswith("__") \
            and not imp.imported.endswith("." + imp.name):
        return f"{imp.imported}.{imp.name}"
    return None


_PKG_DIRS: set[str] = set()   # the package directories of the tree being checked


def _cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def violations(root: pathlib.Path = ROOT, package: str = PACKAGE, layers: Layers = LAYERS,
               allowed_up: Optional[dict[tuple[str, str], str]] = None,
               known_private: Optional[dict[tuple[str, str], str]] = None,
               apart: Optional[dict[tuple[str, str], str]] = None) -> list[str]:
    """Every broken rule, one line each naming the import (file:line) that breaks it."""
    allowed_up = ALLOWED_UP if allowed_up is None else allowed_up
    apart = APART if apart is None else apart
    known_private = KNOWN_PRIVATE if known_private is None else known_private
    mods = modules(root, package)
    _PKG_DIRS.clear()
    _PKG_DIRS.update(m for m, p in mods.items() if p.name == "__init__.py")
    names = [n for n, _, _ in layers]
    out: list[str] = []
    for m in mods:
        if layer_of(m, layers) < 0:
            out.append(f"{mods[m].relative_to(root)}: module {m} is in no layer (add it to LAYERS)")
    for name, prefixes, _ in layers:
        for pfx in prefixes:
            parts = pfx.split(".")
            if len(parts) > 2:   # one layer per folder: a package is placed whole, never one of its modules
                out.append(f"LAYERS: {name} names {pfx}, a module inside package {'.'.join(parts[:2])}: "
                           "a folder is one layer (move the module to a package of that layer)")
    imps = imports(root, package)
    kept: list[tuple[str, str]] = []
    for imp in imps:
        a, b = layer_of(imp.importer, layers), layer_of(imp.imported, layers)
        allowed = (imp.importer, imp.imported) in allowed_up
        if b > a and not allowed and a >= 0:
            out.append(f"{imp.where()}: upward import, layer {names[a]} imports layer {names[b]}")
        if not allowed:
            kept.append((imp.importer, imp.imported))
        for (src, dst), why in apart.items():
            if _under(imp.importer, src) and _under(imp.imported, dst):
                out.append(f"{imp.where()}: {src} must not import {dst} ({why})")
        priv = _private(imp, package)
        if priv and (imp.importer, priv) not in known_private:
            out.append(f"{imp.where()}: private {priv} imported from outside its package")
    by_edge: dict[tuple[str, str], Import] = {}
    for imp in imps:
        by_edge.setdefault((imp.importer, imp.imported), imp)
    for comp in _cycles(kept):
        members = set(comp)
        where = [by_edge[e].where() for e in sorted(by_edge) if e[0] in members and e[1] in members
                 and e in set(kept)]
        out.append(f"import cycle between {', '.join(comp)}: " + "; ".join(where))
    return out


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _short(module: str, package: str = PACKAGE) -> str:
    return module[len(package) + 1:] if module.startswith(package + ".") else module


def picture(root: pathlib.Path = ROOT, package: str = PACKAGE, layers: Layers = LAYERS) -> str:
    """The layer diagram, top layer first: modules of each layer and the layers it imports."""
    mods = modules(root, package)
    names = [n for n, _, _ in layers]
    members: dict[int, list[str]] = {}
    for m in mods:
        members.setdefault(layer_of(m, layers), []).append(m)
    uses: dict[int, set[int]] = {}
    ups: dict[int, set[str]] = {}
    for imp in imports(root, package):
        a, b = layer_of(imp.importer, layers), layer_of(imp.imported, layers)
        if b > a:
            ups.setdefault(a, set()).add(f"{_short(imp.importer, package)} -> {_short(imp.imported, package)}")
        elif a != b:
            uses.setdefault(a, set()).add(b)
    width = max(len(n) for n in names)
    pad = " " * (width + 2)
    lines: list[str] = []

    def put(first: str, text: str) -> None:
        lines.extend(textwrap.wrap(text, 108, initial_indent=first, subsequent_indent=pad + "    ",
                                   break_on_hyphens=False, break_long_words=False))

    for i in range(len(layers) - 1, -1, -1):
        name, _, role = layers[i]
        below = ", ".join(names[j] for j in sorted(uses.get(i, ()), reverse=True))
        put(f"{name:<{width}}  ", role)
        put(pad, "modules: " + _group(sorted(members.get(i, [])), package, mods))
        put(pad, "imports: " + (below or "-"))
        if ups.get(i):
            put(pad, "up, on call only (ALLOWED_UP): " + ", ".join(sorted(ups[i])))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _group(mods: Sequence[str], package: str, paths: dict[str, pathlib.Path]) -> str:
    """``io, io.dataset, io.parquet`` -> ``io/{__init__,dataset,parquet}``."""
    groups: dict[str, list[str]] = {}
    order: list[str] = []
    for m in mods:
        s = _short(m, package)
        head, _, tail = s.rpartition(".")
        if m == package:
            head, tail = "", f"{package}/__init__"
        elif paths[m].name == "__init__.py":
            head, tail = s, "__init__"
        if head not in groups:
            groups[head] = []
            order.append(head)
        groups[head].append(tail)
    parts = []
    for head in order:
        tails = groups[head]
        if not head:
            parts.extend(tails)
        elif len(tails) == 1:
            parts.append(f"{head.replace('.', '/')}/{tails[0]}")
        else:
            parts.append(f"{head.replace('.', '/')}/{{{', '.join(tails)}}}")
    return ", ".join(parts)


BEGIN = "<!-- BEGIN layers: generated by `python tools/architecture.py --write`; do not edit -->"
END = "<!-- END layers -->"


def docs_block(text: str) -> Optional[str]:
    """The generated picture inside docs/development/architecture.md (between the markers), or None."""
    if BEGIN not in text or END not in text:
        return None
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return body.strip("\n").removeprefix("```").removesuffix("```").strip("\n") + "\n"


def write_docs(path: pathlib.Path, pic: str) -> bool:
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN!r} … {END!r} markers to write between")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    new = f"{head}{BEGIN}\n```\n{pic}```\n{END}{tail}"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 and name every offending import")
    p.add_argument("--write", action="store_true", help="regenerate the picture in docs/development/architecture.md")
    p.add_argument("--edges", action="store_true", help="list every import between layers")
    a = p.parse_args(argv)
    if a.check:
        bad = violations()
        print("\n".join(bad) if bad else "layering ok")
        return 1 if bad else 0
    if a.edges:
        names = [n for n, _, _ in LAYERS]
        for imp in imports():
            la, lb = layer_of(imp.importer), layer_of(imp.imported)
            if la != lb:
                print(f"{names[la]:>10} -> {names[lb]:<10} {imp.where()}")
        return 0
    pic = picture()
    if a.write:
        changed = write_docs(ROOT / "docs" / "development" / "architecture.md", pic)
        print("docs/development/architecture.md " + ("updated" if changed else "already up to date"))
        return 0
    sys.stdout.write(pic)
    return 0


if __name__ == "__main__":
    sys.exit(main())
