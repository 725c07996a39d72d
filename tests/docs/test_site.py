"""The documentation site builds with warnings as errors, and three built pages render in a real browser.

The site is built once per session (``sphinx -W``: a broken reference, a page in no toctree, a docstring
that does not parse or a walkthrough cell that raises fails it), or the ``make docs`` output is reused
when it is newer than every source it is made from. Three pages are then loaded in headless Chromium
(Debian's ``chromium``; the browser tests skip with the reason without it): the home page, a walkthrough
with its executed summary, and an API page. Each is checked for its content in the rendered DOM, for
local links and images that resolve, and for a screenshot that is not blank. The screenshots are kept
under ``runs/docs/`` (their paths are printed).
"""
from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docs.blocks import DOCS, ROOT_PATH
from tests.helpers import ROOT

pytestmark = pytest.mark.kernel   # the build executes the walkthroughs in real kernels: minutes

BUILT = DOCS / "_build" / "html"
PAGES = {   # name -> (page, texts its rendered DOM must contain)
    "home": ("index.html", ["Every ATen op", "Start here", "What is my memory made of"]),
    "walkthrough": ("walkthroughs/memory.html", ["What is my memory made of", "predicted peak", "activation"]),
    "api": ("api/generated/tensorscope.trace.html", ["Parameters", "Examples", "OptionsError"]),
}
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-extensions", "--host-resolver-rules=MAP * ~NOTFOUND",
                "--proxy-server=127.0.0.1:9", "--virtual-time-budget=10000"]


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


def _sources():
    yield from (p for p in DOCS.rglob("*") if p.is_file() and not any(
        part in ("_build", "_generated", "generated", "jupyter_execute") for part in p.relative_to(DOCS).parts))
    yield from (ROOT_PATH / "tensorscope").rglob("*.py")
    yield ROOT_PATH / "CONTRIBUTING.md"


def _current(out: Path) -> bool:
    index = out / "index.html"
    if not index.exists():
        return False
    built = index.stat().st_mtime
    return all(p.stat().st_mtime <= built for p in _sources())


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if _current(BUILT):
        return BUILT
    out = tmp_path_factory.mktemp("site") / "html"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q", str(DOCS), str(out)],
                       env=env, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert r.returncode == 0, f"the site does not build with -W:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    print(f"\ndocs site built in {time.monotonic() - t0:.0f} s: {out}")
    return out


def test_every_page_of_the_guide_and_walkthroughs_is_built(site):
    for src in list((DOCS / "guide").glob("*.md")) + list((DOCS / "walkthroughs").glob("*.md")):
        page = site / src.relative_to(DOCS).with_suffix(".html")
        assert page.exists(), f"{src.relative_to(ROOT_PATH)} was not built into {page}"
    index = (site / "index.html").read_text(encoding="utf-8")
    for src in (DOCS / "guide").glob("*.md"):   # the glob toctree: every guide page is in the navigation
        assert f'guide/{src.stem}.html' in index, f"guide/{src.stem} is not in the site's navigation"


def test_walkthrough_outputs_are_in_the_pages(site):
    for src in (DOCS / "walkthroughs").glob("*.md"):
        text = (site / "walkthroughs" / f"{src.stem}.html").read_text(encoding="utf-8")
        assert 'class="cell_output' in text, f"{src.stem}: no executed output in the page"
        if "%%tensorscope" in src.read_text(encoding="utf-8"):   # a traced cell displays its summary as HTML
            assert 'class="output text_html"' in text, f"{src.stem}: no HTML summary in the page"
        assert "Traceback (most recent call last)" not in html.unescape(text), f"{src.stem}: a cell raised"


def _local_refs(page: Path, dom: str):
    for m in re.finditer(r'(?:href|src)="([^"#?]+)(?:[#?][^"]*)?"', dom):
        ref = html.unescape(m.group(1))
        if re.match(r"^[a-z][a-z0-9+.-]*:", ref) or ref.startswith("//"):
            if ref.startswith("file://"):
                yield Path(ref[len("file://"):])
            continue
        yield (page.parent / ref).resolve()


@pytest.mark.parametrize("name", list(PAGES))
def test_built_page_renders_in_chromium(site, name, capsys):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; .ci/run does it as root)")
    rel, texts = PAGES[name]
    page = site / rel
    assert page.exists(), f"{rel} was not built"
    r = subprocess.run([chromium, *CHROME_FLAGS, "--window-size=1280,1600", "--dump-dom", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    dom = r.stdout
    assert r.returncode == 0 and "<article" in dom, r.stderr[-2000:]
    article = re.search(r"<article[^>]*>(.*)</article>", dom, re.S).group(1)
    words = re.sub(r"<[^>]+>", " ", article)
    assert len(words.split()) > 80, f"{rel}: the article is nearly empty"
    for want in texts:
        assert want in html.unescape(words), f"{rel}: {want!r} is not on the page"
    if name == "home":   # the navigation bar reaches the guide, the walkthroughs and the API reference
        for target in ("guide/install.html", "walkthroughs/memory.html", "api/index.html"):
            assert f'href="{target}"' in dom, f"the home page's navigation has no link to {target}"
    missing = sorted({str(p) for p in _local_refs(page, dom) if not p.exists()})
    assert missing == [], f"{rel}: links or images that do not resolve: {missing[:10]}"

    out = ROOT_PATH / "runs" / "docs"
    out.mkdir(parents=True, exist_ok=True)
    shot = out / f"{name}.png"
    r = subprocess.run([chromium, *CHROME_FLAGS, "--window-size=1280,1600", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as im:
        raw = im.convert("RGB").resize((320, 400)).tobytes()
        pixels = [raw[i:i + 3] for i in range(0, len(raw), 3)]
    ink = sum(1 for p in pixels if sum(p) < 600) / len(pixels)   # not white
    assert ink > 0.02, f"{shot}: the page is blank ({ink:.1%} of it is not white)"
    assert len(set(pixels)) > 32, f"{shot}: the page is flat ({len(set(pixels))} colours)"
    with capsys.disabled():
        print(f"\ndocs screenshot ({name}): {shot}")
