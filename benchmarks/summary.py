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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="1000,20000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", default="native")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
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
