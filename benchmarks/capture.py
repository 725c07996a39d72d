"""What ``capture=`` costs while it records (the ``captures`` table ``t.repro()`` reads).

Per workload of benchmarks/overhead.py (small elementwise ops, an MLP step, a conv-net training
step whose SGD updates the parameters in place, a transformer block step) and per engine: eager,
the default ``trace()`` and ``trace(capture="nonfinite")``, end to end (enter, record, leave, build
the tables), best of N, the contexts round robin, single thread, the thread's CPU time. The
workloads stay finite, so nothing is kept: what is measured is the op hook every ATen op goes
through while a capture is on and, for ops that write an argument (``add_``, ``_foreach_add_``,
``out=``), the copy of what they overwrite taken before they run (in C++ under the native engine).
A trace without ``capture=`` does neither (benchmarks/overhead.py measures it).

    python benchmarks/capture.py [--quick] [--engines native,python] [--reps 5]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

import tensorscope

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import conv_net, mlp, small_ops, time_ctxs, transformer


def bench(engines, reps, quick):
    n = 1 if quick else 4
    work = [("small ops (8x8)", small_ops(300 if quick else 1000)), ("MLP fwd+bwd", mlp(n)),
            ("conv net step (SGD in place)", conv_net(n)), ("transformer block", transformer(n))]
    rows = []
    for name, (run, n_ops) in work:
        ctxs = {"eager": contextlib.nullcontext}
        for e in engines:
            ctxs[f"{e} default"] = lambda e=e: tensorscope.trace(engine=e, leaks=False)
            ctxs[f"{e} capture"] = lambda e=e: tensorscope.trace(engine=e, leaks=False, capture="nonfinite")
        run()   # warm
        best = time_ctxs(ctxs, run, reps, 3)
        ops = n_ops * 3
        eager = best["eager"]
        for e in engines:
            d = best[f"{e} default"] - eager
            c = best[f"{e} capture"] - eager
            rows.append((name, e, ops, eager / ops / 1e3, best[f"{e} default"] / ops / 1e3,
                         best[f"{e} capture"] / ops / 1e3, c / d if d > 0 else float("nan")))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--engines", default="native,python")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    engines = [e for e in a.engines.split(",") if e]
    reps = 2 if a.quick else a.reps
    rows = bench(engines, reps, a.quick)
    print(f"torch {torch.__version__}, 1 thread, thread CPU time, best of {reps}")
    print("| workload | engine | ops | eager µs/op | default µs/op | capture=\"nonfinite\" µs/op "
          "| capture / default overhead |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.2f}x |")


if __name__ == "__main__":
    main()
