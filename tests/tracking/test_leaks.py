"""Leak finding in-process: holder paths and kinds, storage edge cases, our own tensor-freedom, memory view.

Each test builds its "notebook" in a fresh namespace dict (``exec`` into it) and searches
that namespace with ``frames=False`` (the test function's own locals are not the
notebook's). Memory being gone is asserted with a weak reference to the storage.
"""
from __future__ import annotations

import ctypes
import gc
import sys
import weakref

import numpy as np
import pyarrow as pa
import pytest
import torch

import tensorscope
import tensorscope.tracking.leaks as L
from tensorscope import schema as S
from tensorscope.analyses.memory import memory_peak, memory_table
from tensorscope.tracking.storages import LiveStorage


def notebook(code: str) -> dict:
    ns = {"torch": torch, "np": np, "__name__": "__main__"}
    exec(code, ns)
    return ns


def report(ns, **kw):
    return L.find_leaks(user_ns=ns, frames=False, **kw)


_STRAY = ("local", "hidden_cpp_owner", "cycle", "unknown")


def rows_of(rep, nbytes=None, kind=None):
    """Rows of this notebook: the process also holds other tensors (pytest's, other tests'), which a
    whole-heap report rightly lists as strays; without an explicit ``kind`` those are left out."""
    rows = rep.table.to_pylist()
    return [r for r in rows if (nbytes is None or r["nbytes"] == nbytes)
            and (r["holder_kind"] == kind if kind is not None else r["holder_kind"] not in _STRAY)]


def mine_total(rep) -> int:
    return sum(r["nbytes"] for r in rows_of(rep))


def one(rep, nbytes, kind=None):
    rs = rows_of(rep, nbytes, kind)
    assert len(rs) == 1, (nbytes, kind, rep.table.select(["nbytes", "holder_kind", "holder"]).to_pylist())
    return rs[0]


def storage_ref(t) -> weakref.ref:
    return weakref.ref(t.untyped_storage())


def apply_fix(ns, fix):
    exec(L.fix_code(fix), ns)


# -- holder kinds ------------------------------------------------------------------------------
def test_global_list_dict_attribute_class_attribute_closure_generator():
    ns = notebook(
        "big = torch.zeros(1000, 250)\n"
        "cache = {'a': [torch.zeros(3000)]}\n"
        "class Box: pass\n"
        "box = Box(); box.t = torch.zeros(2000)\n"
        "class Holder:\n    shared = torch.zeros(1500)\n"
        "def make():\n    v = torch.zeros(1200)\n    def f():\n        return v\n    return f\n"
        "f = make()\n"
        "def gen():\n    g = torch.zeros(1100)\n    yield 1\n"
        "it = gen(); next(it)\n")
    rep = report(ns)
    r = one(rep, 1_000_000)
    assert (r["holder"], r["holder_kind"], r["fix"]) == ("global big", "global", "del big")
    assert r["shape"] == [1000, 250] and r["dtype"] == "float32" and r["device"] == "cpu"
    r = one(rep, 12_000)
    assert r["holder"] == "global cache['a'][0]" and r["fix"] == "del cache['a'][0]"
    assert one(rep, 8000)["holder"] == "global box.t"
    r = one(rep, 6000)
    assert r["holder"] == "global Holder.shared" and r["fix"] == "del Holder.shared"
    r = one(rep, 4800, "closure")
    assert r["holder"] == "global f → closure v" and r["fix"].startswith("del f")
    r = one(rep, 4400)
    assert r["holder"].startswith("global it → local") and r["fix"].startswith("it.close()")
    # each fix, applied, releases exactly that memory
    for nbytes, get in [(1_000_000, lambda: ns["big"]), (12_000, lambda: ns["cache"]["a"][0]),
                        (8000, lambda: ns["box"].t), (6000, lambda: ns["Holder"].shared),
                        (4800, lambda: ns["f"].__closure__[0].cell_contents)]:
        w = storage_ref(get())
        apply_fix(ns, one(rep, nbytes)["fix"])
        assert w() is None, nbytes
    w = weakref.ref(ns["it"].gi_frame.f_locals["g"].untyped_storage()) if sys.version_info >= (3, 13) else None
    apply_fix(ns, one(rep, 4400)["fix"])
    assert ns["it"].gi_frame is None
    assert w is None or w() is None


def test_losses_list_holds_autograd_graphs_and_is_charged_their_bytes():
    ns = notebook(
        "model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))\n"
        "losses = []\n"
        "for step in range(3):\n"
        "    x = torch.randn(128, 64)\n"
        "    loss = model(x).pow(2).mean()\n"
        "    losses.append(loss)\n"
        "del x, loss\n")
    rep = report(ns)
    graph = rows_of(rep, kind="autograd_graph")
    # per step: the hidden activation (saved by addmm as mat1 and by relu as result) and the output
    assert graph and all(r["holder"].startswith("global losses[") for r in graph)
    assert any("→ grad_fn MeanBackward0" in r["holder"] and "saved" in r["holder"] for r in graph)
    act = [r for r in graph if r["nbytes"] == 128 * 256 * 4]
    assert len(act) == 3 and all(r["shape"] == [128, 256] for r in act)
    x_rows = [r for r in graph if r["nbytes"] == 128 * 64 * 4]    # the inputs, kept only as saved mat1
    assert len(x_rows) == 3 and all(r["holder"].endswith("saved mat1") for r in x_rows)
    grp = next(g for g in rep.groups if g.holder_kind == "autograd_graph")
    assert grp.holder == "global losses (autograd graphs)"
    assert grp.nbytes == sum(r["nbytes"] for r in graph)
    assert grp.fix.startswith("losses = [l.item() for l in losses]")
    # parameters belong to the model, not to the graphs that also reach them
    w = one(rep, 64 * 256 * 4)
    assert w["holder"].startswith("global model[0].weight") and w["holder_kind"] == "model_state" and w["expected"]
    refs = [storage_ref(t) for t in _saved_activations(ns["losses"])]
    assert len(refs) >= 3
    apply_fix(ns, grp.fix)
    assert all(r() is None for r in refs)
    assert not rows_of(report(ns), kind="autograd_graph")


def _saved_activations(losses):
    out = []
    for loss in losses:
        todo = [loss.grad_fn]
        while todo:
            n = todo.pop()
            for a in dir(n):
                if a.startswith("_raw_saved_"):
                    v = getattr(n, a)
                    for sv in v if isinstance(v, (list, tuple)) else [v]:
                        d = sv.data if sv is not None else None
                        if d is not None and d.dim() == 2 and d.shape[1] in (64, 256):
                            out.append(sv.data)
            todo.extend(f for f, _ in n.next_functions if f is not None and type(f).__name__ != "AccumulateGrad")
    return out


def test_module_parameters_buffers_grads_and_optimizer_state():
    ns = notebook(
        "model = torch.nn.Linear(100, 50)\n"
        "model.register_buffer('running', torch.zeros(3000))\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "model(torch.randn(8, 100)).sum().backward()\n"
        "opt.step()\n")
    rep = report(ns)
    (w,) = [r for r in rows_of(rep, 20_000) if r["holder"].startswith("global model.weight;")]
    # state, not a leak: never `del model` (issue 29: it was the parameters' first fix)
    assert w["holder_kind"] == "model_state" and w["expected"] and w["fix"] == L.MODEL_STATE_FIX
    g = [r for r in rows_of(rep, 20_000) if r["holder"] == "global model.weight.grad"]
    assert len(g) == 1 and g[0]["holder_kind"] == "model_state" and g[0]["expected"]
    assert g[0]["fix"] == "model.zero_grad(set_to_none=True)"
    b = one(rep, 12_000)
    assert (b["holder"], b["holder_kind"], b["fix"]) == ("global model.running", "model_state", L.MODEL_STATE_FIX)
    st = [r for r in rows_of(rep, kind="optimizer_state")]
    assert st and all(r["expected"] for r in st)
    assert {r["holder"] for r in st if r["nbytes"] == 20_000} == {
        "global opt.state[model.weight]['exp_avg']", "global opt.state[model.weight]['exp_avg_sq']"}
    # optimizer state: advice only (the next step needs it), never `del opt`
    assert all(r["fix"] == L.OPTIMIZER_STATE_FIX.format(opt="opt") for r in st)
    opt_group = next(gr for gr in rep.groups if gr.holder_kind == "optimizer_state")
    assert opt_group.nbytes == sum(r["nbytes"] for r in st) and opt_group.nbytes >= 2 * (20_000 + 200)
    assert L.fix_code(opt_group.fix) == "" and L.fix_code(b["fix"]) == ""
    refs_state = [storage_ref(v) for s in ns["opt"].state.values() for v in s.values()]
    refs_grad = [storage_ref(ns["model"].weight.grad)]
    ref_buf = storage_ref(ns["model"].running)
    apply_fix(ns, g[0]["fix"])
    assert all(r() is None for r in refs_grad)
    # state goes with its owner, as the advice says (the clear() it names frees it once training is over)
    exec("opt.state.clear()", ns)
    assert all(r() is None for r in refs_state)
    exec("del model, opt", ns)
    assert ref_buf() is None


def test_unreachable_cycle_then_gc_collect():
    ns = notebook("class Node:\n    pass\n"
                  "a = Node(); b = Node(); a.peer = b; b.peer = a; a.t = torch.zeros(7777)\n"
                  "w = __import__('weakref').ref(a.t.untyped_storage())\n"
                  "del a, b\n")
    was = gc.isenabled()
    gc.disable()  # keep the cycle alive until the fix runs it
    try:
        rep = report(ns)
        r = one(rep, 4 * 7777, "cycle")
        assert "Node" in r["holder"], r
        assert r["fix"].startswith("import gc; gc.collect()")
        assert ns["w"]() is not None
        apply_fix(ns, r["fix"])
        assert ns["w"]() is None
    finally:
        if was:
            gc.enable()


def test_owner_gc_cannot_see_is_hidden_cpp_owner():
    ns = notebook("t = torch.zeros(5555)\nw = __import__('weakref').ref(t.untyped_storage())\n")
    t = ns.pop("t")
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(t))   # a C-level owner: invisible to gc
    tid = id(t)
    del t
    try:
        rep = report(ns)
        r = one(rep, 4 * 5555, "hidden_cpp_owner")
        assert r["holder"].startswith("no Python path")
    finally:
        obj = ctypes.cast(tid, ctypes.py_object).value
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(obj))
        del obj
    assert ns["w"]() is None


def test_storage_owned_only_by_cpp_no_python_tensor():
    # a saved output whose graph no Python object reaches: keep only its storage's weak reference
    x = torch.randn(3000, requires_grad=True)
    y = x.exp()
    node = y.grad_fn
    s = y.untyped_storage()
    rec = _live(s, y)
    del y
    keep = [node]  # the node is reachable from nowhere the search looks (this test's frame is skipped)
    tab = L.leak_table([rec], user_ns={}, frames=False)
    (r,) = tab.to_pylist()
    assert r["holder_kind"] in ("hidden_cpp_owner", "local")
    keep.clear()
    del node, s


# -- IPython roots (in-process shell) ----------------------------------------------------------
@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    yield sh
    sh.run_cell("%reset -f", store_history=False)


def test_out_cache_and_last_traceback_in_a_shell(shell):
    shell.run_cell("import torch", store_history=True)
    n = shell.run_cell("torch.zeros(1000, 100)", store_history=True).execution_count
    shell.run_cell("def boom():\n    big = torch.ones(300, 100)\n    raise ValueError('x')\n", store_history=True)
    shell.run_cell("boom()", store_history=True)
    rep = L.find_leaks(shell=shell, frames=False)
    r = one(rep, 400_000)
    assert r["holder_kind"] == "out_cache" and r["holder"].startswith(f"Out[{n}]")
    assert "%reset -f out" in r["fix"]
    t = one(rep, 120_000)
    assert t["holder_kind"] == "traceback"
    assert t["holder"].startswith("sys.last_traceback → boom()") and "→ local big" in t["holder"]
    assert t["fix"].startswith("import sys; import gc; sys.last_traceback = None")
    assert t["fix"].endswith("gc.collect()")
    w_out = storage_ref(shell.user_ns["Out"][n])
    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    w_tb = weakref.ref(tb.tb_frame.f_locals["big"].untyped_storage())
    del tb
    for line in L.fix_code(r["fix"]).splitlines():
        shell.run_cell(line, store_history=True)
    assert w_out() is None
    for line in L.fix_code(t["fix"]).splitlines():
        shell.run_cell(line, store_history=True)
    shell.run_cell("pass", store_history=True)   # last_execution_result moves on
    assert w_tb() is None


# -- storage edge cases ------------------------------------------------------------------------
def test_views_share_one_storage_and_count_once():
    ns = notebook("a = torch.zeros(1000)\nb = a[10:600]\nc = a.view(10, 100)\n")
    rep = report(ns)
    r = one(rep, 4000)
    assert r["holder"].startswith("global a; also") and "global b" in r["holder"] and "global c" in r["holder"]
    assert mine_total(rep) == 4000
    w = storage_ref(ns["a"])
    apply_fix(ns, r["fix"])   # del a; del b; del c
    assert w() is None


def test_small_slice_pinning_a_big_storage():
    ns = notebook("head = torch.zeros(1_000_000)[:10]\n")
    r = one(report(ns), 4_000_000)
    assert r["holder"] == "global head" and r["shape"] == [10]
    assert r["fix"].startswith("head = head.clone()") and "pins the whole" in r["fix"]
    w = storage_ref(ns["head"])
    apply_fix(ns, r["fix"])
    assert w() is None and ns["head"].untyped_storage().nbytes() == 40


def test_two_tensors_over_one_numpy_buffer_and_numpy_over_a_tensor():
    ns = notebook("arr = np.zeros(1000)\nt1 = torch.from_numpy(arr)\nt2 = torch.from_numpy(arr)\n"
                  "n = torch.ones(300).numpy()\n")
    rep = report(ns)
    r = one(rep, 8000)
    assert r["holder"].startswith("global t1") and "global t2" in r["holder"]
    assert one(rep, 1200)["holder"] == "global n.base"
    assert mine_total(rep) == 8000 + 1200
    both = [r for r in rep.table.to_pylist() if r["holder"].startswith("global t1")]
    assert len(both) == 1      # one buffer, one row, its bytes once


def test_grad_saved_input_and_saved_output():
    ns = notebook(
        "w = torch.zeros(1000, requires_grad=True)\n(w * 2).sum().backward()\n"
        "x = torch.randn(2000, requires_grad=True)\nout = x.exp().sum()\n"       # exp saves its output
        "h = torch.randn(3000)\nz = (x[:3000 - 1000] * h[:2000]).sum()\ndel h\n")  # mul saves h's view
    rep = report(ns)
    (g,) = [r for r in rows_of(rep, 4000) if r["holder"] == "global w.grad"]
    assert (g["holder_kind"], g["fix"]) == ("global", "w.grad = None")
    so = one(rep, 8000, "autograd_graph")
    assert so["holder"] == "global out → grad_fn SumBackward0 → ExpBackward0 → saved result"
    si = one(rep, 12_000, "autograd_graph")
    assert si["holder"].startswith("global z → grad_fn SumBackward0 → MulBackward0 → saved other")
    ws = [storage_ref(ns["w"].grad)]
    apply_fix(ns, g["fix"])
    assert ws[0]() is None
    ref_saved = weakref.ref(ns["out"].grad_fn.next_functions[0][0]._raw_saved_result.data.untyped_storage())
    apply_fix(ns, so["fix"])     # out = out.detach()
    assert ref_saved() is None


def test_meta_sparse_nested_and_subclass_tensors_never_crash():
    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, elem):
            return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

        def __init__(self, elem):
            self.elem = elem

        def __tensor_flatten__(self):
            return ["elem"], None

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    ns = notebook("m = torch.empty(10**9, device='meta')\n"
                  "sp = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2]]), torch.ones(3), (2000,))\n"
                  "csr = torch.eye(50).to_sparse_csr()\n"
                  "import warnings\nwith warnings.catch_warnings():\n    warnings.simplefilter('ignore')\n"
                  "    njt = torch.nested.nested_tensor([torch.zeros(2, 8), torch.zeros(3, 8)], layout=torch.jagged)\n")
    ns["wr"] = Wrapper(torch.zeros(777))
    rep = report(ns)
    holders = {r["holder"]: r for r in rep.table.to_pylist()}
    assert not any(h.startswith("global m") and not h.startswith("global model") for h in holders)  # meta: skipped
    assert holders["global sp._values()"]["nbytes"] == 12
    assert holders["global sp._indices()"]["nbytes"] == 24
    assert holders["global csr.values()"]["nbytes"] == 200
    assert "global csr.crow_indices()" in holders
    assert holders["global njt._values"]["nbytes"] == 5 * 8 * 4
    assert holders["global wr.elem"]["nbytes"] == 777 * 4


def test_id_and_address_reuse_do_not_inherit_old_records():
    t = torch.zeros(4096)
    s = t.untyped_storage()
    L.remember([_live(s, t, cell=41, alloc_op="aten.zeros.default", line=7)])
    key = id(s)
    assert L._KNOWN[key].cell == 41
    ptr = s.data_ptr()
    del s, t
    assert key not in L._KNOWN                     # the weak reference's callback dropped it
    ns = notebook("u = torch.zeros(4096)\n")       # likely the same address, maybe the same id
    r = one(report(ns), 4096 * 4)
    assert r["cell"] is None and r["alloc_op"] is None
    assert r["holder"] == "global u"
    del ptr


def _live(s, t, cell=None, alloc_op="aten.exp.default", line=None, sid=0):
    return LiveStorage(storage_id=sid, ref=weakref.ref(s), data_ptr=s.data_ptr(), nbytes=s.nbytes(),
                       device=str(t.device), dtype=str(t.dtype).replace("torch.", ""), shape=tuple(t.shape),
                       alloc_seq=3, alloc_op=alloc_op, cell=cell, source_file="cell.py", source_line=line)


def test_every_holder_of_one_storage_is_listed_and_the_fix_releases_all():
    ns = notebook("lin = torch.nn.Linear(64, 512)\nh = lin(torch.randn(256, 64))\nlosses = []\n"
                  "for k in range(3):\n    losses.append(h.pow(2).sum() * k)\n")
    h = ns["h"]
    w = storage_ref(h)
    tab = L.leak_table([_live(h.untyped_storage(), h, sid=0)], user_ns=ns, frames=False)
    del h
    (row,) = tab.to_pylist()
    assert row["holder"].startswith("global h; also global losses"), row["holder"]
    assert row["holder_kind"] == "global" and not row["expected"]
    lines = L.fix_code(row["fix"]).splitlines()
    assert lines[0] == "del h" and len(lines) > 1, row["fix"]
    exec(lines[0], ns)
    assert w() is not None          # the graphs in losses still hold it: `del h` alone frees nothing
    exec("\n".join(lines[1:]), ns)
    assert w() is None, row["fix"]


def test_leak_table_rows_largest_first_with_creation_site_and_dead_refs_skipped():
    ns = notebook("a = torch.zeros(100)\nb = torch.zeros(1000)\n")
    dead = torch.zeros(10)
    recs = [_live(ns["a"].untyped_storage(), ns["a"], cell=5, line=1, sid=0),
            _live(ns["b"].untyped_storage(), ns["b"], cell=5, line=2, sid=1),
            _live(dead.untyped_storage(), dead, sid=2)]
    del dead
    tab = L.leak_table(recs, user_ns=ns, frames=False)
    assert tab.schema == S.LEAKS
    rows = tab.to_pylist()
    assert [r["storage_id"] for r in rows] == [1, 0]
    assert rows[0]["holder"] == "global b" and rows[0]["cell"] == 5 and rows[0]["source_line"] == 2
    assert rows[0]["alloc_op"] == "aten.exp.default" and rows[0]["alloc_seq"] == 3
    # remembered: find_leaks names op/cell/line of trace-seen storages
    r = one(report(ns), 4000)
    assert (r["cell"], r["source_line"], r["alloc_op"]) == (5, 2, "aten.exp.default")
    assert any("line" in s or ":2" in s for g in report(ns).groups for s in g.sources)


def test_min_bytes_device_filters_and_report_rendering():
    ns = notebook("small = torch.zeros(10)\nlarge = torch.zeros(100_000)\nname = '<b>x</b>'\n"
                  "d = {'<script>': torch.zeros(50_000)}\n")
    rep = report(ns, min_bytes=200_000)
    assert [r["holder"] for r in rows_of(rep)] == ["global large", "global d['<script>']"]
    assert all(r["nbytes"] >= 200_000 for r in rep.table.to_pylist())
    assert len(report(ns, device="cuda")) == 0
    assert len(rows_of(report(ns, device="cpu"))) == 3
    bundle = rep._repr_mimebundle_()
    assert "global large" in bundle["text/plain"] and "fix: del large" in bundle["text/plain"]
    assert "&lt;script&gt;" in bundle["text/html"] and "<script>" not in bundle["text/html"]


# -- no leak of our own ------------------------------------------------------------------------
def _reaches_tensor(obj, depth=6) -> bool:
    seen, todo = set(), [(obj, 0)]
    while todo:
        o, d = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, (torch.Tensor, torch.UntypedStorage, weakref.ref)) or type(o).__name__ == "frame":
            return True
        if d < depth:
            todo.extend((k, d + 1) for k in gc.get_referents(o) if not isinstance(k, type))
    return False


def test_report_holds_no_tensor_and_keeps_nothing_alive():
    ns = notebook("x = torch.zeros(25_000)\nlosses = [(torch.ones(3, requires_grad=True) * 2).sum()]\n")
    w = storage_ref(ns["x"])
    rep = report(ns)
    assert len(rows_of(rep)) >= 2
    assert not _reaches_tensor(rep) and not _reaches_tensor(rep.table) and not _reaches_tensor(rep.groups)
    del ns["x"]
    assert w() is None


def test_a_deleted_class_with_a_tensor_attribute_is_not_kept_by_our_caches():
    ns = notebook("class Holder:\n    shared = torch.zeros(3333)\n"
                  "w = __import__('weakref').ref(Holder.shared.untyped_storage())\nh = Holder()\n")
    assert one(report(ns), 3333 * 4)["holder"] == "global Holder.shared"
    d = L.BoundaryDiscovery(shell=None)
    d.pre_run_cell()
    d.post_run_cell(_Res(1))
    del ns["Holder"], ns["h"]
    gc.collect()  # a class is always in a cycle with its own __dict__/__mro__
    assert ns["w"]() is None


def test_a_failing_search_leaves_no_reference_behind(monkeypatch):
    ns = notebook("x = torch.zeros(30_000)\n")
    w = storage_ref(ns["x"])

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(L.report, "_rows_to_table", boom)
    with pytest.raises(RuntimeError):
        report(ns)
    tb = sys.exc_info()[2]
    del ns["x"]
    assert w() is None
    del tb


def test_registry_holds_weak_references_only():
    t = torch.zeros(1234)
    s = t.untyped_storage()
    L.remember([_live(s, t)])
    w = weakref.ref(s)
    del s, t
    assert w() is None


# -- cell-boundary discovery (tracing off) -----------------------------------------------------
class _Res:
    def __init__(self, n):
        self.execution_count = n


def test_boundary_discovery_attributes_cells_and_restores_gc_state():
    d = L.BoundaryDiscovery(shell=None)
    assert gc.get_freeze_count() == 0
    keep = []
    d.pre_run_cell()
    assert gc.get_freeze_count() > 0                     # frozen while the cell runs
    keep.append(torch.zeros(2222))
    x = torch.randn(64, 32, requires_grad=True)
    keep.append((x.exp() * 2).sum())                     # exp's saved output has no Python tensor
    del x
    d.post_run_cell(_Res(12))
    assert gc.get_freeze_count() == 0                    # unfrozen after it
    assert d.last_scanned < 10_000                        # proportional to what the cell made
    e = L._KNOWN[id(keep[0].untyped_storage())]
    assert e.cell == 12 and not e.traced and e.nbytes == 2222 * 4
    saved = keep[1].grad_fn.next_functions[0][0].next_functions[0][0]._raw_saved_result.data
    assert L._KNOWN[id(saved.untyped_storage())].cell == 12
    del saved
    keep.clear()
    d.close()


def test_boundary_discovery_respects_a_user_freeze_and_a_gc_collect_in_the_cell():
    d = L.BoundaryDiscovery(shell=None)
    gc.freeze()
    try:
        n = gc.get_freeze_count()
        d.pre_run_cell()
        # not unfrozen, not re-frozen (a frozen object that dies meanwhile lowers the count a little)
        assert n - 10 <= gc.get_freeze_count() <= n
        d.post_run_cell(_Res(1))
        assert gc.get_freeze_count() >= n - 10            # the user's freeze is not undone
    finally:
        gc.unfreeze()
    # a cycle made before the cell is collected by the user's gc.collect() inside the cell
    class Cyc:
        pass

    a = Cyc()
    a.me = a
    a.t = torch.zeros(999)
    w = weakref.ref(a.t.untyped_storage())
    del a
    d.pre_run_cell()
    gc.collect()
    assert w() is None
    d.post_run_cell(_Res(2))
    assert gc.get_freeze_count() == 0
    d.close()


def test_find_leaks_uses_discovered_cells():
    d = L.BoundaryDiscovery(shell=None)
    ns = {"torch": torch}
    d.pre_run_cell()
    exec("made = torch.zeros(4321)", ns)
    d.post_run_cell(_Res(9))
    r = one(report(ns), 4321 * 4)
    assert r["cell"] == 9 and r["holder"] == "global made"
    d.close()


# -- memory over time ----------------------------------------------------------------------------
def test_memory_table_live_bytes_per_device_and_peak():
    t = pa.Table.from_pylist([
        dict(storage_id=0, nbytes=100, device="cpu", alloc_seq=None, free_seq=2),   # existed before, freed at 2
        dict(storage_id=1, nbytes=10, device="cpu", alloc_seq=0, free_seq=None),
        dict(storage_id=2, nbytes=50, device="cpu", alloc_seq=1, free_seq=1),       # a temporary inside op 1
        dict(storage_id=3, nbytes=7, device="cuda:0", alloc_seq=1, free_seq=3),
    ], schema=S.TENSORS)
    m = memory_table(t, 4)
    assert m.schema == S.MEMORY
    d = m.to_pydict()
    assert d["seq"] == [0, 1, 2, 3] * 2
    assert d["device"] == ["cpu"] * 4 + ["cuda:0"] * 4
    # live while each op runs: a storage freed after op f started counts during f
    assert d["live_bytes"] == [110, 160, 110, 10, 0, 7, 7, 7]
    assert d["delta_bytes"] == [10, 50, -50, -100, 0, 7, 0, 0]
    ops = pa.table({"op": ["a", "b", "c", "d"]})
    p = memory_peak(m, ops, t)
    assert p["cpu"] == {"peak_bytes": 160, "peak_seq": 1, "peak_op": "b", "start_bytes": 100, "end_bytes": 10,
                        "high_water_bytes": 160, "high_water_seq": 1}
    assert p["cuda:0"]["peak_bytes"] == 7 and p["cuda:0"]["peak_seq"] == 1
    assert memory_table(S.empty("tensors"), 5).num_rows == 0 and memory_table(t, 0).num_rows == 0


def test_saved_tensor_hooks_are_never_unpacked_by_the_search():
    calls = []

    def pack(t):
        calls.append("pack")
        return t

    def unpack(t):
        calls.append("unpack")
        return t

    ns = notebook("x = torch.randn(1000, requires_grad=True)\n")
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        ns["out"] = ns["x"].exp().sum()
    calls.clear()
    rep = report(ns)
    assert calls == []
    assert one(rep, 4000, "autograd_graph")["holder"].endswith("saved result")
    d = L.BoundaryDiscovery(shell=None)
    d.pre_run_cell()
    d.post_run_cell(_Res(3))
    assert calls == []


def test_magic_byte_counts():
    from tensorscope.magics.leaks import parse_bytes

    assert parse_bytes("1000") == 1000 and parse_bytes("1e6") == 1_000_000
    assert parse_bytes("10MB") == 10_000_000 and parse_bytes("4 MiB") == 4 << 20 and parse_bytes("2k") == 2000
    with pytest.raises(ValueError):
        parse_bytes("lots")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_storages_are_totalled_per_device_and_filtered():
    ns = notebook("g = torch.zeros(1 << 20, device='cuda')\nc = torch.zeros(1000)\n"
                  "gl = [(torch.ones(256, 256, device='cuda', requires_grad=True) * 2).sum()]\n")
    rep = report(ns)
    r = one(rep, 4 << 20)
    assert (r["holder"], r["device"]) == ("global g", "cuda:0")
    assert rep.totals["cuda:0"] >= 4 << 20 and rep.totals["cpu"] >= 4000
    only = report(ns, device="cuda")
    assert {x["device"] for x in only.table.to_pylist()} == {"cuda:0"}
    assert one(only, 256 * 256 * 4, "autograd_graph")["holder"].startswith("global gl[0] → grad_fn")
    w = storage_ref(ns["g"])
    apply_fix(ns, r["fix"])
    assert w() is None


def test_a_running_functions_locals_are_named_and_reading_them_keeps_nothing_alive():
    import tensorscope

    lin = torch.nn.Linear(8, 8)

    def f():
        x = torch.randn(3000, 8)
        with tensorscope.trace(native=False) as t:
            y = lin(x)
            z = lin(x)
            loss = z.pow(2).sum()       # pow saves z: its graph holds z's storage too
        holders = {r["holder"]: r for r in t.result.leaks.to_pylist()}
        w = storage_ref(y)
        del y               # the leak search read f's locals: no snapshot of them may outlive this del
        return holders, w() is None

    holders, freed = f()
    assert freed
    r = holders["f() local y"]
    assert r["holder_kind"] == "local" and r["fix"] == "del y  (in f(), or return from it)" and not r["expected"]
    assert r["shape"] == [3000, 8]
    both = holders["f() local z; also f() local loss"]
    assert tensorscope.tracking.leaks.fix_code(both["fix"]).splitlines() == ["del z", "del loss"]
    assert not [h for h, r in holders.items() if r["holder_kind"] == "hidden_cpp_owner"], holders


def test_summary_groups_a_containers_graphs_into_one_row_and_keeps_state_to_one_line():
    from tensorscope.render.sections_memory import leaks_section
    from tests.helpers.synthetic import make_trace, table

    def row(holder, kind, nbytes, fix, expected=False, growing=False, per=None):
        return dict(storage_id=0, nbytes=nbytes, device="cpu", holder=holder, holder_kind=kind, fix=fix,
                    source_line=3, expected=expected, growing=growing, growth_bytes_per_cell=per)

    fix = "losses = [l.item() for l in losses]  (append loss.item(), not loss)"
    rows = [row(f"global losses[{i}] → grad_fn MeanBackward0 → saved self", "autograd_graph", 1024, fix)
            for i in range(100)]
    rows += [row(f"global losses[{i}]", "global", 4, f"del losses[{i}]") for i in range(100)]
    rows += [row("global xs[0]", "global", 64, "del xs[0]"), row("global xs[1]", "global", 32, "del xs[1]")]
    rows += [row("global model.weight.grad", "model_state", 1000, "model.zero_grad(set_to_none=True)", True),
             row("global opt.state[model.weight]['momentum_buffer']", "optimizer_state", 1000, "del opt", True)]
    sec = leaks_section(make_trace(leaks=table("leaks", rows)))
    assert sec.title == f"still alive after the cell: {(100 * 1028 + 96) / 1024:.1f} KiB in 202 storages"
    by_holder = {r[2]: r for r in sec.rows}
    g = by_holder["global losses[0..99] → grad_fn … (100 items)"]
    assert g[0] == f"{100 * 1028 / 1024:.1f} KiB" and g[3] == "200" and g[5] == fix
    assert by_holder["global xs[0]"][5] == "del xs[0]" and by_holder["global xs[1]"][5] == "del xs[1]"
    assert sec.notes == ["kept as model/optimizer state: 2.0 KiB in 2 storages"]
    only_state = leaks_section(make_trace(leaks=table("leaks", rows[-2:])))
    assert only_state.title == "still alive after the cell: no leaks" and not only_state.rows


def test_a_live_fake_tensor_makes_the_leak_scans_warn_nothing():
    # torch warns when a FakeTensor's storage is asked for its data pointer: the whole-heap scans
    # must look at the storage's (meta) device first, or the user's program sees a warning it never caused
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        _FAKES.append(torch.randn(3))   # reachable from a global, as a notebook's would be
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            tensorscope.find_leaks()
            with tensorscope.trace() as t:
                kept = torch.randn(4) * 2
    finally:
        _FAKES.clear()
    assert kept.shape == (4,) and t.leaks.num_rows >= 1
    assert not [w for w in ws if "FakeTensor" in str(w.message)], [str(w.message) for w in ws]


_FAKES: list = []
