"""The layer order of docs/development/architecture.md, checked on every import of the package.

The graph is read with ``ast`` by tools/architecture.py (module-level and function-level
imports alike); these tests fail on an upward import, an import cycle or a private name
reached from another package, naming the file, line and statement, and when the picture in
docs/development/architecture.md no longer matches the code.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import textwrap

import pytest

# the repository root, wherever the test tree puts this file
ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "tools" / "architecture.py").is_file())


def _load_tool():
    spec = importlib.util.spec_from_file_location("tensorscope_architecture", ROOT / "tools" / "architecture.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses resolve their module while the class is built
    spec.loader.exec_module(mod)
    return mod


A = _load_tool()


def test_no_upward_import_no_cycle_no_foreign_private_name():
    bad = A.violations()
    assert bad == [], "layering broken (see docs/development/architecture.md, tools/architecture.py):\n" + "\n".join(bad)


def test_docs_picture_is_generated_from_the_code():
    text = (ROOT / "docs" / "development" / "architecture.md").read_text(encoding="utf-8")
    block = A.docs_block(text)
    assert block is not None, "docs/development/architecture.md lost its generated layer picture markers"
    assert block == A.picture(), "docs/development/architecture.md is stale: run `python tools/architecture.py --write`"


def test_every_exception_is_still_needed():
    """An allowance nobody uses any more is removed, so the lists only shrink."""
    imps = A.imports()
    edges = {(i.importer, i.imported) for i in imps}
    for key in A.ALLOWED_UP:
        assert key in edges, f"ALLOWED_UP entry {key} matches no import: remove it"
    private = {(i.importer, A._private(i, A.PACKAGE)) for i in imps}
    for key in A.KNOWN_PRIVATE:
        assert key in private, f"KNOWN_PRIVATE entry {key} matches no import: remove it"


def test_every_module_has_a_layer():
    for m in A.modules():
        assert A.layer_of(m) >= 0, m


def test_a_type_checking_import_counts_like_any_other(tmp_path):
    """``if TYPE_CHECKING:`` never runs, but a type named from above is a dependency of the design all
    the same: it is reported (marked "type checking only"), and so is its ``else``."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/errors.py": "",
        "pkg/_common.py": "",
        "pkg/analyses/__init__.py": """\
            from typing import TYPE_CHECKING
            import typing
            if TYPE_CHECKING:
                from ..render import Drawn
            if typing.TYPE_CHECKING:
                import pkg.render
            else:
                from .. import render
            """,
        "pkg/render/__init__.py": "from ..analyses import x\n",
    })
    imps = [(i.written, i.typing_only) for i in A.imports(tmp_path, "pkg") if i.importer == "pkg.analyses"]
    assert imps == [("from ..render import Drawn", True), ("import pkg.render", True), ("from .. import render", False)]
    bad = A.violations(tmp_path, "pkg", LAYERS, allowed_up={}, known_private={})
    assert bad[0].startswith("pkg/analyses/__init__.py:4: from ..render import Drawn (type checking only): "
                             "upward import")
    assert bad[1].startswith("pkg/analyses/__init__.py:6: import pkg.render (type checking only): upward import")
    assert bad[2].startswith("pkg/analyses/__init__.py:8: from .. import render: upward import")
    assert len(bad) == 4 and bad[3].startswith("import cycle between pkg.analyses, pkg.render:")


def test_the_summary_lists_its_sections_by_import_not_by_side_effect():
    by = {(i.importer, i.imported): i for i in A.imports()}
    for name in ("api", "compiled", "memory", "precision", "timing"):
        imp = by[("tensorscope.render.summary", f"tensorscope.render.sections_{name}")]
        assert not imp.lazy and imp.written == f"from . import sections_{name}"


def test_import_reader_sees_every_form_of_import(tmp_path):
    """The reader the checks rely on: relative and absolute, module level and in functions (lazy),
    ``from pkg import submodule`` (the submodule), a name from a module (the module), a literal
    ``import_module``; other packages' imports are not the graph's."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a/__init__.py": "",
        "pkg/a/sub.py": "X = 1\n",
        "pkg/b.py": """\
            import os
            import pkg.a
            from .a import sub
            from .a.sub import X
            class K:
                from . import a as _a
            def f():
                from .. import anything_outside
                import importlib
                return importlib.import_module("pkg.a.sub"), lambda: __import__("pkg")
            """,
    })
    got = [(i.imported, i.name, i.line, i.lazy, i.written) for i in A.imports(tmp_path, "pkg")]
    assert got == [
        ("pkg.a", None, 2, False, "import pkg.a"),
        ("pkg.a.sub", "sub", 3, False, "from .a import sub"),
        ("pkg.a.sub", "X", 4, False, "from .a.sub import X"),
        ("pkg.a", "a", 6, False, "from . import a"),     # a class body runs at import
        ("pkg", None, 10, True, "import_module('pkg')"),
        ("pkg.a.sub", None, 10, True, "import_module('pkg.a.sub')"),
    ]


def _write(root: pathlib.Path, files: dict) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text), encoding="utf-8")


LAYERS = (("low", ("pkg.errors", "pkg._common"), ""), ("mid", ("pkg.analyses",), ""),
          ("high", ("pkg", "pkg.render"), ""))


def test_checker_names_the_upward_import_the_cycle_and_the_private_name(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/errors.py": """\
            def f():
                from .render import draw   # upward, lazy
            """,
        "pkg/analyses/__init__.py": "",
        "pkg/analyses/a.py": "from . import b\n",
        "pkg/analyses/b.py": """\
            def g():
                from .a import x
            """,
        "pkg/render/__init__.py": "from ..analyses.a import _hidden\ndef draw(): pass\n",
        "pkg/_common.py": "import importlib\ndef h():\n    importlib.import_module('pkg.render')\n",
    })
    bad = A.violations(tmp_path, "pkg", LAYERS, allowed_up={}, known_private={})
    text = "\n".join(bad)
    assert "pkg/errors.py:2: from .render import draw (in a function): upward import, layer low imports layer high" \
        in text
    assert any(v.startswith("import cycle between pkg.analyses.a, pkg.analyses.b") for v in bad)
    assert "pkg/analyses/a.py:1: from . import b" in text and "pkg/analyses/b.py:2: from .a import x" in text
    assert "pkg/render/__init__.py:1: from ..analyses.a import _hidden: private pkg.analyses.a._hidden" in text
    assert "pkg/_common.py:3: import_module('pkg.render') (in a function): upward import" in text
    assert len(bad) == 4, bad


def test_an_allowed_upward_import_is_neither_a_violation_nor_a_cycle(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from . import render\n",
        "pkg/errors.py": "def f():\n    from .render import draw\n",
        "pkg/_common.py": "import pkg.errors\n",
        "pkg/analyses/__init__.py": "from .._common import g\n",
        "pkg/render/__init__.py": "from ..analyses import f\ndef draw(): pass\n",
    })
    bad = A.violations(tmp_path, "pkg", LAYERS, allowed_up={}, known_private={})
    assert bad[0] == "pkg/errors.py:2: from .render import draw (in a function): upward import, layer low imports layer high"
    assert len(bad) == 2 and bad[1].startswith("import cycle between pkg._common, pkg.analyses, pkg.errors, pkg.render")
    assert A.violations(tmp_path, "pkg", LAYERS, allowed_up={("pkg.errors", "pkg.render"): "why"},
                        known_private={}) == []


def test_the_native_engine_never_imports_the_python_engine(tmp_path):
    """APART: two packages of one layer kept apart (what both need lives in a module below them)."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/analyses/__init__.py": "",
        "pkg/analyses/facts.py": "",
        "pkg/analyses/native/__init__.py": "from ..facts import x\ndef f():\n    from ..python.dispatch import y\n",
        "pkg/analyses/python/__init__.py": "from ..native import f\n",
        "pkg/analyses/python/dispatch.py": "",
    })
    apart = {("pkg.analyses.native", "pkg.analyses.python"): "one unit each"}
    bad = A.violations(tmp_path, "pkg", LAYERS, allowed_up={}, known_private={}, apart=apart)
    assert bad == ["pkg/analyses/native/__init__.py:3: from ..python.dispatch import y (in a function): "
                   "pkg.analyses.native must not import pkg.analyses.python (one unit each)"]
    assert ("tensorscope.recording.engines.native", "tensorscope.recording.engines.python") in A.APART


def test_a_new_top_level_module_must_be_given_a_layer(tmp_path):
    """The bare package name places only its __init__: a new module beside it is reported, not
    silently put on top (where every import of it from below would read as a violation)."""
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/errors.py": "", "pkg/stray.py": "", "pkg/sub/__init__.py": ""})
    layers = (("low", ("pkg.errors", "pkg.sub"), ""), ("high", ("pkg",), ""))
    assert A.violations(tmp_path, "pkg", layers, allowed_up={}, known_private={}) == [
        "pkg/stray.py: module pkg.stray is in no layer (add it to LAYERS)"]


@pytest.mark.parametrize("module,layer", [
    ("tensorscope._tensormeta", "foundation"), ("tensorscope.recording.engines.python.dispatch", "recording"),
    ("tensorscope.recording.engines.native", "recording"), ("tensorscope.timing.kernels", "observers"),
    ("tensorscope.analyses.sql", "analyses"), ("tensorscope.io.parquet", "io"), ("tensorscope._dataset", "results"),
    ("tensorscope", "frontends"),
])
def test_longest_prefix_decides_the_layer(module, layer):
    assert A.LAYERS[A.layer_of(module)][0] == layer
