"""Every ```python block of README.md and of the user guide runs as written.

Each page's blocks run in order, in one fresh Python process (so a page may build its model in its
first block and use it in the next ones), in an empty working directory, on CPU. A block opts out
only with ``% skip-test: <reason>`` on the line before its fence. New pages under docs/ are picked
up without touching this file.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.docs.blocks import ROOT_PATH, blocks, user_pages
from tests.helpers import ROOT

PAGES = user_pages()
# pages whose blocks run in a couple of seconds stay in the fast tier (-m "not kernel"); the rest
# (torch.compile, a schedule of training steps, datasets) are marked like the kernel tests
FAST = {"README.md", "docs/guide/install.md", "docs/guide/options.md", "docs/guide/usage.md"}

_RUNNER = textwrap.dedent("""
    import json, sys, traceback
    blocks = json.load(open(sys.argv[1], encoding="utf-8"))
    ns = {"__name__": "__main__"}
    for b in blocks:
        print(f"--- block at {b['where']}", flush=True)
        try:
            exec(compile(b["code"], b["where"], "exec"), ns)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED: block at {b['where']}", file=sys.stderr, flush=True)
            sys.exit(1)
""")


def _id(p):
    return str(p.relative_to(ROOT_PATH))


def _params():
    out = []
    for p in PAGES:
        marks = [] if _id(p) in FAST else [pytest.mark.kernel]
        out.append(pytest.param(p, id=_id(p), marks=marks))
    return out


@pytest.mark.parametrize("page", _params())
def test_page_blocks_run_as_written(page, tmp_path):
    found = blocks(page)
    for b in found:
        assert b.skip is None or b.skip, f"{_id(page)}:{b.line}: a skipped block must say why (% skip-test: reason)"
    run = [{"where": f"{_id(page)}:{b.line}", "code": b.code} for b in found if b.skip is None]
    if not run:
        pytest.skip(f"{_id(page)} has no runnable python block")
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(run), encoding="utf-8")
    script = tmp_path / "run_blocks.py"
    script.write_text(_RUNNER, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script), str(spec)], cwd=work, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{_id(page)}: a block failed\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"


def test_readme_is_a_landing_page():
    """At most 150 lines, with its screenshot committed and small, and links into the site that exist."""
    import re

    text = (ROOT_PATH / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT_PATH / target).exists(), f"README links to {target}, which does not exist"
    shot = ROOT_PATH / "docs" / "_static" / "summary.png"
    assert shot.stat().st_size < 200_000


def test_readme_quickstart_is_self_contained_and_short():
    """The README's first python block is the quickstart: it builds its own model and input, under 15 lines."""
    first = next(b for b in blocks(ROOT_PATH / "README.md") if b.skip is None)
    lines = [ln for ln in first.code.splitlines() if ln.strip()]
    assert len(lines) < 15, lines
    assert "import torch" in first.code and "import tensorscope" in first.code


def test_skip_marker_needs_a_reason(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("% skip-test:\n```python\nraise SystemExit(1)\n```\n\n```python\nx = 1\n```\n", encoding="utf-8")
    got = blocks(page)
    assert [b.skip for b in got] == ["", None] and got[1].code == "x = 1" and got[1].line == 7
