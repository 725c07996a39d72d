"""A traced cell's traceback is the untraced one: same frames, same display, nothing injected.

Each case runs the same cell twice in one real ipykernel, untraced (the magic's line replaced by
the comment tensorscope turns it into) and traced, and compares what IPython displays and what
``traceback`` extracts from ``sys.last_exc`` frame by frame (file, line, function).
"""
from __future__ import annotations

import re

import pytest

from tests.helpers.kernel_utils import Kernel

pytestmark = pytest.mark.kernel

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CELL = re.compile(r"Cell In\[\d+\]")


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    kern = Kernel(cwd=str(tmp_path_factory.mktemp("tb")))
    r = kern.run("%load_ext tensorscope\nimport sys, traceback, torch, tensorscope\n"
                 "import torch.nn.functional as F\n"
                 "def _frames():\n"
                 "    e = sys.last_value\n"
                 "    cells = {}\n"
                 "    out = []\n"
                 "    for f in traceback.extract_tb(e.__traceback__):\n"
                 "        if '/IPython/' in f.filename:\n"
                 "            continue\n"
                 "        name = f.filename if 'site-packages' in f.filename or '/lib/python' in f.filename \\\n"
                 "            else cells.setdefault(f.filename, f'<cell{len(cells)}>')\n"
                 "        out.append((name, f.lineno, f.name, f.line))\n"
                 "    return out\n")
    assert r.status == "ok", r.error
    yield kern
    kern.close()


def _shown(r):
    assert r.status == "error", r.stdout
    return [_CELL.sub("Cell In[N]", _ANSI.sub("", s)) for s in r.error["traceback"]]


def _compare(k, opts, body):
    magic = f"%%tensorscope {opts}".strip()
    untraced = k.run(f"# {magic}\n{body}")
    u_frames = k.value("_frames()")
    traced = k.run(f"{magic}\n{body}")
    t_frames = k.value("_frames()")
    assert (traced.error["ename"], traced.error["evalue"]) == (untraced.error["ename"], untraced.error["evalue"])
    assert t_frames == u_frames
    assert _shown(traced) == _shown(untraced)
    # the trace was recorded, and no mode is left behind
    assert k.value("tensorscope.last().errors.num_rows") >= 1
    assert k.value("__import__('torch').utils._python_dispatch._get_current_dispatch_mode_stack()") == []
    return u_frames, _shown(traced)


def test_c_op_error_near_the_top_of_the_cell(k):
    frames, shown = _compare(k, "-q", "a = torch.randn(3)\nb = a + torch.randn(4)\nc = 1")
    assert frames == [("<cell0>", 3, "<module>", "b = a + torch.randn(4)")]
    text = "\n".join(shown)
    assert "__import__" not in text and "tensorscope.magics" not in text
    assert "# %%tensorscope -q" in text     # the context shows the user's magic line, as written


def test_python_torch_function_error_shows_one_frame_of_it(k):
    frames, shown = _compare(k, "-q", "x = torch.randn(3)\ny = F.softmax(x, dim=5)")
    names = [f[2] for f in frames]
    assert names == ["<module>", "softmax"]   # F.softmax once, at the line that raised
    assert not any(n in "\n".join(shown) for n in ("__torch_function__", "__torch_dispatch__", "handle_torch_function",
                                                     "_compile.py", "eval_frame.py", "_ops.py"))


def test_error_inside_a_function_from_an_earlier_cell(k):
    r = k.run("def helper(v):\n    w = v.view(5)\n    return w")
    assert r.status == "ok"
    _compare(k, "-q", "x = torch.randn(3)\nhelper(x)")


def test_error_in_the_last_expression_and_in_a_tensor_method(k):
    _compare(k, "-q", "x = torch.randn(3)\n1 - x.view(7)")
    _compare(k, "-q", "x = torch.randn(3, requires_grad=True)\n(x * 2).backward()")


def test_error_caught_inside_the_cell_has_no_tracer_frame(k):
    r = k.run("%%tensorscope -q\ntry:\n    torch.randn(3) + torch.randn(4)\nexcept RuntimeError as e:\n"
              "    inner = [(f.name, f.lineno) for f in traceback.extract_tb(e.__traceback__)]\n"
              "    text = ''.join(traceback.format_exception(e))")
    assert r.status == "ok", r.error
    assert k.value("inner") == [("<module>", 3)]
    assert "tensorscope" not in k.value("text")


def test_guard_error_points_at_the_magic(k):
    r = k.run("%%tensorscope -q --max-casts 0\nx = torch.randn(3)\ny = x.double()\ny.sum()")
    assert r.status == "error" and r.error["ename"] == "GuardError"
    frames = k.value("_frames()")
    assert frames == [("<cell0>", 1, "<module>", "# %%tensorscope -q --max-casts 0")]
    text = "\n".join(_shown(r))
    assert "tensorscope/" not in text and "site-packages" not in text


def test_library_trace_cleans_the_traceback_too(k):
    r = k.run("def f():\n    with tensorscope.trace(leaks=False):\n        F.softmax(torch.randn(3), dim=5)\n"
              "try:\n    f()\nexcept IndexError as e:\n    names = [x.name for x in traceback.extract_tb(e.__traceback__)]")
    assert r.status == "ok", r.error
    assert k.value("names") == ["<module>", "f", "softmax"]


def test_a_users_own_exception_handler_is_chained_and_restored(k):
    r = k.run("seen = []\nget_ipython().set_custom_exc((ZeroDivisionError,), "
              "lambda self, et, ev, tb, tb_offset=None: seen.append(len(traceback.extract_tb(tb))))")
    assert r.status == "ok", r.error
    k.run("# %%tensorscope -q\nx = torch.randn(2)\n1 / 0")
    r = k.run("%%tensorscope -q\nx = torch.randn(2)\n1 / 0")
    assert r.status == "error"
    seen = k.value("seen")
    assert len(seen) == 2 and seen[0] == seen[1]   # their handler ran, on the same frames
    assert k.value("repr(get_ipython().custom_exceptions)") == "(<class 'ZeroDivisionError'>,)"
    k.run("get_ipython().set_custom_exc((), None)")


def test_always_on_cells_have_untraced_tracebacks(k):
    body = "x = torch.randn(3)\ny = F.softmax(x, dim=5)"
    untraced = k.run(f"# %%tensorscope -q\n{body}")
    u_frames = k.value("_frames()")
    assert k.run("%tensorscope on --no-leaks").status == "ok"
    try:
        traced = k.run(f"# %%tensorscope -q\n{body}")
        t_frames = k.value("_frames()")
    finally:
        k.run("%tensorscope off")
    assert t_frames == u_frames and _shown(traced) == _shown(untraced)
    assert "IndexError" in k.value("[e for t in tensorscope.history() for e in t.errors.column('py_type').to_pylist()]")


def test_guard_error_of_a_with_block_points_at_the_with_statement():
    import traceback

    import torch

    import tensorscope
    from tensorscope.errors import GuardError

    def f():
        with tensorscope.trace(leaks=False, max_casts=0):
            torch.randn(3).double()

    try:
        f()
    except GuardError as e:
        tb = traceback.extract_tb(e.__traceback__)
    assert [(x.name, x.line) for x in tb][-1] == ("f", "with tensorscope.trace(leaks=False, max_casts=0):")
    assert not any("/tensorscope/" in x.filename for x in tb)


def test_error_inside_a_module_forward(k):
    r = k.run("class Block(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
              "        self.lin = torch.nn.Linear(3, 3)\n    def forward(self, x):\n"
              "        return F.softmax(self.lin(x), dim=4)\nnet = torch.nn.Sequential(Block())")
    assert r.status == "ok", r.error
    frames, _ = _compare(k, "-q", "x = torch.randn(2, 3)\ny = net(x)")
    assert [f[2] for f in frames if not f[0].startswith("/")][:1] == ["<module>"]
    assert [f[2] for f in frames][-2:] == ["forward", "softmax"]
    _compare(k, "-q", "x = torch.randn(2, 4)\ny = net(x)")     # shape error in the C linear, two modules down
