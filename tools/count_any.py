"""Count ``Any`` in the typed zone of tensorscope (default: ``tensorscope/recording/``).

    python tools/count_any.py                 # the count, and the ceiling it must stay under
    python tools/count_any.py --by-file       # per file, most first
    python tools/count_any.py --check         # exit 1 when the count exceeds tools/any_ceiling.txt

A use is every ``Any`` the checker reads: the name in an annotation, a cast, an alias or a
``TypeVar`` bound, also inside a string annotation; ``typing.Any`` counts as well; the import of the
name does not. The ceiling (``tools/any_ceiling.txt``) may only go down: lower it when a change
removes some (tests/test_any_ceiling.py fails when the count is above it).

Standard library only; nothing of tensorscope is imported (the count comes from ``ast``).
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from collections.abc import Sequence
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parent.parent
ZONE = ("tensorscope/recording",)
CEILING_FILE = ROOT / "tools" / "any_ceiling.txt"


def count_in_source(text: str, filename: str = "<string>") -> int:
    """``Any`` uses in one module's source."""
    n = 0
    for node in ast.walk(ast.parse(text, filename=filename)):
        name = isinstance(node, ast.Name) and node.id == "Any"
        attr = isinstance(node, ast.Attribute) and node.attr == "Any" and isinstance(node.value, ast.Name) \
            and node.value.id in ("typing", "t")
        if name or attr:
            n += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "Any" in node.value:
            n += _in_string_annotation(node.value)
    return n


def _in_string_annotation(s: str) -> int:
    """``Any`` in a string that parses as a type expression ("Optional[Any]"); 0 for prose."""
    if len(s) > 200 or "\n" in s:
        return 0
    try:
        expr = ast.parse(s, mode="eval")
    except SyntaxError:
        return 0
    return sum(1 for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id == "Any")


def counts(root: pathlib.Path = ROOT, zone: Sequence[str] = ZONE) -> dict[str, int]:
    """``{path relative to root: Any uses}`` for every module of the zone."""
    out: dict[str, int] = {}
    for z in zone:
        for p in sorted((root / z).rglob("*.py")):
            rel = str(p.relative_to(root))
            out[rel] = count_in_source(p.read_text(encoding="utf-8"), rel)
    return out


def ceiling(path: pathlib.Path = CEILING_FILE) -> int:
    """The checked-in ceiling: the first integer on a line that is not a comment."""
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            return int(line)
    raise ValueError(f"{path}: no ceiling")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--by-file", action="store_true", help="the count per file, most first")
    p.add_argument("--check", action="store_true", help="exit 1 when the count exceeds the ceiling")
    p.add_argument("--root", type=pathlib.Path, default=ROOT, help="the repository root to count in")
    a = p.parse_args(argv)
    per = counts(a.root)
    total = sum(per.values())
    if a.by_file:
        for f, n in sorted(per.items(), key=lambda kv: (-kv[1], kv[0])):
            if n:
                print(f"{n:5d}  {f}")
    limit = ceiling()
    print(f"Any in {', '.join(ZONE)}: {total} (ceiling {limit})")
    if a.check and total > limit:
        print(f"over the ceiling by {total - limit}: type the new code (tools/any_ceiling.txt may only go down)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
