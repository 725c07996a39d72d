"""Every dotted ``tensorscope.`` name that README.md and docs/ mention exists.

A name is resolved as Python would: the longest importable module prefix, then attributes
(``tensorscope.analyses.nonfinite.nonfinite_verdicts``, ``tensorscope.TraceOptions.changed``). A name
that only resolves through a deprecation path (``tensorscope.RunContext``) counts as missing: the docs cite where a name lives now. Names
inside the generated pages come from the code and are not scanned; the developer notes are.
"""
from __future__ import annotations

import importlib
import re
import warnings

import pytest

from tests.docs.blocks import DOCS, ROOT_PATH

NAME = re.compile(r"(?<![\w./-])tensorscope(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# spellings that are not Python names: files and commands
NOT_NAMES = re.compile(r"\.(py|md|json|html|ipynb|cpp|h|svg|png|parquet)$")


def _pages():
    pages = [ROOT_PATH / "README.md", ROOT_PATH / "CONTRIBUTING.md"]
    for p in sorted(DOCS.rglob("*.md")):
        rel = p.relative_to(DOCS).parts
        if rel[0] in ("_build", "_generated", "jupyter_execute") or rel[:2] == ("api", "generated"):
            continue
        pages.append(p)
    return pages


def mentioned(text: str) -> set[str]:
    return {m.group(0) for m in NAME.finditer(text) if not NOT_NAMES.search(m.group(0))}


def resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)   # a deprecated spelling is a stale one
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except (AttributeError, DeprecationWarning):
                return False
        return True
    return False


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT_PATH)))
def test_every_tensorscope_name_exists(page):
    names = mentioned(page.read_text(encoding="utf-8"))
    missing = sorted(n for n in names if not resolves(n))
    assert missing == [], f"{page.relative_to(ROOT_PATH)} mentions names that do not exist: {missing}"


def test_the_checker_can_fail():
    assert resolves("tensorscope.analyses.nonfinite.nonfinite_verdicts")
    assert resolves("tensorscope.TraceOptions.changed")
    assert not resolves("tensorscope.recording.no_such_module")
    assert not resolves("tensorscope.Trace.no_such_method")
    assert not resolves("tensorscope.RunContext") and resolves("tensorscope.options.RunContext")   # moved
    assert mentioned("see tensorscope/_trace.py, `tensorscope.load(...)` and tensorscope.schema.OPS.") == \
        {"tensorscope.load", "tensorscope.schema.OPS"}
