"""The advisor's cost at the end of a trace: ``tensorscope.advise(t)`` on an ``--ops``-op trace.

Records a training-like loop (a small MLP, ``.item()`` per step, an optimizer) until the trace
holds about ``--ops`` ops, then times ``advise(t)`` (best of ``--reps``, thread CPU time and
wall time) twice: cold (the trace's derived ``layout_changes`` not computed yet, as right after
the cell) and warm (after the summary derived it). The machine peaks are measured (or read
from the cache) once before timing: their one-time cost is printed on its own.

    python benchmarks/advisor.py [--ops 10000] [--reps 15] [--engine native|python]
"""
from __future__ import annotations

import argparse
import time

import torch

import tensorscope
from tensorscope._peaks import all_peaks


def record(n_ops: int, engine: str):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    with tensorscope.trace(engine=engine, leaks=False) as t:
        steps = 0
        while steps < 10 or steps * 33 < n_ops:
            loss = m(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            steps += 1
    return t.result


def best(fn, reps):
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        fn()
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - w0)
    return min(cpu) / 1e6, min(wall) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--engine", default="auto")
    a = ap.parse_args()
    w0 = time.perf_counter()
    peaks = all_peaks(measure=True)
    print(f"machine peaks: {time.perf_counter() - w0:.3f} s (first use measures, later ones read the cache)")
    t = record(a.ops, a.engine)
    print(f"trace: {t.ops.num_rows} ops, {t.calls.num_rows} calls, engine {t.metadata.get('engine')}")
    w0 = time.perf_counter_ns()
    adv = tensorscope.advise(t, peaks=peaks)
    print(f"advise, cold (derives layout_changes): {(time.perf_counter_ns() - w0) / 1e6:.2f} ms wall")
    c, w = best(lambda: tensorscope.advise(t, peaks=peaks), a.reps)
    print(f"advise, warm: {c:.2f} ms CPU, {w:.2f} ms wall (best of {a.reps}); target <= 5 ms for 10k ops; "
          f"ratio to target {c / 5.0:.2f} (CPU time: on a shared machine wall time measures the neighbours)")
    print(f"findings: {', '.join(adv.findings.column('kind').to_pylist())}")


if __name__ == "__main__":
    main()
