"""The ```python blocks of the documentation's markdown pages, read the way the tests run them.

A block runs unless the line right before its fence is a MyST comment stating why it cannot,
``% skip-test: needs a CUDA device``; a skip without a reason is an error.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tests.helpers import ROOT

ROOT_PATH = Path(ROOT)
DOCS = ROOT_PATH / "docs"
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,}|~{3,})(?P<info>[^`]*)$")
_SKIP = re.compile(r"^\s*%\s*skip-test:(?P<reason>.*)$")


@dataclass
class Block:
    page: Path
    line: int                  # 1-based line of the first code line
    code: str
    skip: Optional[str]        # the stated reason, or None: it runs


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        ticks, info = m.group("ticks"), m.group("info").strip()
        start = i + 1
        j = start
        while j < len(lines) and not (lines[j].strip().startswith(ticks) and lines[j].strip().strip(ticks[0]) == ""):
            j += 1
        if info == "python":
            prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            sm = _SKIP.match(prev)
            skip = sm.group("reason").strip() if sm else None
            code = "\n".join(ln[len(m.group("indent")):] for ln in lines[start:j])
            out.append(Block(page, start + 1, code, skip))
        i = j + 1
    return out


def user_pages() -> list[Path]:
    """README.md and every markdown page of the user guide.

    Not the developer notes (not examples), the walkthroughs (MyST notebooks: the site build executes
    their cells) nor the generated API page.
    """
    pages = [ROOT_PATH / "README.md"]
    for p in sorted(DOCS.rglob("*.md")):
        rel = p.relative_to(DOCS).parts
        if rel[0] in ("_build", "_generated", "development", "jupyter_execute", "walkthroughs", "api") \
                or rel[0].startswith("."):
            continue
        pages.append(p)
    return pages
