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
