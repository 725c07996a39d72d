"""Long cells: recording, finishing, summarising and saving traces of millions of ops, and the memory each takes.

Run: ``.venv/bin/python benchmarks/scale.py [SIZES ...] [--quick] [--model-ops N] [--spill N] [--json out.json]``
(default sizes 1M 3M 10M small ops; ``--quick``: 200k 1M; sizes accept ``k``/``M`` suffixes). Run it
with ``TENSORSCOPE_FORCE_FALLBACK=1`` to measure the python engine (the subprocesses inherit it). Every
measurement runs in its own fresh subprocess (``--one``), so one run's peaks never mix with another's.

Workloads, each traced with every default option (``tensorscope.trace()``):

* ``small``: N ops of ``a.add(b)`` on 8x8 CPU tensors, one thread;
* ``model``: a small transformer (two encoder layers, d=64) trained with Adam, as many steps as
  reach ``--model-ops`` ops (default 1M);

each once with ``spill_rows`` left at its default and once with a small ``spill_rows`` (``--spill``,
default ``max(65536, min(200k, N/4))``) so the op chunks spill to disk while it records.

Prints one row per run:

* ``eager us/op``: the same workload run untraced first (wall), what the program itself costs;
* ``rec us/op``: time from entering the trace to the last op, per op, wall / process CPU (the CPU
  time is the steadier figure on a shared machine);
* ``fin us/op``: the trace's exit (stop, decode, build every table), per op, wall / process CPU;
* ``rec B/op``: resident bytes while recording (RSS just before the exit minus RSS at the start), per op,
  and ``after B/op`` once the trace is built (the ``Trace`` alive);
* ``fin peak MB``: the high-water mark of RSS during the exit over RSS at the start (the mark is reset
  with ``echo 5 > /proc/self/clear_refs`` just before the exit, read from ``VmHWM``);
  ``fin anon MB``: the largest RssAnon sampled every 2 ms during the exit, over the start: what
  finishing really holds (VmHWM also counts the file-backed pages of the memory-mapped tables);
  ``anon/file MB``: RssAnon and RssFile over the start after the exit (memory-mapped spill and table
  files count as file-backed pages, which the kernel can drop and read back);
* ``sum s`` / ``sum peak MB`` / ``sum anon MB``: the summary as a notebook shows it
  (``_repr_mimebundle_``: text and HTML), the high-water mark during it over the start, and its
  sampled anonymous peak over the built trace's;
* ``save s`` / ``sav anon MB``: ``t.save()`` to a temporary directory (removed afterwards) and its
  sampled anonymous peak over what the trace held before it.

Then, per run, the bytes per row of the big tables (``ops``, ``calls``, ``tensors``, ``memory``) as the
``Trace`` holds them (Arrow ``nbytes``; a memory-mapped table's bytes are file-backed).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from _procmem import AnonSampler, reset_peak, status


def parse_size(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if mult != 1 else s) * mult)


def small_workload(n_ops: int):
    import torch

    a, b = torch.randn(8, 8), torch.randn(8, 8)

    def run():
        for _ in range(n_ops):
            a.add(b)
    return run, n_ops


def model_workload(n_ops: int):
    """A two-layer transformer encoder trained with Adam: as many steps as reach ``n_ops`` ops."""
    import torch

    import tensorscope

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16, 16)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()   # warm: the optimizer state exists
    with tensorscope.trace(leaks=False) as t:
        step()
    per_step = t.ops.num_rows
    steps = max(1, -(-n_ops // per_step))

    def run():
        for _ in range(steps):
            step()
    return run, steps * per_step


def one(kind: str, n_ops: int, spill_rows: int | None) -> dict:
    """One run in this process: record, finish, summarise, save; the numbers as a dict."""
    import torch

    import tensorscope

    torch.set_num_threads(1)
    run, planned = (small_workload if kind == "small" else model_workload)(n_ops)
    a = torch.randn(8, 8)
    with tensorscope.trace():   # one-time imports and lazy initialisation (the fixed cost, not ours here)
        a.add(a)
    opts = {} if spill_rows is None else {"spill_rows": spill_rows}
    if spill_rows is not None and spill_rows < 65536:   # below the default chunk_rows: smaller chunks
        opts["chunk_rows"] = max(1, spill_rows // 2)
    e0 = time.perf_counter()
    run()   # untraced: what the program itself costs per op
    eager = (time.perf_counter() - e0) / planned * 1e6
    gc.collect()
    s0 = status()
    c0, t0 = time.process_time(), time.perf_counter()
    with tensorscope.trace(**opts) as tr:
        run()
        s1 = status()
        peak_ok = reset_peak()
        sampler = AnonSampler()
        sampler.start()
        c1, t1 = time.process_time(), time.perf_counter()
    c2, t2 = time.process_time(), time.perf_counter()
    fin_anon = sampler.stop()
    s2 = status()
    t = tr.result if hasattr(tr, "result") else tr
    n = t.ops.num_rows
    md = t.metadata
    res = {
        "kind": kind, "n_ops": n, "planned_ops": planned, "spill_rows": spill_rows, "engine": md.get("engine"),
        "spilled_rows": md.get("spilled_rows", 0),
        "eager_us_per_op": eager,
        "rec_us_per_op": (t1 - t0) / n * 1e6,
        "fin_us_per_op": (t2 - t1) / n * 1e6,
        "rec_cpu_us_per_op": (c1 - c0) / n * 1e6,
        "fin_cpu_us_per_op": (c2 - c1) / n * 1e6,
        "rec_bytes_per_op": (s1["VmRSS"] - s0["VmRSS"]) / n,
        "rec_anon_bytes_per_op": (s1["RssAnon"] - s0["RssAnon"]) / n,
        "after_bytes_per_op": (s2["VmRSS"] - s0["VmRSS"]) / n,
        "fin_peak_mb": (s2["VmHWM"] - s0["VmRSS"]) / 2**20 if peak_ok else None,
        "fin_anon_peak_mb": (fin_anon - s0["RssAnon"]) / 2**20,
        "after_anon_mb": (s2["RssAnon"] - s0["RssAnon"]) / 2**20,
        "after_file_mb": (s2["RssFile"] - s0["RssFile"]) / 2**20,
    }
    tables = {}
    for name in ("ops", "calls", "tensors", "memory"):
        tab = t.table(name)
        tables[name] = {"rows": tab.num_rows, "cols": tab.num_columns,
                        "bytes_per_row": tab.nbytes / tab.num_rows if tab.num_rows else 0.0}
    res["tables"] = tables
    gc.collect()
    peak_ok = reset_peak()
    anon3 = status()["RssAnon"]
    sampler = AnonSampler()
    sampler.start()
    t3 = time.perf_counter()
    bundle = t._repr_mimebundle_()
    t4 = time.perf_counter()
    sum_anon = sampler.stop()
    s3 = status()
    res["summary_s"] = t4 - t3
    res["summary_peak_mb"] = (s3["VmHWM"] - s0["VmRSS"]) / 2**20 if peak_ok else None
    res["summary_anon_peak_mb"] = (sum_anon - anon3) / 2**20   # over the built trace
    res["summary_chars"] = len(bundle["text/plain"])
    where = tempfile.mkdtemp(prefix="tensorscope-bench-scale-")
    try:
        gc.collect()
        anon5 = status()["RssAnon"]
        sampler = AnonSampler()
        sampler.start()
        t5 = time.perf_counter()
        t.save(os.path.join(where, "trace"))
        res["save_s"] = time.perf_counter() - t5
        res["save_anon_peak_mb"] = (sampler.stop() - anon5) / 2**20
        res["saved_mb"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(where) for f in fs) / 2**20
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return res


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_row(r: dict) -> None:
    spill = "default" if r["spill_rows"] is None else f"{r['spill_rows']:,}"
    print(f"{r['kind']:6s} {r['n_ops']:>11,} {spill:>10s} {r['engine'] or '?':7s} "
          f"{r['eager_us_per_op']:6.2f} {r['rec_us_per_op']:5.2f}/{r['rec_cpu_us_per_op']:<5.2f} {r['fin_us_per_op']:5.2f}/{r['fin_cpu_us_per_op']:<5.2f} "
          f"{r['rec_bytes_per_op']:7.0f} "
          f"{r['after_bytes_per_op']:7.0f} {_fmt(r['fin_peak_mb'], '8.0f')} {r['fin_anon_peak_mb']:8.0f} "
          f"{r['after_anon_mb']:7.0f}/{r['after_file_mb']:<6.0f} {r['summary_s']:6.1f} "
          f"{_fmt(r['summary_peak_mb'], '8.0f')} {r['summary_anon_peak_mb']:8.0f} {r['save_s']:6.1f} "
          f"{r['save_anon_peak_mb']:8.0f}", flush=True)


HEADER = (f"{'work':6s} {'ops':>11s} {'spill_rows':>10s} {'engine':7s} {'eager':>6s} {'rec':>11s} {'fin':>11s} {'rec':>7s} "
          f"{'after':>7s} {'fin peak':>8s} {'fin anon':>8s} {'anon/file':>14s} {'sum':>6s} {'sum peak':>8s} {'sum anon':>8s} "
          f"{'save':>6s} {'sav anon':>8s}\n"
          f"{'':6s} {'':>11s} {'':>10s} {'':7s} {'us/op':>6s} {'us/op w/cpu':>11s} {'us/op w/cpu':>11s} {'B/op':>7s} "
          f"{'B/op':>7s} {'MB':>8s} {'MB':>8s} {'MB after':>14s} {'s':>6s} {'MB':>8s} {'MB':>8s} {'s':>6s} {'MB':>8s}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="*", help="small-op counts (default 1M 3M 10M)")
    ap.add_argument("--quick", action="store_true", help="sizes 200k 1M")
    ap.add_argument("--model-ops", default="1M", help="ops of the transformer training loop (0: skip it)")
    ap.add_argument("--spill", help="spill_rows of the spilling rows (default max(65536, min(200k, N/4)))")
    ap.add_argument("--no-default-spill", action="store_true", help="only the rows with a small spill_rows")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--one", nargs=3, metavar=("KIND", "N", "SPILL"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        kind, n, spill = a.one
        print("RESULT " + json.dumps(one(kind, int(n), None if spill == "default" else int(spill))))
        return 0
    sizes = [parse_size(s) for s in a.sizes] or ([200_000, 1_000_000] if a.quick else [1_000_000, 3_000_000, 10_000_000])
    runs = []
    for n in sizes:
        runs.append(("small", n))
    model_ops = parse_size(a.model_ops)
    if model_ops:
        runs.append(("model", model_ops))
    # the native engine built before the first run (a cold cache would otherwise record that run
    # with the python engine while it builds in the background)
    env = dict(os.environ)
    env.setdefault("TENSORSCOPE_NATIVE_BUILD", "foreground")
    print(HEADER, flush=True)
    results = []
    for kind, n in runs:
        spill = parse_size(a.spill) if a.spill else max(65536, min(200_000, n // 4))
        for s in ((spill,) if a.no_default_spill else ("default", spill)):
            cmd = [sys.executable, os.path.abspath(__file__), "--one", kind, str(n), str(s)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                print(f"{kind} {n} spill_rows={s}: failed (exit {p.returncode})\n{p.stderr[-2000:]}", flush=True)
                continue
            r = json.loads(line[len("RESULT "):])
            results.append(r)
            print_row(r)
    print("\nbytes per row of the big tables as the Trace holds them (Arrow nbytes):")
    for r in results:
        spill = "default" if r["spill_rows"] is None else f"{r['spill_rows']:,}"
        cells = ", ".join(f"{k} {v['bytes_per_row']:.0f} B/row ({v['rows']:,} rows, {v['cols']} cols)"
                          for k, v in r["tables"].items())
        print(f"  {r['kind']} {r['n_ops']:,} spill_rows={spill}: {cells}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
