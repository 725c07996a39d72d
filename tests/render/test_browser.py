"""The summary and the leak report in a real browser: headless Chromium renders an executed notebook.

A notebook (a traced training step that leaves a leak, and ``%tensorscope leaks``) is executed
through nbclient in a real kernel and exported with nbconvert twice: the ``lab`` template (which
carries JupyterLab's own CSS, ``.jp-RenderedHTMLCommon td {text-align: right}``) and the
``classic`` one (the Notebook's ``.rendered_html td``); a third, bare page holds the same outputs
with no stylesheet. Chromium loads each with the network unreachable and a probe script that
writes its findings into the DOM (``--dump-dom``): every cell of our tables computes the alignment
our HTML declares (text left, numbers right) and the same on the three pages, no number wraps
at a narrow width, the inline timeline image loads, the memory timeline draws its stacked
categories with the peak marked, and nothing was fetched. One screenshot of
the JupyterLab-styled page per run is kept under ``runs/browser/`` and its path printed.

Needs Debian's ``chromium`` package (``.ci/run`` installs it when it runs as root) and nbconvert;
skips with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.kernel


CELLS = [
    "%load_ext tensorscope\nimport torch\ntorch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(64, 384), torch.nn.ReLU(), torch.nn.Linear(384, 10))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\nx = torch.randn(256, 64)\nkept = []",
    "%%tensorscope\nopt.zero_grad()\nloss = model(x).pow(2).mean()\nloss.backward()\nopt.step()\n"
    "kept.append(model(x).pow(2).mean())   # a loss with its graph: a leak",
    "%tensorscope leaks --min-bytes 1000",
]

PROBE = r"""
<script>
window.addEventListener('load', function () {
  var NUM = /^[-+\u2212]?\d[\d,._]*(\s?(B|KiB|MiB|GiB|TiB|ns|\u00b5s|us|ms|s|%|x|\/cell|\/step))?$/;
  var out = {tables: 0, cells: 0, numbers: 0, right: 0, aligns: [], misaligned: [], wrapped: [],
             images: [], memory: [], resources: [], external: []};
  document.querySelectorAll('.tensorscope-summary table, .tensorscope-leaks table').forEach(function (tb) {
    out.tables++;
    tb.querySelectorAll('td, th').forEach(function (c) {
      var text = c.textContent.trim();
      var got = getComputedStyle(c).textAlign;
      var want = c.style.textAlign || (c.classList.contains('n') ? 'right' : 'left');   // inline, or our class
      if (got === 'start') got = 'left';
      out.cells++;
      out.aligns.push(got);
      if (got === 'right') out.right++;
      if (got !== want) out.misaligned.push(text.slice(0, 40) + ': ' + got + ' (declared ' + want + ')');
      if (c.tagName === 'TD' && NUM.test(text)) {
        out.numbers++;
        var r = document.createRange();
        r.selectNodeContents(c);
        var tops = {};
        Array.prototype.forEach.call(r.getClientRects(), function (b) { tops[Math.round(b.top)] = 1; });
        if (Object.keys(tops).length > 1) out.wrapped.push(text);
      }
    });
  });
  // the summary's charts are <img> of SVG data URIs: loaded, with a size, nothing to fetch
  document.querySelectorAll('.tensorscope-summary img.ts-img').forEach(function (img) {
    var r = img.getBoundingClientRect();
    out.images.push({complete: img.complete && img.naturalWidth > 0, width: Math.round(r.width),
                     data: /^data:image\/svg\+xml,/.test(img.getAttribute('src'))});
    // the memory timeline, read from the image's own markup: stacked areas, the peak marked, a legend entry per area
    var src = img.getAttribute('src');
    var svg = new DOMParser().parseFromString(decodeURIComponent(src.slice(src.indexOf(',') + 1)), 'image/svg+xml');
    var root = svg.documentElement;
    if (root.getAttribute('class') === 'tensorscope-memory') {
      out.memory.push({areas: root.querySelectorAll('path').length, width: Math.round(r.width),
                       height: Math.round(r.height), peak: !!root.querySelector('line[stroke="#c00"]'),
                       legend: root.querySelectorAll('rect[width="10"]').length,
                       parsed: !root.querySelector('parsererror')});
    }
  });
  performance.getEntriesByType('resource').forEach(function (e) { out.resources.push(e.name); });
  document.querySelectorAll('[src], [href]').forEach(function (el) {
    var u = el.getAttribute('src') || el.getAttribute('href') || '';
    if (/^(https?:)?\/\//i.test(u)) out.external.push(el.tagName + ' ' + u);
  });
  var pre = document.createElement('pre');
  pre.id = 'tensorscope-probe';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        p = shutil.which(name)
        if p:
            return p
    return None


CHROMIUM = _chromium()

# the network is unreachable for the browser: a fetch cannot succeed, and the probe sees any attempt
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-extensions", "--host-resolver-rules=MAP * ~NOTFOUND",
                "--proxy-server=127.0.0.1:9", "--virtual-time-budget=10000"]


def _chrome(args, timeout=120):
    r = subprocess.run([CHROMIUM, *CHROME_FLAGS, *args], capture_output=True, text=True, timeout=timeout)
    return r


def _probe(page: str, width: int):
    r = _chrome([f"--window-size={width},2000", "--dump-dom", "file://" + page])
    m = re.search(r'<pre id="tensorscope-probe">(.*?)</pre>', r.stdout, re.S)
    assert m, f"the probe did not run in {page}: rc={r.returncode} {r.stderr[-2000:]}"
    import html

    return json.loads(html.unescape(m.group(1)))


def _strip_template_fetches(page: str) -> str:
    """nbconvert's templates load require.js, MathJax and mermaid from a CDN: theirs, not ours (our
    outputs hold no script, which the fixture checks). Drop those so the probe's 'nothing fetched'
    speaks for the notebook's outputs."""
    page = re.sub(r"<script[^>]*\bsrc=[\"']https?://[^>]*>\s*</script>", "", page, flags=re.I)
    page = re.sub(r"<script[^>]*>(?:(?!</script>).)*https?://(?:(?!</script>).)*</script>", "", page, flags=re.I | re.S)
    return re.sub(r"<link[^>]*\bhref=[\"']https?://[^>]*>", "", page, flags=re.I)


def _with_probe(page: str) -> str:
    i = page.rfind("</body>")
    return page[:i] + PROBE + page[i:]


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; .ci/run does it as root)")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nbconvert = pytest.importorskip("nbconvert", reason="nbconvert is in the test extra")
    out = tmp_path_factory.mktemp("browser")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    env = dict(os.environ, MPLBACKEND="Agg")
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(out)}})
    old = dict(os.environ)
    os.environ.update(env)
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    htmls = [o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", [])
             if o.get("output_type") in ("display_data", "execute_result") and "text/html" in o.get("data", {})]
    assert any("tensorscope-summary" in h for h in htmls) and any("tensorscope-leaks" in h for h in htmls)
    # our HTML itself references nothing outside itself
    for h in htmls:
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", h, re.I), h[:300]
        assert "<script" not in h.lower() and "<link" not in h.lower() and "@import" not in h
    result = {"ipynb": str(out / "executed.ipynb")}
    nbformat.write(nb, result["ipynb"])
    for template in ("lab", "classic"):
        exporter = nbconvert.HTMLExporter(template_name=template)
        body, _res = exporter.from_notebook_node(nb)
        if template == "lab":
            assert ".jp-RenderedHTMLCommon td" in body       # JupyterLab's own CSS is on the page
        else:
            assert ".rendered_html td" in body
        p = out / f"{template}.html"
        p.write_text(_with_probe(_strip_template_fetches(body)), encoding="utf-8")
        result[template] = str(p)
    bare = out / "bare.html"
    bare.write_text(_with_probe("<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>"
                                + "\n".join(htmls) + "</body></html>"), encoding="utf-8")
    result["bare"] = str(bare)
    return result


@pytest.mark.parametrize("width", [1400, 760])
def test_tables_read_the_same_in_jupyterlab_classic_notebook_and_a_bare_page(pages, width):
    probes = {name: _probe(path, width) for name, path in pages.items() if name != "ipynb"}
    for name, p in probes.items():
        assert p["tables"] >= 3 and p["cells"] > 20, (name, p["tables"], p["cells"])
        assert p["misaligned"] == [], (name, p["misaligned"][:10])
        assert p["numbers"] >= 5 and p["right"] >= 5, (name, p["numbers"], p["right"])
        assert p["wrapped"] == [], (name, width, p["wrapped"])
        assert p["images"] and all(i["complete"] and i["width"] > 0 and i["data"] for i in p["images"]), \
            (name, p["images"])
        # the memory timeline drew parameters, gradients, optimizer state, activations ... stacked
        assert len(p["memory"]) == 1 and p["memory"][0]["areas"] >= 4 and p["memory"][0]["peak"], (name, p["memory"])
        assert p["memory"][0]["legend"] == p["memory"][0]["areas"] and p["memory"][0]["height"] > 50, p["memory"]
        assert p["resources"] == [], (name, p["resources"])
        assert p["external"] == [], (name, p["external"])
    assert probes["lab"]["aligns"] == probes["classic"]["aligns"] == probes["bare"]["aligns"]


def test_a_screenshot_of_the_jupyterlab_styled_page_is_kept_per_run(pages, capsys):
    d = os.path.join(ROOT, "runs", "browser")
    os.makedirs(d, exist_ok=True)
    shot = os.path.join(d, f"summary-jupyterlab-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.png")
    r = _chrome(["--window-size=1280,2200", f"--screenshot={shot}", "file://" + pages["lab"]])
    assert r.returncode == 0 and os.path.getsize(shot) > 10_000, r.stderr[-2000:]
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with capsys.disabled():
        print(f"\nbrowser screenshot: {shot}")


# -- the same executed notebook in a real Jupyter server: JupyterLab (trusted, untrusted), Notebook 7, nbclassic --

#: what the page says about our output: the summary, its headline, each chart as a loaded image, no inline SVG
#: (JupyterLab's sanitizer strips one of an untrusted output down to its titles' run-on text), no raw repr
LIVE_PROBE = r"""(function () {
  var s = document.querySelectorAll('.tensorscope-summary');
  if (!s.length) return null;
  var box = s[0];
  var leaks = document.querySelectorAll('.tensorscope-leaks').length;
  var imgs = Array.prototype.slice.call(box.querySelectorAll('img.ts-img'));
  var text = box.innerText;
  var page = document.body.innerText;
  return {summaries: s.length, headline: !!box.querySelector('.ts-head'),
          head_text: (box.querySelector('.ts-head') || {}).innerText || '',
          items: box.querySelectorAll('.ts-headline li').length,
          images: imgs.length,
          loaded: imgs.filter(function (i) { return i.complete && i.naturalWidth > 100 && i.naturalHeight > 30; }).length,
          alts: imgs.map(function (i) { return i.alt; }),
          svg: box.querySelectorAll('svg').length,
          details: box.querySelectorAll('details').length,
          styled: getComputedStyle(box.querySelector('td:not(.n)') || box).textAlign,
          stylesheet: box.querySelectorAll('style').length > 0,
          runon: /ATen op, forward: \d+ marks|live bytes by category after each op/.test(text),
          raw: /<tensorscope\.Trace|pyarrow\.Table|<Figure size/.test(page),
          leaks: leaks};
})()"""

#: (name, url path, signed): the two notebooks differ only in a metadata key, one signed (the server reports its
#: cells trusted). JupyterLab 4.6 still rendered the signed copy's outputs through its sanitizer here (our <style>
#: dropped), nbclassic did not: the assertions hold either way, and the test prints which kept the stylesheet.
LIVE_PAGES = [("jupyterlab-untrusted", "/lab/tree/untrusted.ipynb", False),
              ("jupyterlab-signed", "/lab/tree/trusted.ipynb", True),
              ("notebook7-untrusted", "/notebooks/untrusted.ipynb", False),
              ("nbclassic-untrusted", "/nbclassic/notebooks/untrusted.ipynb", False),
              ("nbclassic-trusted", "/nbclassic/notebooks/trusted.ipynb", True)]


@pytest.fixture(scope="module")
def served(pages, tmp_path_factory):
    """A Jupyter server on 127.0.0.1 holding the executed notebook twice: unsigned (untrusted) and signed."""
    pytest.importorskip("jupyterlab", reason="jupyterlab is in the test extra")
    import signal
    import sys

    import nbformat
    from nbformat.sign import NotebookNotary

    from tests.render._cdp import free_port, wait_http

    root = tmp_path_factory.mktemp("served")
    data = root / "data"
    data.mkdir()
    nb = nbformat.read(pages["ipynb"], as_version=4)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / "untrusted.ipynb"))
    nb.metadata["tensorscope_copy"] = "signed"    # another digest: signing it trusts only this copy
    NotebookNotary(data_dir=str(data)).sign(nb)
    nbformat.write(nb, str(root / "trusted.ipynb"))
    port = free_port()
    env = dict(os.environ, JUPYTER_DATA_DIR=str(data), JUPYTER_CONFIG_DIR=str(root / "config"),
               JUPYTER_RUNTIME_DIR=str(root / "runtime"))
    log = open(root / "server.log", "w")
    srv = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}",
                            "--ip=127.0.0.1", "--ServerApp.port_retries=0", "--IdentityProvider.token=ts",
                            f"--ServerApp.root_dir={root}", "--ServerApp.terminals_enabled=False"],
                           env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/status?token=ts", 90)
        # the server's own verdict on each copy (cells' "trusted" as the contents API returns them)
        trust = {}
        for name in ("untrusted", "trusted"):
            model = json.loads(wait_http(f"http://127.0.0.1:{port}/api/contents/{name}.ipynb?token=ts", 30))
            trust[name] = {c["metadata"].get("trusted") for c in model["content"]["cells"] if c["cell_type"] == "code"}
        assert trust == {"untrusted": {False}, "trusted": {True}}, trust
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(srv.pid, signal.SIGKILL)
        log.close()


def test_the_summary_renders_in_jupyterlab_trusted_and_untrusted_and_the_notebooks(served, capsys):
    from tests.render._cdp import Browser

    shots = os.path.join(ROOT, "runs", "browser")
    os.makedirs(shots, exist_ok=True)
    stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
    b = Browser(CHROMIUM)
    seen = {}
    try:
        for name, path, _trusted in LIVE_PAGES:
            b.goto(f"{served}{path}?token=ts")
            p = b.wait_for(LIVE_PROBE, 90)
            assert p, f"{name}: no tensorscope summary rendered within 90 s"
            # every chart: the images have loaded (a few rows of layout later) and drawn at their size
            p = b.wait_for(f"(function(){{var p={LIVE_PROBE}; return p && p.loaded === p.images && p.leaks ? p : null;}})()",
                           30) or p
            seen[name] = p
            # the screenshot shows every section open (they start collapsed)
            b.evaluate("document.querySelectorAll('.tensorscope-summary details').forEach(function (d) { d.open = true; })")
            time.sleep(0.5)
            shot = b.screenshot(os.path.join(shots, f"summary-{name}-{stamp}.png"))
            with capsys.disabled():
                print(f"\n{name}: {shot} (our <style> kept: {p['stylesheet']}, text cells {p['styled']})")
    finally:
        b.close()
    for name, p in seen.items():
        assert p["summaries"] == 1 and p["headline"] and p["items"] >= 1, (name, p)
        assert p["head_text"].startswith("tensorscope trace of cell [2]"), (name, p["head_text"])
        # timeline, memory, the advisor's roofline: three images, all loaded; no inline SVG, no run-on titles
        assert p["images"] == 3 and p["loaded"] == 3 and p["svg"] == 0 and not p["runon"], (name, p)
        assert p["details"] >= 8 and not p["raw"] and p["leaks"] == 1, (name, p)
    # text cells read left-aligned everywhere (Jupyter's own table style right-aligns every cell; the inline
    # text-align survives the sanitizer, which drops the <style> element of an untrusted output)
    assert all(p["styled"] == "left" for p in seen.values()), {k: p["styled"] for k, p in seen.items()}
    assert seen["nbclassic-trusted"]["stylesheet"] and not seen["nbclassic-untrusted"]["stylesheet"]
