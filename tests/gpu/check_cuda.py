"""GPU check for tensorscope's CUDA paths — run on a CUDA machine: ``python tests/gpu/check_cuda.py``.

CI has no GPU, so this is not a pytest module (pytest collects ``test_*.py``
only); the CPU suite mocks CUDA where it must and says so. This script
traces a small conv net forward+backward on the GPU and checks, for real:

1. ``cuda_ns`` is filled for every op with a CUDA tensor input (python engine; the native engine
   leaves it null and says so in the notes, and its outputs and gradients are bitwise eager's);
2. kernels are collected and linked to the op that launched them, every
   linked kernel starting after its op started and inside the cell window,
   with no timestamp-check warnings;
3. the per-op CUDA time sum lies within the cell's wall window;
4. two (then three, kept-alive) consecutive traced cells all have complete
   kernel records (same kernel count for the same work);
5. ops on a side stream are timed on that stream, and a cell whose op raises
   still resolves the other ops' CUDA times;
6. the Perfetto export of the GPU trace is well-formed with flow arrows;
7. the caching allocator's view: an ``allocator`` row per device (allocated <= reserved, nothing
   reset), and with ``memory_history=True`` an out-of-memory error in the block leaves the
   snapshot (an ``oom`` event, segments, blocks and events joined to our categories) and the
   allocator's history as it was;
and prints the tracing overhead. Exit status: 0 all passed, 1 a check
failed, 77 no CUDA device (skipped).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))   # the repo root, when not pip-installed

import torch  # noqa: E402

import tensorscope  # noqa: E402

FAILED = []


def check(cond, what):
    print(("  ok   " if cond else "  FAIL ") + what, flush=True)
    if not cond:
        FAILED.append(what)


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10)).cuda()


def step(m, x):
    loss = m(x).sum()
    loss.backward()
    torch.cuda.synchronize()     # inside the cell: its wall window covers all of its GPU work
    return loss


def traced(m, x, **kw):
    with tensorscope.trace(kernels=True, **kw) as t:
        step(m, x)
    return t.result


def cuda_input_ops(t):
    rows = t.ops.select(["seq", "op", "in_devices", "cuda_ns", "start_ns", "cpu_ns"]).to_pylist()
    return rows, [r for r in rows if any((d or "").startswith("cuda") for d in (r["in_devices"] or []))]


def check_trace(t, label):
    wall = t.metadata["wall_ns"]
    rows, cuda_ops = cuda_input_ops(t)
    label = f"{label} [{t.metadata['engine']}]"
    if t.metadata["engine"] == "python":   # per-op CUDA event timing: the python engine's (README: engines)
        missing = [r["op"] for r in cuda_ops if r["cuda_ns"] is None]
        check(cuda_ops and not missing,
              f"{label}: cuda_ns filled for all {len(cuda_ops)} CUDA ops (missing: {missing[:5]})")
        total = sum(r["cuda_ns"] or 0 for r in rows)
        check(0 < total <= wall,
              f"{label}: per-op CUDA sum {total / 1e6:.3f} ms within the wall window {wall / 1e6:.3f} ms")
    else:   # the native engine neither times CUDA ops nor screens CUDA outputs yet, and must say so
        check(cuda_ops and all(r["cuda_ns"] is None for r in cuda_ops),
              f"{label}: {len(cuda_ops)} CUDA ops recorded, cuda_ns left null")
        notes = t.metadata.get("notes", [])
        check(any("python engine only" in n for n in notes) and any("not screened" in n for n in notes),
              f"{label}: the notes say CUDA ops are not timed per op nor screened ({notes[:3]})")
    k = t.kernels.to_pylist()
    linked = [r for r in k if r["seq"] is not None]
    check(len(k) > 0, f"{label}: {len(k)} kernels collected")
    check(len(linked) >= 0.9 * len(k), f"{label}: {len(linked)}/{len(k)} kernels linked to their op")
    by_seq = {r["seq"]: r for r in rows}
    bad = [r["name"] for r in linked if r["start_ns"] is None or r["start_ns"] < by_seq[r["seq"]]["start_ns"]
           or r["start_ns"] + r["dur_ns"] > wall + 1_000_000]
    check(not bad, f"{label}: every linked kernel starts after its op and inside the cell (bad: {bad[:3]})")
    warns = [n for n in t.metadata.get("notes", []) if "kernel" in n and ("stamped" in n or "outside" in n
                                                                          or "no timestamps" in n or "end before" in n)]
    check(not warns, f"{label}: no kernel timestamp warnings {warns[:2]}")
    return len(k)


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (torch.cuda.is_available() is False)")
        return 77
    print(tensorscope.env())
    m = net()
    x = torch.randn(16, 3, 32, 32, device="cuda")
    for _ in range(3):           # cuDNN autotune, lazy module init, allocator warm-up
        step(m, x)

    print("cell 1 (forward+backward, kernels=True), python engine (per-op CUDA times):")
    t1 = traced(m, x, engine="python")
    n1 = check_trace(t1, "cell 1")
    print("the same cell, native engine (the default):")
    check(check_trace(traced(m, x, engine="native"), "cell 1") == n1, "both engines see the same kernels")
    check_native_unchanged()

    print("cells 2 and 3 (consecutive, one collector):")
    n2 = check_trace(traced(m, x), "cell 2")
    n3 = check_trace(traced(m, x), "cell 3")
    check(n1 == n2 == n3, f"consecutive cells have complete kernel records ({n1}, {n2}, {n3})")

    print("cells 4-6 with the collector kept alive (always-on mode):")
    from tensorscope.timing.kernels import KernelCollector

    col = KernelCollector.shared()
    col.keep_alive = True
    try:
        ns = [check_trace(traced(m, x), f"kept-alive cell {i}") for i in (4, 5, 6)]
        check(ns == [n1] * 3, f"kept-alive cells complete ({ns} vs {n1})")
        # deferred harvest: three windows, one restart
        restarts = col.restarts
        pend = []
        for _ in range(3):
            col.begin_window()
            t0 = time.perf_counter_ns()
            with tensorscope.trace(kernels=False) as tt:
                step(m, x)
            # only the kernel count is checked here: tt's ops are on its own t0, not this window's
            pend.append(col.end_window_deferred(t0, tt.result.ops))
        res = [p.resolve() for p in pend]
        check(col.restarts - restarts == 1, f"three deferred windows harvested with {col.restarts - restarts} restart(s)")
        check(all(r[0].num_rows > 0 for r in res), f"deferred windows have kernels {[r[0].num_rows for r in res]}")
    finally:
        col.close()

    print("side stream and a raising op:")
    side = torch.cuda.Stream()
    a = torch.randn(512, 512, device="cuda")
    with tensorscope.trace(kernels=True, engine="python") as ts:   # per-op CUDA times: python engine
        b = a @ a
        with torch.cuda.stream(side):
            c = a * 3
        torch.cuda.current_stream().wait_stream(side)
        try:
            a @ torch.randn(3, 3, device="cuda")
        except RuntimeError:
            pass
        d = b + c
        torch.cuda.synchronize()
    t = ts.result
    rows = t.ops.select(["seq", "op", "cuda_ns", "error_id"]).to_pylist()
    ok_rows = [r for r in rows if r["error_id"] is None and r["op"] in ("aten.mm.default", "aten.mul.Tensor", "aten.add.Tensor")]
    check(len(ok_rows) >= 3 and all(r["cuda_ns"] is not None for r in ok_rows),
          f"ops around a raising op keep their CUDA time ({[(r['op'], r['cuda_ns']) for r in ok_rows]})")
    mul = [r["seq"] for r in rows if r["op"] == "aten.mul.Tensor"]
    streams = {r["seq"]: r["stream"] for r in t.kernels.to_pylist() if r["seq"] is not None}
    mm = [r["seq"] for r in rows if r["op"] == "aten.mm.default" and r["error_id"] is None]
    check(mul and mm and streams.get(mul[0]) is not None and streams.get(mul[0]) != streams.get(mm[0]),
          f"the side-stream op's kernel is on its own stream ({streams.get(mul[0] if mul else None)} vs "
          f"{streams.get(mm[0] if mm else None)})")
    del b, c, d

    print("Perfetto export:")
    from tensorscope.render.perfetto import trace_events, validate_trace_events

    doc = trace_events(t1)
    probs = validate_trace_events(doc)
    check(not probs, f"Perfetto JSON well-formed ({probs[:3]})")
    flows = sum(1 for e in doc["traceEvents"] if e["ph"] == "s")
    check(flows > 0, f"{flows} launch flow arrows from ops to kernels")
    with tempfile.TemporaryDirectory() as d:
        t1.to_perfetto(os.path.join(d, "gpu.json"))

    print("CUDA caching allocator:")
    check_allocator(m, x)

    print("overhead:")
    def timed(fn, n=7):
        ts = []
        for _ in range(n):
            a = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - a)
        return statistics.median(ts)

    plain = timed(lambda: step(m, x))
    with_events = timed(lambda: _trace_only(m, x, kernels=False))
    with_kernels = timed(lambda: _trace_only(m, x, kernels=True))
    n_ops = t1.ops.num_rows
    print(f"  untraced step            {plain * 1e3:8.2f} ms")
    print(f"  traced (CUDA events)     {with_events * 1e3:8.2f} ms  x{with_events / plain:.1f}  "
          f"({(with_events - plain) / max(n_ops, 1) * 1e6:.1f} µs/op over {n_ops} ops, incl. building the tables)")
    print(f"  traced + kernels         {with_kernels * 1e3:8.2f} ms  x{with_kernels / plain:.1f}")

    print(f"\n{'FAILED: ' + str(len(FAILED)) + ' check(s)' if FAILED else 'all GPU checks passed'}")
    return 1 if FAILED else 0


def check_native_unchanged():
    """Outputs and gradients on the GPU are bitwise eager's under the native engine, and its storage
    records cover the device storages (cuDNN deterministic; no adaptive pooling, whose CUDA backward
    is nondeterministic with or without tracing)."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def run():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 14 * 14, 4)).cuda()
        x = torch.randn(4, 3, 16, 16, device="cuda")
        out = m(x)
        out.square().mean().backward()
        torch.cuda.synchronize()
        return [out.detach()] + [p.grad for p in m.parameters()]

    plain = run()
    with tensorscope.trace(engine="native", leaks=False) as t:
        traced_ = run()
    check(all(torch.equal(a, b) for a, b in zip(plain, traced_)),
          "native engine on CUDA: outputs and gradients bitwise equal to eager")
    devs = set(t.tensors.column("device").to_pylist())
    check(any((d or "").startswith("cuda") for d in devs),
          f"native engine on CUDA: storage records include device storages ({sorted(map(str, devs))[:4]})")


def check_allocator(m, x):
    peak = torch.cuda.max_memory_allocated()
    with tensorscope.trace(leaks=False) as ts:
        step(m, x)
    t = ts.result
    rows = t.allocator.to_pylist()
    check(len(rows) == 1 and rows[0]["source"] == "stats",
          f"one allocator row from memory_stats ({[(r['device'], r['source']) for r in rows]})")
    r = rows[0] if rows else {}
    check(0 < (r.get("allocated_end") or 0) <= (r.get("reserved_end") or 0) and (r.get("fragmentation_bytes") or 0) >= 0,
          f"allocated {r.get('allocated_end')} <= reserved {r.get('reserved_end')}, fragmentation "
          f"{r.get('fragmentation_bytes')}")
    check(torch.cuda.max_memory_allocated() >= peak, "the allocator's peak counters were not reset")
    cuda_rows = t.tensors.filter(t.tensors.column("device") != "cpu")
    check(cuda_rows.num_rows > 0 and cuda_rows.column("address").null_count == 0,
          f"every CUDA storage has its address ({cuda_rows.num_rows} storages)")
    was = torch._C._cuda_isHistoryEnabled()
    tr = tensorscope.trace(memory_history=True, leaks=False)
    try:
        with tr:
            step(m, x)
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        check(False, "the too-big allocation raised OutOfMemoryError")
    except torch.OutOfMemoryError:
        pass
    check(torch._C._cuda_isHistoryEnabled() == was, f"the allocator's history recording restored ({was})")
    t = tr.result
    a = (t.allocator.to_pylist() or [{}])[0]
    check(a.get("source") == "history" and (a.get("num_ooms") or 0) >= 1 and a.get("fragmentation_seq") is not None,
          f"allocator row from the history: {a}")
    ev = t.allocator_events.to_pylist()
    joined = [e for e in ev if e["storage_id"] is not None]
    check(any(e["action"] == "oom" for e in ev), f"the snapshot has the oom event ({len(ev)} events)")
    check(len(joined) > 0 and {e["category"] for e in joined} <= set(tensorscope.schema.MEMORY_CATEGORIES),
          f"{len(joined)}/{len(ev)} events joined to our storages, categories "
          f"{sorted({str(e['category']) for e in joined})}")
    blocks = t.allocator_blocks.to_pylist()
    check(t.allocator_segments.num_rows > 0 and any(b["category"] == "parameter" for b in blocks),
          f"{t.allocator_segments.num_rows} segments; parameter blocks joined "
          f"({sum(b['category'] == 'parameter' for b in blocks)})")
    check(t.allocator_timeline.num_rows == len(ev), "allocator_timeline has a row per event")
    with tempfile.TemporaryDirectory() as d:
        back = tensorscope.load(t.save(os.path.join(d, "oom")))
        check(back.allocator_events.equals(t.allocator_events), "allocator tables survive save/load")


def _trace_only(m, x, kernels):
    with tensorscope.trace(kernels=kernels, leaks=False):
        step(m, x)


if __name__ == "__main__":
    sys.exit(main())
