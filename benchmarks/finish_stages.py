"""Finishing a trace, stage by stage: where the time between the end of the ``with`` block and the
built Trace goes.

Run: ``.venv/bin/python benchmarks/finish_stages.py [--ops 1M] [--spill N] [--engines native,python]
[--repeat R] [--wall] [--json out.json]``; ``--show out.json [--wall]`` prints a saved run.

Per engine, and once with ``spill_rows`` left at its default and once with ``--spill`` (default 200k; ``0``:
no spilling row), a fresh subprocess traces N ops of ``a.add(b)`` on 8x8 CPU tensors with every default
option (``tensorscope.trace()``, as ``scale.py``'s ``small`` workload), with the finishing stages wrapped by
timers: the thread's CPU time (``time.thread_time_ns``: user and system time, so page faults count), and
wall-clock time (``--wall`` prints that one; it also counts waits, e.g. for the kernel to find huge pages).
The wrappers cost well under a microsecond a call, and the stages are called a handful of times per trace.
Prints each stage's total in ms and in µs per op, nested stages indented under their parent; ``exit`` is the
whole ``with`` block's exit (what scale.py's ``fin us/op`` reports). ``--repeat R`` runs each row R times
(fresh processes) and keeps each stage's minimum, the figure least disturbed by a shared machine.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

#: (label, module, attribute path, depth): the stages wrapped, in the order they run
STAGES = (
    ("session._restore", "tensorscope.recording.session", "Session._restore", 1),
    ("engine.finish", None, "engine.finish", 1),
    ("finish_tables", "tensorscope.recording.finish", "finish_tables", 1),
    ("decode_tables", "tensorscope.recording.finish", "decode_tables", 2),
    ("Decoder()", "tensorscope.recording.decode", "Decoder.__init__", 3),
    ("calls_table", "tensorscope.recording.decode", "calls_table", 3),
    ("ops_table", "tensorscope.recording.decode", "ops_table", 3),
    ("tensors_table", "tensorscope.recording.decode", "tensors_table", 3),
    ("errors_table", "tensorscope.recording.decode", "errors_table", 3),
    ("Decoded()", "tensorscope.recording.probes", "Decoded.__init__", 2),
    ("contribute_all", "tensorscope.recording.finish", "contribute_all", 2),
    ("compiled probe", "tensorscope.recording.probes", "CompiledProbe.contribute", 3),
    ("kernels probe", "tensorscope.recording.probes", "KernelsProbe.contribute", 3),
    ("collectives probe", "tensorscope.recording.probes", "CollectivesProbe.contribute", 3),
    ("storages probe", "tensorscope.recording.probes", "StoragesProbe.contribute", 3),
    ("allocator probe", "tensorscope.recording.probes", "AllocatorStatsProbe.contribute", 3),
    ("Decoded.build", "tensorscope.recording.probes", "Decoded.build", 2),
    ("metadata", "tensorscope.recording.finish", "metadata", 1),
    ("_complete (Trace)", "tensorscope.recording.session", "Session._complete", 1),
)


#: the clock: the thread's CPU time (user + system, page faults included), steadier than wall time
#: on a shared machine (wall time is kept too: ``--wall`` prints it)
_clock = time.thread_time_ns


def _wrap(owner: Any, attr: str, acc: dict[str, int], label: str) -> None:
    fn = getattr(owner, attr)

    def timed(*a: Any, **kw: Any) -> Any:
        t0, w0 = _clock(), time.perf_counter_ns()
        try:
            return fn(*a, **kw)
        finally:
            acc[label] = acc.get(label, 0) + _clock() - t0
            acc["wall " + label] = acc.get("wall " + label, 0) + time.perf_counter_ns() - w0
    setattr(owner, attr, timed)


def install(acc: dict[str, int]) -> None:
    """Wrap every stage of :data:`STAGES` (the engine's ``finish`` on both engine classes)."""
    for label, mod, path, _depth in STAGES:
        if mod is None:
            from tensorscope.recording.engines.native import NativeEngine
            from tensorscope.recording.engines.python import PythonEngine

            for cls in (NativeEngine, PythonEngine):
                _wrap(cls, "finish", acc, label)
            continue
        owner: Any = importlib.import_module(mod)
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        _wrap(owner, attr, acc, label)


def one(n_ops: int, spill_rows: int | None) -> dict[str, Any]:
    import torch

    import tensorscope

    torch.set_num_threads(1)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with tensorscope.trace():   # one-time imports and lazy initialisation
        a.add(a)
    acc: dict[str, int] = {}
    install(acc)
    opts = {} if spill_rows is None else {"spill_rows": spill_rows}
    gc.collect()
    with tensorscope.trace(**opts) as tr:
        for _ in range(n_ops):
            a.add(b)
        t1, w1 = _clock(), time.perf_counter_ns()
    acc["exit"] = _clock() - t1
    acc["wall exit"] = time.perf_counter_ns() - w1
    t = tr.result
    return {"n_ops": t.ops.num_rows, "spill_rows": spill_rows, "engine": t.metadata.get("engine"),
            "spilled_rows": t.metadata.get("spilled_rows", 0), "ns": acc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="1M")
    ap.add_argument("--spill", default="200k", help="spill_rows of the spilling row (0: none)")
    ap.add_argument("--engines", default="native,python")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row; each stage's minimum is kept")
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of the thread's CPU time")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--show", help="print the numbers a --json run wrote, measure nothing")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    def size(s: str) -> int:
        s = s.strip().lower()
        mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
        return int(float(s[:-1] if mult != 1 else s) * mult)

    if a.one:
        n, spill = a.one
        print("RESULT " + json.dumps(one(int(n), None if spill == "default" else int(spill))))
        return 0
    if a.show:
        with open(a.show) as f:
            _print(json.load(f), "wall " if a.wall else "")
        return 0
    n = size(a.ops)
    spills: list[str] = ["default"] + ([str(size(a.spill))] if size(a.spill) else [])
    results = []
    for engine in a.engines.split(","):
        env = dict(os.environ)
        env.setdefault("TENSORSCOPE_NATIVE_BUILD", "foreground")
        if engine == "python":
            env["TENSORSCOPE_FORCE_FALLBACK"] = "1"
        else:
            env.pop("TENSORSCOPE_FORCE_FALLBACK", None)
        for spill in spills:
            best: dict[str, Any] = {}
            for _ in range(max(a.repeat, 1)):
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(n), spill],
                                   capture_output=True, text=True, env=env)
                line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if p.returncode != 0 or line is None:
                    print(f"{engine} spill_rows={spill}: failed (exit {p.returncode})\n{p.stderr[-2000:]}", flush=True)
                    continue
                r = json.loads(line[len("RESULT "):])
                if best:
                    best["ns"] = {k: min(v, best["ns"].get(k, v)) for k, v in r["ns"].items()}
                else:
                    best = r
            if best:
                results.append(best)
    _print(results, "wall " if a.wall else "")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _print(results: list[dict[str, Any]], clock: str) -> None:
    heads = [f"{r['engine']} {'default' if r['spill_rows'] is None else format(r['spill_rows'], ',')}" for r in results]
    print(f"{'stage (' + (clock or 'cpu ') + 'ms, us/op)':28s}" + "".join(f"{h:>22s}" for h in heads))
    depth: Callable[[str], int] = {lbl: d for lbl, _m, _p, d in STAGES}.get   # type: ignore[assignment]
    for label in ("exit",) + tuple(s[0] for s in STAGES):
        if not any(clock + label in r["ns"] for r in results):
            continue
        cells = []
        for r in results:
            ns = r["ns"].get(clock + label)
            cells.append(f"{'-':>22s}" if ns is None else f"{ns / 1e6:12.1f} {ns / 1e3 / r['n_ops']:8.3f} ")
        print(f"{'  ' * (depth(label) or 0) + label:28s}" + "".join(cells))
    print("rows: " + ", ".join(f"{h}: {r['n_ops']:,} ops, {r['spilled_rows']:,} spilled" for h, r in zip(heads, results)))


if __name__ == "__main__":
    sys.exit(main())
