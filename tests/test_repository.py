"""House rules checked on the tree itself."""
from __future__ import annotations

import ast
import os

from tests.helpers import ROOT

_TEST_MODULES = {"tests", "conftest", "kernel_utils", "native_helpers", "synthetic"}


def _imported_roots(path: str):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


def test_benchmarks_import_nothing_from_tests():
    bench = os.path.join(ROOT, "benchmarks")
    bad = {}
    for name in sorted(os.listdir(bench)):
        if name.endswith(".py"):
            path = os.path.join(bench, name)
            hits = [m for m in _imported_roots(path) if m in _TEST_MODULES or m.startswith("test_")]
            with open(path, encoding="utf-8") as f:
                if '"tests"' in f.read():   # a tests/ folder put on sys.path
                    hits.append("tests/ on sys.path")
            if hits:
                bad[name] = hits
    assert not bad, bad


def test_nothing_cites_a_document_the_repository_does_not_hold():
    """Facts the code relies on are written in the repository's own docs; a citation of a
    background document that is not in the tree sends the reader nowhere."""
    needle = "design" + ".md"
    bad = []
    for top in ("tensorscope", "tests", "docs", "benchmarks", "tools", "examples"):
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d not in {"__pycache__", "data"}]
            for name in files:
                if name.endswith((".py", ".cpp", ".h", ".md", ".ipynb")):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        for i, line in enumerate(f, 1):
                            if needle in line:
                                bad.append(f"{os.path.relpath(path, ROOT)}:{i}")
    for name in ("README.md", "Makefile"):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            bad += [f"{name}:{i}" for i, line in enumerate(f, 1) if needle in line]
    assert not bad, bad
