"""The leak finder's bulk paths give the same report as the per-tensor paths.

A notebook with 100k tensors is searched and described in C-level passes (big containers
enqueued at once, runs of plain tensors visited together, rows built column by column).
Each case here builds a namespace full of the shapes those passes must not get wrong (views,
duplicates, tensors sharing a buffer, tensors with graphs, ``.grad``, a ``__dict__``, pairs
and dicts of tensors, zero-size and meta tensors) and compares the report with the bulk
paths on against the report with them switched off.
"""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import tensorscope.tracking.leaks as L
from tensorscope.tracking.leaks import bulk as B
from tensorscope.tracking.leaks import growth
from tensorscope.tracking.leaks import search as SE
from tensorscope.tracking.storages import LiveStorage

_NOTEBOOK = """
import torch, numpy as np
torch.manual_seed(0)
big = torch.zeros(5000)
arr = np.zeros(300, dtype=np.float32)
tensors = [torch.full((4,), float(i)) for i in range(200)]
tensors[3] = torch.zeros(5000)[:10]                     # a small view pins a big storage
tensors[4] = tensors[5]                     # one tensor listed twice
tensors[6] = tensors[7].view(2, 2)          # two tensors, one storage
tensors[8] = torch.from_numpy(arr)          # two storages over one numpy buffer
tensors[9] = torch.from_numpy(arr)
w = torch.ones(4, requires_grad=True)
w.grad = torch.full((4,), 7.0)
tensors[10] = w                             # a leaf with .grad
tensors[11] = (w * 2).sum()                 # a graph
tensors[12] = torch.zeros(0)                # nothing to leak
tensors[13] = torch.empty(4, device="meta")  # nothing to leak
tensors[14] = torch.zeros(6)
tensors[14].note = torch.zeros(7)           # a tensor attribute
tensors[15] = torch.zeros(8).as_strided((2,), (1,), 3)
also = tensors[20]                          # a second global holder
pairs = [(torch.full((3,), float(i)), torch.tensor(i)) for i in range(120)]
pairs[1] = (pairs[0][0], torch.zeros(2))    # one tensor in two pairs
named = {f"k{i}": torch.full((5,), float(i)) for i in range(40)}
records = [{"x": torch.zeros(9), "y": torch.ones(1)} for _ in range(30)]
small = [torch.zeros(11) for _ in range(5)]
arrays = [np.zeros(3, dtype=np.float32) for _ in range(100)]   # untracked children worth a look
wrapped = [(a, torch.from_numpy(a), i) for i, a in enumerate(arrays)]
"""


def _notebook() -> dict:
    ns = {"__name__": "__main__"}
    exec(_NOTEBOOK, ns)
    return ns


def _no_bulk(monkeypatch):
    for name in ("BULK", "RUN", "TENSOR_RUN"):
        monkeypatch.setattr(SE._Search, name, 10 ** 12)
    monkeypatch.setattr(B, "_bulk_rows", lambda *a, **k: False)
    monkeypatch.setattr(B, "_bulk_nested", lambda *a, **k: False)


def _canon(table):
    rows = table.to_pylist()
    return sorted(rows, key=lambda r: (r["holder"], r["nbytes"], r["fix"], r["storage_id"] or 0))


def _mine(rows):
    return [r for r in rows if r["holder_kind"] not in ("hidden_cpp_owner", "cycle", "unknown", "local")]


def _groups(rep):
    return sorted((g.holder, g.holder_kind, g.fix, g.n_storages, g.nbytes, g.by_device) for g in rep.groups)


def test_find_leaks_bulk_and_per_tensor_paths_agree(monkeypatch):
    ns = _notebook()
    fast = L.find_leaks(user_ns=ns, frames=False)
    with monkeypatch.context() as m:
        _no_bulk(m)
        slow = L.find_leaks(user_ns=ns, frames=False)
    assert _canon(fast.table) == _canon(slow.table)
    assert _groups(fast) == _groups(slow)
    assert fast.totals == slow.totals
    mine = {r["holder"]: r for r in _mine(fast.table.to_pylist())}
    # the bulk path was taken and named what it must
    assert mine["global tensors[0]"]["fix"] == "del tensors[0]"
    assert mine["global tensors[0]"]["shape"] == [4]
    assert mine["global pairs[7][0]"]["fix"] == "del pairs[7][0]"
    assert mine["global named['k3']"]["shape"] == [5]
    assert mine["global records[2]['x']"]["nbytes"] == 36
    view = next(r for h, r in mine.items() if h.startswith("global tensors[3]"))
    assert "clone()" in view["fix"] and view["nbytes"] == 20000


def test_find_leaks_bulk_path_is_used(monkeypatch):
    """The equality above would hold trivially if nothing took the bulk path."""
    ns = _notebook()
    calls = {"rows": 0, "nested": 0, "tensors": 0}
    for mod, name, key in ((B, "_bulk_rows", "rows"), (B, "_bulk_nested", "nested")):
        orig = getattr(mod, name)

        def counted(*a, _orig=orig, _key=key, **k):
            ok = _orig(*a, **k)
            calls[_key] += bool(ok)
            return ok

        monkeypatch.setattr(mod, name, counted)
    orig_tensors = SE._Search._tensors

    def tensors(self, a, b):
        calls["tensors"] += b - a
        return orig_tensors(self, a, b)

    monkeypatch.setattr(SE._Search, "_tensors", tensors)
    for name in ("_enqueue_many", "_enqueue_run"):
        orig_m = getattr(SE._Search, name)

        def counted_m(self, *a, _orig=orig_m, _key=name, **k):
            calls[_key] = calls.get(_key, 0) + 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(SE._Search, name, counted_m)
    L.find_leaks(user_ns=ns, frames=False)
    assert calls["rows"] >= 2 and calls["nested"] >= 2 and calls["tensors"] >= 150
    assert calls["_enqueue_run"] >= 1 and calls["_enqueue_many"] >= 3


def test_leak_table_bulk_and_per_tensor_paths_agree(monkeypatch):
    ns = _notebook()
    recs = []
    for i, t in enumerate(ns["tensors"][16:120]):
        s = t.untyped_storage()
        recs.append(LiveStorage(i, weakref.ref(s), s.data_ptr(), s.nbytes(), "cpu", "float32", tuple(t.shape), i,
                                "aten.full.default", 3, "cell.py", 5))
    del s, t
    growth.reset()   # the same storages seen twice would read as a holder growing
    fast = L.leak_table(recs, user_ns=ns, frames=False)
    growth.reset()
    with monkeypatch.context() as m:
        _no_bulk(m)
        slow = L.leak_table(recs, user_ns=ns, frames=False)
    growth.reset()
    assert fast.num_rows == slow.num_rows == 104
    assert _canon(fast) == _canon(slow)
    row = next(r for r in fast.to_pylist() if r["holder"] == "global tensors[16]")
    assert (row["alloc_op"], row["cell"], row["source_line"], row["fix"]) == ("aten.full.default", 3, 5,
                                                                          "del tensors[16]")


def test_bulk_search_keeps_nothing_alive():
    ns = _notebook()
    refs = [weakref.ref(t.untyped_storage()) for t in ns["tensors"][20:40]]
    L.find_leaks(user_ns=ns, frames=False)
    ns.pop("tensors")
    ns.pop("also")
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("n", [100, 3000])
def test_many_tensors_one_group_with_the_container_fix(n):
    ns = {"__name__": "__main__", "xs": [torch.zeros(2) for _ in range(n)],
          "ys": [(torch.zeros(3), torch.zeros(1)) for _ in range(n)]}
    rep = L.find_leaks(user_ns=ns, frames=False)
    groups = {g.holder: g for g in rep.groups}
    assert (groups["global xs"].n_storages, groups["global xs"].nbytes, groups["global xs"].fix) == (n, 8 * n, "del xs")
    assert (groups["global ys"].n_storages, groups["global ys"].fix) == (2 * n, "del ys")
    holders = set(rep.table.column("holder").to_pylist())
    assert {f"global xs[{n - 1}]", f"global ys[{n - 1}][1]"} <= holders
    assert np.array_equal(np.sort(rep.table.column("nbytes").to_numpy())[::-1], rep.table.column("nbytes").to_numpy())


def test_the_bulk_paths_run_no_torch_function_a_users_mode_could_see():
    """Comparing a list of tensors with ``count``/``in`` runs ``Tensor.__eq__``: an op, slow, and seen by
    a user's mode. The bulk paths compare by identity."""
    from torch.overrides import TorchFunctionMode

    class Spy(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    ns = {"__name__": "__main__", "base": torch.zeros(400)}
    ns["views"] = [ns["base"][i * 4:(i + 1) * 4] for i in range(100)]
    ns["ws"] = [torch.zeros(2, requires_grad=True) for _ in range(50)]
    for w in ns["ws"]:
        w.grad = torch.ones(2)
    ns["pairs"] = [(torch.zeros(1), torch.zeros(2)) for _ in range(50)]
    ns["grads"] = [w.grad for w in ns["ws"]]
    with Spy() as spy:
        rep = L.find_leaks(user_ns=ns, frames=False)
    assert [n for n in spy.seen if n in ("__eq__", "__ne__", "__bool__", "eq", "ne")] == []
    holders = set(rep.table.column("holder").to_pylist())
    assert "global pairs[49][1]" in holders and any(h.startswith("global base") for h in holders)


def test_leak_table_of_nothing_alive_is_empty_and_keeps_growth_consistent():
    growth.reset()
    t = torch.zeros(3)
    s = t.untyped_storage()
    rec = LiveStorage(0, weakref.ref(s), s.data_ptr(), s.nbytes(), "cpu", "float32", (3,), 0, "aten.zeros.default",
                      1, "cell.py", 1)
    del s, t
    assert L.leak_table([rec], user_ns={}, frames=False).num_rows == 0
    assert L.leak_table([], user_ns={}, frames=False).num_rows == 0
    assert growth.per_cell("global t") is None
