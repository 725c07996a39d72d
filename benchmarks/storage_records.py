"""Storage records while recording and finishing: resident bytes per op, and the finish's peaks.

Run: ``.venv/bin/python benchmarks/storage_records.py [N] [--spill ROWS] [--json out.json]``
(default 1M ops of ``a.add(b)`` on 8x8 CPU tensors, ``spill_rows=200_000``: every op makes one
output storage, freed at once, so the trace holds as many storage records as ops). Run it with
``TENSORSCOPE_FORCE_FALLBACK=1`` for the python engine. Each run is its own process (``--one``).

Prints, for the traced loop: ``rec B/op`` (RSS and RssAnon just before the trace's exit over the
start, per op), ``fin us/op`` (the exit: stop, decode, build every table; wall and CPU), ``fin
VmHWM MB`` (the high-water mark of RSS during the exit over the start, reset just before it),
``fin anon MB`` (RssAnon sampled every 2 ms during the exit, its maximum over the start),
``after anon/file MB`` (once the Trace is built), and the tensors table's rows.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

from _procmem import AnonSampler, reset_peak, status


def one(n_ops: int, spill_rows: int) -> dict:
    import torch

    import tensorscope

    torch.set_num_threads(1)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with tensorscope.trace():   # one-time imports and lazy initialisation
        a.add(a)
    opts = {"spill_rows": spill_rows}
    if spill_rows < 65536:   # below the default chunk_rows: smaller chunks (as benchmarks/scale.py)
        opts["chunk_rows"] = max(1, spill_rows // 2)
    gc.collect()
    s0 = status()
    c0, t0 = time.process_time(), time.perf_counter()
    with tensorscope.trace(**opts) as tr:
        for _ in range(n_ops):
            a.add(b)
        s1 = status()
        peak_ok = reset_peak()
        sampler = AnonSampler()
        sampler.start()
        c1, t1 = time.process_time(), time.perf_counter()
    c2, t2 = time.process_time(), time.perf_counter()
    anon_peak = sampler.stop()
    s2 = status()
    t = tr.result
    n = t.ops.num_rows
    return {
        "engine": t.metadata.get("engine"), "n_ops": n, "spill_rows": spill_rows,
        "spilled_rows": t.metadata.get("spilled_rows", 0), "storages": t.tensors.num_rows,
        "rec_us_per_op": (t1 - t0) / n * 1e6, "rec_cpu_us_per_op": (c1 - c0) / n * 1e6,
        "rec_bytes_per_op": (s1["VmRSS"] - s0["VmRSS"]) / n,
        "rec_anon_bytes_per_op": (s1["RssAnon"] - s0["RssAnon"]) / n,
        "fin_us_per_op": (t2 - t1) / n * 1e6, "fin_cpu_us_per_op": (c2 - c1) / n * 1e6,
        "fin_vmhwm_mb": (s2["VmHWM"] - s0["VmRSS"]) / 2**20 if peak_ok else None,
        "fin_anon_peak_mb": (anon_peak - s0["RssAnon"]) / 2**20,
        "after_anon_mb": (s2["RssAnon"] - s0["RssAnon"]) / 2**20,
        "after_file_mb": (s2["RssFile"] - s0["RssFile"]) / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="?", default="1000000")
    ap.add_argument("--spill", type=int, default=200_000)
    ap.add_argument("--json")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    n = int(float(args.n.lower().replace("m", "e6").replace("k", "e3")))
    if args.one:
        print(json.dumps(one(n, args.spill)))
        return 0
    out = subprocess.run([sys.executable, __file__, str(n), "--spill", str(args.spill), "--one"],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{r['engine']} {r['n_ops']:,} ops (spill_rows {r['spill_rows']:,}, {r['storages']:,} storages): "
          f"rec {r['rec_bytes_per_op']:.0f} B/op ({r['rec_anon_bytes_per_op']:.0f} anon), "
          f"{r['rec_us_per_op']:.2f}/{r['rec_cpu_us_per_op']:.2f} us/op; "
          f"fin {r['fin_us_per_op']:.2f}/{r['fin_cpu_us_per_op']:.2f} us/op (wall/cpu), "
          f"VmHWM +{r['fin_vmhwm_mb']:.0f} MB, anon peak +{r['fin_anon_peak_mb']:.0f} MB; "
          f"after {r['after_anon_mb']:.0f} anon / {r['after_file_mb']:.0f} file MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
