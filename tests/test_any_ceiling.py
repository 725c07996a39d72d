"""``Any`` in the strict zone (tensorscope/recording/) is a number that may only go down.

tools/count_any.py counts it; tools/any_ceiling.txt holds the ceiling. A change that adds ``Any``
fails here; one that removes some lowers the ceiling (the test prints the count either way).
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "tools" / "count_any.py").is_file())


def _load_tool():
    spec = importlib.util.spec_from_file_location("tensorscope_count_any", ROOT / "tools" / "count_any.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


C = _load_tool()


def test_any_in_recording_stays_under_its_ceiling(capsys):
    per = C.counts()
    total = sum(per.values())
    limit = C.ceiling()
    with capsys.disabled():
        print(f"\nAny in tensorscope/recording: {total} (ceiling {limit})")
    worst = sorted(per.items(), key=lambda kv: -kv[1])[:5]
    assert total <= limit, (f"{total} Any in tensorscope/recording/, over the ceiling {limit} "
                            f"(tools/any_ceiling.txt may only go down); most in {worst}")


def test_the_count_reads_annotations_casts_and_strings_not_imports_or_prose():
    src = '''
from typing import Any, Optional
import typing
x: Any = 1
def f(a: "Optional[Any]", b: typing.Any) -> dict[str, Any]:
    """Any prose that mentions Any is no use of it."""
    return cast("list[Any]", a)
'''
    assert C.count_in_source(src) == 5
    assert C.count_in_source("from typing import Any\n") == 0


def test_the_zone_is_counted_file_by_file():
    per = C.counts()
    assert any(p.endswith("recording/context.py") for p in per)
    assert all(p.startswith("tensorscope/recording/") for p in per)
    assert sum(per.values()) > 0
