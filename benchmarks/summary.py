"""What the user waits for after a traced cell: building and rendering its summary.

Records ``--reps`` + 1 fresh traces of a training loop of a small MLP (forward, backward, SGD step;
a list of losses kept, so the leak search finds something) sized to about ``--ops`` ATen ops,
then times ``t._repr_mimebundle_()`` (the summary built, its text and its HTML: what a notebook
displays) on each trace after the first (the first pays the one-time imports and the machine
peaks), and reports the median in ms (thread CPU time and wall), the HTML's size in KB and the
part of it that is drawings. Each trace is fresh: nothing derived is cached from a previous rep,
as in a notebook, where every cell makes a new trace.

    python benchmarks/summary.py [--ops 1000,20000] [--reps 5] [--engine native|python] [--json out.json]

Budgets (issue 30): a 1,000-op cell in ≤ 15 ms and ≤ 40 KB; a 20,000-op cell in ≤ 60 ms and ≤ 80 KB.
Run it against another checkout (PYTHONPATH) to compare before/after.

``--large`` (Linux): big traces instead, one per ``--ops`` value, of small ops (``a.add(b)`` on 8x8,
one thread) recorded with ``--spill-rows`` (default 100,000: the ops table is memory-mapped), then
in this order: the summary built and rendered, ``t.save``, ``tensorscope.load`` of it and the
loaded trace's ops read. Each is timed (wall ms) with the process's peak resident memory over the
resident memory before it (``VmHWM`` reset through ``/proc/self/clear_refs``: Arrow's memory too,
which tracemalloc does not see; file-backed pages of memory-mapped tables count while touched), after
the memory the step before freed is given back to the system (Arrow's pool, ``malloc_trim``).

    python benchmarks/summary.py --large --ops 300000,1000000

``--sections`` (with ``--large``): before the summary, the advisor and each summary section on their
own, in the summary's order (what one computes and caches on the trace the next reads for free), each
timed with its sampled anonymous peak: which step holds the summary's peak.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch

import tensorscope


def workload(n_ops: int):
    """A callable running about ``n_ops`` ATen ops (an MLP training loop), and the state it needs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    kept: list = []
    with tensorscope.trace(leaks=False) as probe:
        step(model, opt, x, kept)
    per_step = probe.result.ops.num_rows
    steps = max(1, round(n_ops / per_step))
    kept.clear()

    def run():
        kept.clear()
        for _ in range(steps):
            step(model, opt, x, kept)

    return run


def step(model, opt, x, kept):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    kept.append(loss.detach())


def measure(n_ops: int, reps: int, engine: str) -> dict:
    run = workload(n_ops)
    traces = []
    for _ in range(reps + 1):
        with tensorscope.trace(engine=engine) as t:
            run()
        traces.append(t.result)
    first = traces[0]
    first._repr_mimebundle_()    # one-time imports, the machine peaks
    cpu, wall, size, drawn = [], [], 0, 0
    for t in traces[1:]:
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        bundle = t._repr_mimebundle_()
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        cpu.append((c1 - c0) / 1e6)
        wall.append((w1 - w0) / 1e6)
        html = bundle["text/html"]
        size = len(html.encode("utf-8"))
        drawn = sum(len(m) for m in re.findall(r"<svg.*?</svg>|<img [^>]*>", html, re.S))
    return {"ops": traces[-1].ops.num_rows, "cpu_ms": statistics.median(cpu), "wall_ms": statistics.median(wall),
            "html_kb": size / 1000, "drawings_kb": drawn / 1000, "text_lines": bundle["text/plain"].count("\n") + 1}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _timed(fn):
    """(result, wall ms, peak MB over the resident memory before, sampled peak MB of anonymous memory over
    the anonymous memory before: what is not file pages of memory-mapped tables)."""
    import ctypes
    import gc

    import pyarrow as pa

    gc.collect()
    # memory freed by the step before goes back to the system first: else this step reuses it unseen
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    import threading

    base, anon0 = _status("VmRSS"), _status("RssAnon")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset VmHWM to the current resident size
    top = [anon0]
    done = threading.Event()

    def sample():   # anonymous memory has no high-water mark of its own: sampled every millisecond
        while not done.wait(0.001):
            top[0] = max(top[0], _status("RssAnon"))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    w0 = time.perf_counter()
    try:
        r = fn()
    finally:
        ms = (time.perf_counter() - w0) * 1e3
        done.set()
        th.join()
    return r, ms, (_status("VmHWM") - base) / 1e6, (max(top[0], _status("RssAnon")) - anon0) / 1e6


def _sections(t) -> list:
    """(step, wall ms, sampled anonymous peak MB) of the advisor and of each summary section of ``t``."""
    from tensorscope.options import DisplayOptions
    from tensorscope.render import summary as R

    share = DisplayOptions().min_finding_share
    rows = []
    _, ms, _peak, anon = _timed(lambda: t.advice(min_share=share))
    rows.append(("advisor", ms, anon))
    for fn in R.SECTIONS:
        if fn is not R.sections_advice.advice_section:
            _, ms, _peak, anon = _timed(lambda fn=fn: fn(t))
            rows.append((fn.__name__, ms, anon))
    return rows


def measure_large(n_ops: int, spill_rows: int, engine: str, sections: bool = False) -> dict:
    import os
    import shutil
    import tempfile

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with tensorscope.trace(engine=engine, spill_rows=spill_rows, chunk_rows=min(65536, spill_rows)) as rec:
        for _ in range(n_ops):
            a.add(b)
    t = rec.result
    out: dict = {"ops": t.ops.num_rows}
    if sections:
        out["sections"] = _sections(t)
    bundle, out["summary_ms"], out["summary_peak_mb"], out["summary_anon_mb"] = _timed(t._repr_mimebundle_)
    out["html_kb"] = len(bundle["text/html"].encode("utf-8")) / 1000
    where = tempfile.mkdtemp(prefix="summary-bench-")
    try:
        path, out["save_ms"], out["save_peak_mb"], out["save_anon_mb"] = _timed(lambda: t.save(os.path.join(where, "run")))
        back, out["load_ms"], out["load_peak_mb"], out["load_anon_mb"] = _timed(lambda: tensorscope.load(path))
        _, out["read_ms"], out["read_peak_mb"], out["read_anon_mb"] = _timed(lambda: back.ops.equals(t.ops))
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return out


def main_large(a) -> None:
    with tensorscope.trace(engine=a.engine) as warm:   # one-time imports and the machine peaks, not timed
        torch.ones(8).add(1)
    warm.result._repr_mimebundle_()
    out = []
    print("peak: VmHWM over the resident memory before (file pages of mapped tables included); anon: sampled "
          "anonymous memory over that before")
    print(f"{'ops':>9} " + " ".join(f"{s + ' ms':>10} {'peak MB':>8} {'anon MB':>8}" for s in ("summary", "save", "load",
                                                                                        "read")))
    for n in (int(v) for v in a.ops.split(",")):
        r = measure_large(n, a.spill_rows, a.engine, a.sections)
        out.append(r)
        for name, ms, anon in r.get("sections", []):
            print(f"  {name:>24} {ms:>8.0f} ms {anon:>8.1f} anon MB")
        print(f"{r['ops']:>9} " + " ".join(f"{r[s + '_ms']:>10.0f} {r[s + '_peak_mb']:>8.1f} {r[s + '_anon_mb']:>8.1f}"
                                           for s in ("summary", "save", "load", "read")))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default=None, help="op counts, comma-separated (default 1000,20000; --large 300000,1000000)")
    ap.add_argument("--large", action="store_true", help="big traces of small ops: summary, save and load, with peaks")
    ap.add_argument("--sections", action="store_true", help="--large: the advisor and each section on its own first")
    ap.add_argument("--spill-rows", type=int, default=100_000, help="--large: the traces' spill_rows")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", default="native")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.large:
        a.ops = a.ops or "300000,1000000"
        return main_large(a)
    a.ops = a.ops or "1000,20000"
    out = []
    print(f"{'ops':>7} {'cpu ms':>8} {'wall ms':>8} {'HTML KB':>8} {'drawings KB':>12} {'text lines':>10}")
    for n in (int(v) for v in a.ops.split(",")):
        r = measure(n, a.reps, a.engine)
        out.append(r)
        print(f"{r['ops']:>7} {r['cpu_ms']:>8.1f} {r['wall_ms']:>8.1f} {r['html_kb']:>8.1f} {r['drawings_kb']:>12.1f} "
              f"{r['text_lines']:>10}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
