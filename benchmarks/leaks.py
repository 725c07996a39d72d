"""Leak-report cost: the end-of-trace leak step in a notebook, find_leaks on a ~300k-object heap, with 100k
live tensors, with 1M extra objects, and the per-cell cost of always-on cell-boundary discovery (tracing off).

Run: ``.venv/bin/python benchmarks/leaks.py [trace|magic|find|all]`` (``trace``: only the end-of-trace
step; ``magic``: only ``%tensorscope leaks`` with 100k live tensors in an IPython shell; ``find``: the
rest). Prints best-of-N wall times (and CPU times for the magic). A reference loop
(1M dict stores) is timed alongside, so numbers from a loaded or slow machine can be scaled.

The end-of-trace step is measured in an in-process IPython shell (``%%tensorscope`` cells) with a
model and its optimizer live and a big library emulated: transformers and timm are not installed
here, so ``biglib`` stands in for them (300k objects of module state, 20k functions, 5k classes, in
``sys.modules``, which is what makes a notebook's heap big); the leak step alone is timed by wrapping
``leak_table``.
"""
from __future__ import annotations

import gc
import sys
import time

import pyarrow as pa
import torch

import tensorscope.tracking.leaks as L

pa.array([1])  # pyarrow imports pandas on its first conversion (~0.5 s): not ours to time


def reference() -> float:
    t0 = time.perf_counter()
    d = {}
    for i in range(1_000_000):
        d[i] = i
    return time.perf_counter() - t0


def best(fn, n=3):
    out = None
    b = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        b = min(b, time.perf_counter() - t0)
    return b, out


def report(label, n=3):
    ns = globals()   # this script's namespace is the "notebook" (an IPython shell may have replaced __main__)
    t, rep = best(lambda: L.find_leaks(user_ns=ns, frames=False), n)
    heap = len(gc.get_objects())
    print(f"{label:<58} {t * 1e3:8.0f} ms   heap {heap:>9,}   storages {len(rep):>7,}   searched {rep.visited:>9,}")


def leak_table_cost(label, n=3):
    import weakref

    from tensorscope.tracking.storages import LiveStorage

    g = globals()
    g["made_by_cell"] = [torch.randn(100, 100) for _ in range(10)]
    recs = []
    for t in g["made_by_cell"]:
        s = t.untyped_storage()
        recs.append(LiveStorage(0, weakref.ref(s), s.data_ptr(), s.nbytes(), "cpu", "float32", tuple(t.shape), 1,
                                "aten.randn.default", 3, "cell.py", 2))
    del s, t
    ns = globals()   # this script's namespace is the "notebook" (an IPython shell may have replaced __main__)
    t, tab = best(lambda: L.leak_table(recs, user_ns=ns, frames=False), n)
    print(f"{label:<58} {t * 1e3:8.0f} ms   heap {len(gc.get_objects()):>9,}   rows {tab.num_rows}")
    g.pop("made_by_cell")


class _Res:
    def __init__(self, n):
        self.execution_count = n


def discovery_cost(label, make, n=5):
    d = L.BoundaryDiscovery(shell=None)
    keep = []
    ts = []
    for i in range(n):
        d.pre_run_cell()
        keep.append(make())
        t0 = time.perf_counter()
        d.post_run_cell(_Res(i))
        ts.append(time.perf_counter() - t0)
    d.close()
    print(f"{label:<58} {min(ts) * 1e3:8.2f} ms   scanned {d.last_scanned:>7,} new objects   "
          f"(heap {len(gc.get_objects()):,})")
    keep.clear()


def trace_leak_step(n=5):
    """The end-of-trace leak step of %%tensorscope cells in an IPython shell, big library imported."""
    import types

    from IPython.core.interactiveshell import InteractiveShell


    lib = types.ModuleType("biglib")
    lib.state = [{"k": [i, str(i)]} for i in range(300_000)]
    lib.funcs = [(lambda k: (lambda x: x + k))(i) for i in range(20_000)]
    lib.classes = [type(f"C{i}", (), {"a": i}) for i in range(5_000)]
    sys.modules["biglib"] = lib
    times = []
    orig = L.leak_table

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            times.append(time.perf_counter() - t0)

    L.leak_table = timed   # recording.finish imports it from the package at the end of each trace
    sh = InteractiveShell.instance()

    def cell(src):
        r = sh.run_cell(src, silent=True)
        if not r.success:
            raise RuntimeError(f"benchmark cell failed: {r.error_in_exec or r.error_before_exec}")

    try:
        cell("%load_ext tensorscope")
        cell("import torch, biglib\n"
             "model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())])\n"
             "opt = torch.optim.Adam(model.parameters())\nx = torch.randn(64, 256)\nlosses = []")
        print(f"end-of-trace leak step, IPython shell, model + optimizer live, heap {len(gc.get_objects()):,} objects "
              "(biglib emulates transformers/timm):")
        step = "opt.zero_grad()\nloss = model(x).pow(2).mean(); loss.backward(); opt.step()"
        for label, src in [
            ("clean training step (grads, optimizer state: expected)", f"%%tensorscope -q\n{step}"),
            ("step, losses.append(loss) (a graph kept, growing)", f"%%tensorscope -q\n{step}\nlosses.append(loss)"),
            ("def f(): with tensorscope.trace(): step (locals named)",
             "import tensorscope\ndef f():\n    with tensorscope.trace():\n        opt.zero_grad()\n"
             "        y = model(x); l = y.pow(2).mean(); l.backward(); opt.step()\n    return y\nkeep = f()"),
        ]:
            times.clear()
            for _ in range(n):
                cell(src)
            print(f"  {label:<56} {min(times) * 1e3:8.1f} ms   (median {sorted(times)[len(times) // 2] * 1e3:.1f})")
        cell("del losses, keep, biglib, model, opt, x")
    finally:
        L.leak_table = orig
        del sys.modules["biglib"]
    print()


def magic_leaks_100k(n=3):
    """``%tensorscope leaks`` in an IPython shell whose namespace holds 100k live tensors (next to a
    model, its optimizer and a library-sized heap): as a flat list, and as a dataset of (x, y) pairs."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()

    def cell(src):
        r = sh.run_cell(src, silent=True)
        if not r.success:
            raise RuntimeError(f"benchmark cell failed: {r.error_in_exec or r.error_before_exec}")
        return r.result

    cell("%load_ext tensorscope")
    cell("import torch\n"
         "model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())])\n"
         "opt = torch.optim.Adam(model.parameters())\nmodel(torch.randn(4, 256)).sum().backward(); opt.step()\n"
         "notes = [{'k': [i, str(i)]} for i in range(45_000)]")
    print(f"%tensorscope leaks, IPython shell, model + optimizer live, 100k live tensors "
          f"(wall and CPU, best of {n}):")
    for label, make in [
        ("features = [torch.randn(16) for _ in range(100_000)]",
         "features = [torch.randn(16) for _ in range(100_000)]"),
        ("data = [(x, y) ...] (50k pairs of tensors)",
         "data = [(torch.randn(16), torch.tensor(i % 10)) for i in range(50_000)]"),
    ]:
        cell(make)
        walls, cpus = [], []
        rep = None
        for _ in range(n):
            t0, c0 = time.perf_counter(), time.process_time()
            cell("_leaks = %tensorscope leaks")
            rep = sh.user_ns["_leaks"]
            rep.to_html()
            rep.to_text()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        print(f"  {label:<56} {min(walls) * 1e3:8.0f} ms   CPU {min(cpus) * 1e3:6.0f} ms   "
              f"{len(rep):,} storages in {len(rep.groups)} holders, heap {len(gc.get_objects()):,}")
        del rep
        cell("del features, _leaks" if make.startswith("features") else "del data, _leaks")
    cell("del model, opt, notes")
    print()


def main(argv=None):
    what = (argv if argv is not None else sys.argv[1:]) or ["all"]
    print(f"reference: 1M dict stores in {reference() * 1e3:.0f} ms (about 60-80 ms on an idle modern core)")
    if what[0] not in ("trace", "magic", "find", "all"):
        raise SystemExit("usage: benchmarks/leaks.py [trace|magic|find|all]")
    if what[0] in ("trace", "all"):
        trace_leak_step()
        if what[0] == "trace":
            return
    if what[0] in ("magic", "all"):
        magic_leaks_100k()
        if what[0] == "magic":
            return
    g = globals()
    g["filler"] = [{"k": [i, str(i)]} for i in range(45_000)]   # with torch imported: ~300k gc objects
    report("heap ~300k objects, no tensors")
    g["tensors"] = [torch.empty(4) for _ in range(100_000)]
    report("+100k live tensors in a global list")
    g["extra"] = [[i] for i in range(1_000_000)]
    report("+1M extra objects reachable from a global", 1)
    leak_table_cost("leak_table (end of a traced cell), 10 new storages")
    lib = type(sys)("some_library")
    lib.state = g.pop("extra")
    sys.modules["some_library"] = lib
    report("+1M extra objects in a library module (not searched)", 1)
    print()
    discovery_cost("discovery, cell makes 10 tensors (heap ~1.5M objects)", lambda: [torch.zeros(3) for _ in range(10)])
    discovery_cost("discovery, cell makes 1000 tensors", lambda: [torch.zeros(3) for _ in range(1000)])
    del sys.modules["some_library"], lib
    g.pop("tensors")
    gc.collect()
    discovery_cost("discovery, cell makes 10 tensors (heap ~300k objects)", lambda: [torch.zeros(3) for _ in range(10)])
    print(f"reference: 1M dict stores in {reference() * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
