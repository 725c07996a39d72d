"""What ``fingerprints=True`` costs, and how fast ``diverge`` aligns a big pair.

Per workload of benchmarks/overhead.py (small elementwise ops, an MLP step, a conv-net training
step, a transformer block step) and per engine: eager, the default ``trace()`` and
``trace(fingerprints=True)``, end to end (enter, record, leave, build the tables), best of N, the
contexts round robin, single thread, the thread's CPU time. Reported: µs per op, the recording
overhead over eager of each trace, and the fingerprinted trace's overhead as a multiple of the
default trace's (the target is 1.5x). Then, for the native engine, ns per element of a fingerprint
by layout and dtype with each loop this CPU has (portable, AVX2, AVX-512), and two 100k-op traces
aligned by ``diverge``.

    python benchmarks/fingerprints.py [--quick] [--engines native,python] [--reps 5]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

import tensorscope

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import CLOCK, conv_net, mlp, small_ops, time_ctxs, transformer


def bench(engines, reps, quick):
    n = 1 if quick else 4
    work = [("small ops (8x8)", small_ops(300 if quick else 1000)), ("MLP fwd+bwd", mlp(n)),
            ("conv net step", conv_net(n)), ("transformer block", transformer(n))]
    rows = []
    for name, (run, n_ops) in work:
        ctxs = {"eager": contextlib.nullcontext}
        for e in engines:
            ctxs[f"{e} default"] = lambda e=e: tensorscope.trace(engine=e, leaks=False)
            ctxs[f"{e} fingerprints"] = lambda e=e: tensorscope.trace(engine=e, leaks=False, fingerprints=True)
        run()   # warm
        best = time_ctxs(ctxs, run, reps, 3)
        ops = n_ops * 3
        eager = best["eager"]
        for e in engines:
            d = best[f"{e} default"] - eager
            f = best[f"{e} fingerprints"] - eager
            rows.append((name, e, ops, eager / ops / 1e3, best[f"{e} default"] / ops / 1e3,
                         best[f"{e} fingerprints"] / ops / 1e3, d / ops / 1e3, f / ops / 1e3, f / d if d > 0 else float("nan")))
    return rows


def per_element(reps):
    """ns per element of a fingerprint: a traced ``clone`` of a 1M-value tensor with fingerprints
    on minus the same with them off, best of ``reps``, per loop the native engine has here."""
    from tensorscope import native

    ext, _ = native.engine()
    if ext is None:
        return []
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, 32, 32, generator=g)
    cases = {"float32 contiguous": x, "float32 channels_last C=16": x.to(memory_format=torch.channels_last),
             "float32 channels_last C=32": x.reshape(32, 32, 32, 32).to(memory_format=torch.channels_last),
             "float16 contiguous": x.half(), "bfloat16 contiguous": x.bfloat16()}
    paths = ["portable", *ext.set_fp_simd(True)]
    rows = []
    try:
        for name, t in cases.items():
            ns = {}
            for path in paths:
                ext.set_fp_simd(path)
                best = {}
                for _ in range(reps):
                    for fp in (False, True):
                        with tensorscope.trace(engine="native", leaks=False, fingerprints=fp):
                            t0 = CLOCK()
                            t.clone()
                            dt = CLOCK() - t0
                        best[fp] = min(best.get(fp, dt), dt)
                ns[path] = (best[True] - best[False]) / t.numel()
            rows.append((name, ns))
    finally:
        ext.set_fp_simd(True)
    return rows


def align_100k():
    import pyarrow as pa

    from tensorscope.analyses.diverge import diverge_tables

    with tensorscope.trace(fingerprints=True, leaks=False, storages=False) as t:
        x = torch.zeros(4)
        for _ in range(1000):
            x = x + 1
            x = x * 1.0
    ops = t.result.ops
    big = pa.concat_tables([ops] * (100_000 // ops.num_rows))
    keep = [i for i in range(big.num_rows) if i % 997 != 5]
    b = big.take(pa.array(keep))
    t0 = time.perf_counter()
    _, _, facts = diverge_tables(big, b)
    return big.num_rows, b.num_rows, facts["aligned"], time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--engines", default="native,python")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    engines = [e for e in a.engines.split(",") if e]
    rows = bench(engines, 2 if a.quick else a.reps, a.quick)
    print(f"torch {torch.__version__}, 1 thread, thread CPU time, best of {2 if a.quick else a.reps}")
    print("| workload | engine | ops | eager µs/op | default µs/op | fingerprints µs/op | default overhead µs/op "
          "| fingerprints overhead µs/op | fingerprints / default overhead |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.2f} | {r[7]:.2f} | {r[8]:.2f}x |")
    rows = per_element(3 if a.quick else 2 * a.reps) if "native" in engines else []
    if rows:
        paths = list(rows[0][1])
        print("\nnative fingerprint, ns per element (a traced clone of 1M values, fingerprints on minus off)")
        print("| tensor | " + " | ".join(paths) + " |")
        print("|---|" + "---:|" * len(paths))
        for name, ns in rows:
            print(f"| {name} | " + " | ".join(f"{ns[p]:.2f}" for p in paths) + " |")
    na, nb, n, dt = align_100k()
    print(f"\ndiverge: {na} and {nb} ops aligned ({n} pairs) in {dt:.2f} s")


if __name__ == "__main__":
    main()
