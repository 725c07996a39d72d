"""Warnings keep their untraced location and filters, and every one shown while tracing is recorded.

Each case runs the same cell untraced and traced in a real ipykernel (the native hooks, and the
pure-Python fallback forced with TENSORSCOPE_FORCE_FALLBACK=1) and compares what Python showed
(category, message, cell line, through ``warnings.showwarning``) and, traced, ``t.errors``.
"""
from __future__ import annotations

import pytest

from tests.helpers.kernel_utils import Kernel

pytestmark = pytest.mark.kernel

SETUP = """%load_ext tensorscope
import sys, warnings, traceback, torch, tensorscope
import torch.nn.functional as F
shown = []
_cells = {}
def _show(message, category, filename, lineno, file=None, line=None):
    name = _cells.setdefault(filename, f'<cell{len(_cells)}>') if 'ipykernel' in filename or filename.startswith('<') \\
        else filename.rsplit('/', 1)[-1]
    shown.append((category.__name__, str(message).split(' (Triggered')[0][:60], name if name.startswith('<') else name, lineno))
warnings.showwarning = _show
def _recorded():
    return [(r['kind'], r['py_type'], r['message'][:60], r['source_line']) for r in tensorscope.last().errors.to_pylist()]
"""


@pytest.fixture(scope="module", params=["native", "fallback"])
def k(request, tmp_path_factory):
    env = {"TENSORSCOPE_FORCE_FALLBACK": "1" if request.param == "fallback" else "0"}
    kern = Kernel(cwd=str(tmp_path_factory.mktemp("warn")), env=env)
    r = kern.run(SETUP)
    assert r.status == "ok", r.error
    kern.mode = request.param
    yield kern
    kern.close()


def _both(k, body, opts="-q", prelude="warnings.simplefilter('always')"):
    """Run ``body`` untraced then traced (same line numbers); what was shown each time."""
    out = []
    for magic in (f"# %%tensorscope {opts}", f"%%tensorscope {opts}"):
        k.run(f"shown.clear()\nwarnings.resetwarnings()\n{prelude}")
        r = k.run(f"{magic}\n{body}")
        out.append((r, [(c, m, line) for c, m, _f, line in k.value("shown")]))
    (ur, u), (tr, t) = out
    assert (tr.status, (tr.error or {}).get("ename")) == (ur.status, (ur.error or {}).get("ename"))
    assert t == u
    return u, tr


def test_python_warning_inside_torch_points_at_the_users_line(k):
    shown, _ = _both(k, "x = torch.randn(2, 3)\ny = F.softmax(x)\nz = y + 1")
    assert shown == [("UserWarning", "Implicit dimension choice for softmax has been deprecated. C", 3)]
    assert k.value("_recorded()") == [("warning", "UserWarning",
                                       "Implicit dimension choice for softmax has been deprecated. C", 3)]


def test_cpp_warning_of_an_op_points_at_the_users_line_and_is_recorded_once(k):
    body = "a = torch.ones(3)\nout = torch.empty(2)\ntorch.add(a, a, out=out)\nb = a * 2"
    shown, _ = _both(k, body)
    assert len(shown) == 1 and shown[0][0] == "UserWarning" and shown[0][2] == 4
    rec = k.value("_recorded()")
    assert [(r[0], r[3]) for r in rec] == [("warning", 4)]
    assert rec[0][2] == shown[0][1]


def test_users_own_warning_is_recorded_and_shown_unchanged(k):
    shown, _ = _both(k, "x = torch.randn(2)\nwarnings.warn('check the learning rate')\ny = x + 1")
    assert shown == [("UserWarning", "check the learning rate", 3)]
    assert k.value("_recorded()") == [("warning", "UserWarning", "check the learning rate", 3)]


@pytest.mark.parametrize("prelude", [
    "warnings.filterwarnings('ignore', message='Implicit dimension')",
    "warnings.filterwarnings('ignore', category=UserWarning, module='__main__')",
    "warnings.filterwarnings('once')",
    "warnings.filterwarnings('default')",
    "warnings.simplefilter('ignore'); warnings.filterwarnings('always', module='__main__')",
])
def test_filters_behave_as_untraced(k, prelude):
    body = "x = torch.randn(2, 3)\nfor i in range(3):\n    y = F.softmax(x)\nz = F.softmax(x)"
    shown, _ = _both(k, body, prelude=prelude)
    if "ignore', message" in prelude or "module='__main__'" in prelude and "always" not in prelude:
        assert shown == []
    else:
        assert shown, "the filter lets the warning through, traced as untraced"


def test_error_filter_raises_at_the_users_line(k):
    body = "x = torch.randn(2, 3)\ny = F.softmax(x)"
    shown, tr = _both(k, body, prelude="warnings.filterwarnings('error', module='__main__')")
    assert tr.status == "error" and tr.error["ename"] == "UserWarning"
    assert k.value("[f.lineno for f in traceback.extract_tb(sys.last_value.__traceback__) "
                   "if 'IPython' not in f.filename][0]") == 3


def test_getter_cpp_warning_is_shown_at_the_users_line_and_recorded(k):
    # TORCH_WARN_ONCE: once per process, so only the traced run can show it (run first here)
    k.run("shown.clear()\nwarnings.resetwarnings()\nwarnings.simplefilter('always')")
    r = k.run("%%tensorscope -q\nx = torch.randn(2, 3, 4)\ny = x.T\nz = y + 1")
    assert r.status == "ok", r.error
    shown = [(c, line) for c, _m, _f, line in k.value("shown")]
    if k.value("len(shown)") == 0:
        pytest.skip("x.T's TORCH_WARN_ONCE already fired in this kernel")
    assert shown == [("UserWarning", 3)]
    rec = k.value("_recorded()")
    assert [(r[0], r[3]) for r in rec] == [("warning", 3)] and "x.T" in rec[0][2]
    calls = k.value("[(c['name'], c['source_line']) for c in tensorscope.last().calls.to_pylist()]")
    assert ("T", 3) in calls     # .T dispatches a view op: recorded as a call, with its line
