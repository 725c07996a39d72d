"""%tensorscope diverge A B in a real ipykernel, through jupyter_client: two traced cells recorded
with --fingerprints, compared by variable and by history index; bad names are usage errors."""
from __future__ import annotations

import pytest

from tests.helpers.kernel_utils import Kernel

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    kern = Kernel(cwd=str(tmp_path_factory.mktemp("kernel")))
    r = kern.run("%load_ext tensorscope\nimport torch, tensorscope\ntorch.manual_seed(0)\nx = torch.randn(4, 4)")
    assert r.status == "ok", r.error
    yield kern
    kern.close()


def test_diverge_magic(k):
    r = k.run("%%tensorscope --fingerprints -o a\ny = (x @ x).relu()")
    assert r.status == "ok", r.error
    r = k.run("%%tensorscope --fingerprints -o b\ny = (x @ x * 1.01).relu()")
    assert r.status == "ok", r.error
    r = k.run("%tensorscope diverge a b")
    assert r.status == "ok", r.error
    html = r.html() or "".join(d.get("text/html", "") for d in r.results)
    text = "".join(d.get("text/plain", "") for d in r.results)
    # the mul run b added is structure; the relu after it is where the values part
    assert "first divergence: aten.relu.default" in text, text
    assert "aten.mul.Tensor" in text and "extra" in text
    assert "tensorscope-diverge" in html
    r = k.run("d = _\nd.first['op'], d.first['cause']")
    assert r.status == "ok", r.error
    assert r.text() == "('aten.relu.default', 'structural')"
    r = k.run("%tensorscope diverge -2 -1 --rtol 0.5")
    assert r.status == "ok", r.error
    assert "no divergence" in "".join(d.get("text/plain", "") for d in r.results)


def test_diverge_magic_bad_input(k):
    r = k.run("%tensorscope diverge a nothere")
    assert r.status == "error" and "is not a variable" in (r.error.get("evalue") or "") + r.stdout
    r = k.run("%%tensorscope -o plain\ny = x + 1")
    assert r.status == "ok", r.error
    r = k.run("%tensorscope diverge a plain")
    assert r.status == "error"
    assert "fingerprints=True" in (r.error.get("evalue") or "") + r.stdout
    r = k.run("%tensorscope diverge a")
    assert r.status == "error" and "usage: %tensorscope diverge" in (r.error.get("evalue") or "") + r.stdout
