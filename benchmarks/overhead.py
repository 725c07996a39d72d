"""Side-by-side tracing overhead, in one process: eager vs an empty dispatch mode vs
tensorscope (native and python engines) vs DebugMode vs FlopCounterMode vs torch.profiler.

Prints µs/op, overhead over eager, and overhead as a multiple of the empty
TorchDispatchMode's overhead, on (a) a loop of small elementwise ops on 8×8
tensors, (b) an MLP forward+backward, (c) a small conv net training step and
(d) a small transformer block forward+backward and (e) a real model's training step (timm's
resnet18 or a transformers BERT from its config when installed, else a ResNet-18 written here:
torchvision-free, same blocks and widths). Every
figure is end to end: entering, recording, leaving and building the tables
(for torch.profiler: "active only" is the profile block alone, "+ events()"
adds what a user needs to read a result). The fixed cost at the end of a trace
is measured on its own (a one-op trace). Then a 1M-op trace per engine, plain
and with ``dataset=`` (spilling into parts), each in a fresh process, reports
the time to stop and build the Arrow tables and the resident bytes per recorded
op (for the native engine also its own share: packed rows, storages, interned).

    python benchmarks/overhead.py [--quick] [--ops 1000000] [--clock cpu|wall] [--json out.json]
    python benchmarks/overhead.py --big-only native [--dataset] --ops 1000000   # the big trace alone

Numbers are relative: single thread (torch.set_num_threads(1)), best of N, contexts round robin.
``--clock cpu`` (the default) times the thread's CPU time, which a shared machine's neighbours
barely move (CPU autograd runs the backward on the calling thread); ``--clock wall`` the wall time.
The last table is the default ``trace()``'s overhead per workload as a multiple of the empty
TorchDispatchMode's, fixed cost included.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tensorscope


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def small_ops(n_iter):
    # values stay finite (|x| < 0.5): a workload that overflows would measure the exact
    # non-finite counting of every op instead of the screen
    x = torch.rand(8, 8) * 0.5
    y = torch.rand(8, 8)

    def run():
        z = y
        for _ in range(n_iter):
            z = x + z
            z = z * x
            z = z.relu()
        return z
    return run, 3 * n_iter


def mlp(n_steps, width=128, depth=4, batch=16):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(batch, width)

    def run():
        for _ in range(n_steps):
            model.zero_grad(set_to_none=True)
            loss = model(x).sum()
            loss.backward()
    with tensorscope.trace(leaks=False) as t:
        for _ in range(1):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
    return run, t.ops.num_rows * n_steps


def conv_net(n_steps, batch=8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, stride=2), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    ).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def run():
        for _ in range(n_steps):
            step()
    return run, _count_ops(step) * n_steps


class Block(torch.nn.Module):
    """A pre-norm transformer block (attention + MLP), GPT-style."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def transformer(n_steps, batch=4, seq=32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    x = torch.randn(batch, seq, 64)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    def run():
        for _ in range(n_steps):
            step()
    return run, _count_ops(step) * n_steps


class BasicBlock(torch.nn.Module):
    """ResNet's basic block: two 3x3 convs with batch norm, a projection shortcut when the shape changes."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(torch.nn.Module):
    """torchvision's resnet18, written out (same stem, blocks, widths and head; no torchvision)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64),
                                        torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = torch.nn.Sequential(*blocks)
        self.fc = torch.nn.Linear(512, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def real_model(n_steps, batch=2):
    """A real model's training step (SGD with momentum): timm's resnet18 or a small BERT from
    transformers' config classes when installed (no weights downloaded), else ResNet18 above.
    Returns (run, ops per run, what it is)."""
    torch.manual_seed(0)
    try:
        import timm

        model = timm.create_model("resnet18", pretrained=False, num_classes=10)
        what = f"timm {timm.__version__} resnet18"
    except ImportError:
        model = None
    if model is None:
        try:
            import transformers

            cfg = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=512, num_labels=10)
            model = transformers.BertForSequenceClassification(cfg)
            what = f"transformers {transformers.__version__} BertForSequenceClassification (2 layers, d=128)"
        except ImportError:
            model = None
    if model is None:
        model = ResNet18()
        what = "ResNet-18 written in this file (timm and transformers are not installed)"
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if "Bert" in type(model).__name__:
        ids = torch.randint(0, 1000, (batch, 32))
        labels = torch.randint(0, 10, (batch,))

        def loss_fn():
            return model(input_ids=ids, labels=labels).loss
    else:
        x = torch.randn(batch, 3, 64, 64)
        y = torch.randint(0, 10, (batch,))

        def loss_fn():
            return torch.nn.functional.cross_entropy(model(x), y)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()

    def run():
        for _ in range(n_steps):
            step()
    return run, _count_ops(step) * n_steps, what


def _count_ops(step):
    with tensorscope.trace(leaks=False, engine="python") as t:
        step()
    return t.ops.num_rows


@contextlib.contextmanager
def profiler_with_events():
    """torch.profiler end to end: recording plus ``events()``, what reading any result needs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as p:
        yield p
    p.events()


def contexts():
    from torch.utils.flop_counter import FlopCounterMode

    ctx = {
        "eager": contextlib.nullcontext,
        "empty dispatch mode": EmptyMode,
        "native: trace() (default)": lambda: tensorscope.trace(engine="native"),
        "native: leaks=False": lambda: tensorscope.trace(engine="native", leaks=False),
        "native: rows only (no probes)": lambda: tensorscope.trace(
            engine="native", leaks=False, nonfinite=False, storages=False, modules=False, source=False, flops=False),
        "python: trace() (default)": lambda: tensorscope.trace(engine="python"),
        "python: leaks=False": lambda: tensorscope.trace(engine="python", leaks=False),
        "python: no nonfinite": lambda: tensorscope.trace(engine="python", leaks=False, nonfinite=False),
        "FlopCounterMode": lambda: FlopCounterMode(display=False),
        "torch.profiler(record_shapes)": lambda: torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True),
        "torch.profiler + events()": profiler_with_events,
    }
    try:
        from torch.utils._debug_mode import DebugMode

        ctx["DebugMode"] = DebugMode
        ctx["DebugMode(record_torchfunction)"] = lambda: DebugMode(record_torchfunction=True)
    except ImportError:
        pass
    return ctx


#: the clock every measurement reads (main() sets it from --clock)
CLOCK = time.thread_time_ns


def time_ctxs(ctxs, run, reps, k):
    """Best-of-``reps`` ns per context, measured round robin (one rep of every context, then the
    next rep), so a slow spell of a shared machine hits all of them rather than one."""
    best = {key: None for key in ctxs}
    for _ in range(reps):
        for key, make in ctxs.items():
            gc.collect()
            t0 = CLOCK()
            with make():
                for _ in range(k):
                    run()
            ns = CLOCK() - t0
            # the minimum: other processes only ever add time (the development machine is shared)
            best[key] = ns if best[key] is None else min(best[key], ns)
    return best


def bench_workload(name, run, n_ops, reps, k=3, fixed=None):
    """End-to-end µs/op: entering, recording ``k`` runs, leaving and building the tables (for
    torch.profiler + events(): reading the events), best of ``reps``. The fixed cost of a
    trace is measured on its own by fixed_cost(); with ``fixed`` (its result) the tensorscope
    rows also show the per-op overhead with that fixed cost taken out (one trace holds
    ``k * n_ops`` ops here, so a short workload spreads a fixed ~2 ms over few ops)."""
    ctx = contexts()
    for make in ctx.values():   # warm-up: imports, caches, first-call costs
        with make():
            run()
    res = {key: ns / (k * n_ops) / 1e3 for key, ns in time_ctxs(ctx, run, reps, k).items()}
    eager = res["eager"]
    empty = res["empty dispatch mode"] - eager
    print(f"\n{name}: {n_ops} ops per run, {k} runs per context, best of {reps}, round robin")
    print(f"{'context':34s} {'us/op':>9s} {'over eager':>11s} {'x empty-mode overhead':>22s} {'x, fixed cost out':>18s}")
    rows = {}
    for key, v in res.items():
        over = v - eager
        mult = over / empty if empty > 0 else float("nan")
        rows[key] = {"us_per_op": v, "overhead_us": over, "x_empty": mult}
        steady = ""
        eng = key.split(":")[0]
        if fixed and eng in ("native", "python") and empty > 0:
            leaks = "default" in key
            ms = fixed.get(f"{eng} leaks={leaks}")
            if ms is not None:
                per = over - ms * 1e3 / (k * n_ops)
                rows[key]["x_empty_fixed_cost_out"] = per / empty
                steady = f"{per / empty:18.2f}"
        print(f"{key:34s} {v:9.2f} {over:11.2f} {mult if key != 'eager' else float('nan'):22.2f} {steady}")
    return rows


_WORKLOADS = (("small_ops", "(a) small ops"), ("mlp", "(b) MLP"), ("conv_net", "(c) conv net"),
              ("transformer", "(d) transformer blocks"), ("real_model", "(e) real model"))


#: below this share of eager's time the empty mode's own overhead is measurement noise, and a
#: multiple of it says nothing (ResNet-18: ~1 us/op over ~127 us/op of real compute)
_NOISE_SHARE = 0.02


def _ratio_cell(rows, key, eager, noisy):
    if key not in rows:
        return f"{'-':>30s}"
    share = f"(+{100 * rows[key]['overhead_us'] / eager:.0f}% of eager)"
    mult = "n/a" if noisy else f"{rows[key]['x_empty']:.2f}x"
    return f"{mult + ' ' + share:>30s}"


def ratios(out, clock):
    """The closing table: each workload's default-trace overhead over the empty mode's, and over
    eager's own time. Where the empty mode's overhead is within noise of eager (big kernels), the
    multiple is not printed: the share of eager's time is the figure that means something there."""
    keys = ("native: trace() (default)", "native: leaks=False", "python: trace() (default)")
    print(f"\ndefault trace() overhead as a multiple of the empty TorchDispatchMode's, and (in brackets) as a "
          f"share of eager's own time (end to end, fixed cost included, clock: {clock})")
    print(f"{'workload':26s} " + " ".join(f"{k:>30s}" for k in keys))
    for name, label in _WORKLOADS:
        rows = out.get(name)
        if not rows:
            continue
        eager = rows["eager"]["us_per_op"]
        empty = rows["empty dispatch mode"]["overhead_us"]
        noisy = empty < _NOISE_SHARE * eager
        print(f"{label:26s} " + " ".join(_ratio_cell(rows, k, eager, noisy) for k in keys))
        if noisy:
            print(f"{'':26s} n/a: the empty mode costs {empty:.2f} us/op over eager's {eager:.1f} us/op, "
                  f"within noise, so a multiple of it means nothing here")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fixed_cost(reps):
    """Cost of a trace around one op, minus the op: entering, leaving, building empty-ish tables."""
    x = torch.randn(8, 8)
    makers = {f"{eng} leaks={leaks}": (lambda eng=eng, leaks=leaks: tensorscope.trace(engine=eng, leaks=leaks))
              for eng in ("native", "python") for leaks in (False, True)}
    samples = {key: [] for key in makers}
    for make in makers.values():
        with make():
            x + x
    for _ in range(reps):   # round robin, as time_ctxs
        for key, make in makers.items():
            t0 = CLOCK()
            with make():
                x + x
            samples[key].append(CLOCK() - t0)
    out = {key: statistics.median(v) / 1e6 for key, v in samples.items()}
    print("\nfixed cost of one trace (one op), ms: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()))
    return out


def big_trace(n_ops, engine="python", dataset=None):
    """A ``n_ops``-op trace of small ops: resident bytes per op while recording (the whole
    process, and for the native engine the engine's own share: packed op rows, storage records,
    interned metas), then the time to stop and build every table (wall and thread CPU)."""
    import tempfile

    from tensorscope.options import TraceOptions
    from tensorscope.recording.session import new_session

    x = torch.randn(8, 8)
    opts = dict(leaks=False, nonfinite=False, engine=engine)
    with tensorscope.trace(**opts):   # one-time imports and lazy initialisation: the fixed cost, measured apart
        x + x
    if dataset:   # spilling into parts as it records, four times over the run (as benchmarks/dataset.py)
        opts["dataset"] = tempfile.mkdtemp(prefix="tensorscope-bench-ds-")
        opts["spill_rows"] = max(65536, n_ops // 4)
    sess = new_session(TraceOptions(**opts))
    write_ns = [0]
    write = sess._write_dataset

    def timed_write():   # the parquet write at the end (dataset=), reported apart from building
        w0 = time.thread_time_ns()
        write()
        write_ns[0] += time.thread_time_ns() - w0

    sess._write_dataset = timed_write
    gc.collect()
    r0 = rss_bytes()
    sess.start()
    try:
        z = x
        for _ in range(n_ops // 2):
            z = x + z
            z = z.relu_()
    finally:
        r1 = rss_bytes()
        own = sess.engine.ext.resident() if hasattr(getattr(sess.engine, "ext", None), "resident") else None
        t0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        t = sess.stop()
        c1 = time.thread_time_ns()
        t1 = time.perf_counter_ns()
    n = t.ops.num_rows
    res = {"n_ops": n, "rss_bytes_per_op": (r1 - r0) / n, "build_us_per_op": (t1 - t0) / n / 1e3,
           "build_cpu_us_per_op": (c1 - c0 - write_ns[0]) / n / 1e3, "spilled_rows": t.metadata.get("spilled_rows", 0),
           "dataset": bool(dataset), "dataset_write_cpu_us_per_op": write_ns[0] / n / 1e3}
    if own is not None:
        # what the engine held for the ops (rows + storages + interned); the rest is the function
        # mode's calls rows and the Python heap
        res["engine_bytes_per_op"] = {k: v / n for k, v in own.items() if k != "n_rows"}
    if dataset:
        import shutil

        res["dataset_parts"] = (t.metadata.get("dataset") or {}).get("parts")
        shutil.rmtree(opts["dataset"], ignore_errors=True)
    own_s = (" (engine: " + ", ".join(f"{k} {v:.1f}" for k, v in res["engine_bytes_per_op"].items()) + " B/op)"
             if own is not None else "")
    print(f"[{t.metadata['engine']}{' dataset=' if dataset else ''}] {n} ops recorded: resident while recording "
          f"{(r1 - r0) / n:.1f} B/op{own_s}; stop + build tables {(t1 - t0) / 1e6:.0f} ms = "
          f"{res['build_us_per_op']:.2f} µs/op wall, {res['build_cpu_us_per_op']:.2f} µs/op CPU "
          + (f"(+ writing the dataset {write_ns[0] / n / 1e3:.2f} µs/op CPU) " if dataset else "") +
          f"({res['spilled_rows']} rows spilled)")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (CI smoke run)")
    ap.add_argument("--ops", type=int, default=1_000_000, help="ops in the big trace (0 to skip)")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--big-only", choices=("native", "python"),
                    help="only the big trace, with this engine (this process)")
    ap.add_argument("--dataset", action="store_true", help="the big trace writes a dataset= (spilling into parts)")
    ap.add_argument("--only", help="run only these workloads (comma-separated: small,mlp,conv,transformer,real)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: the thread's CPU time (default; steady on a shared machine), wall: wall time")
    a = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time_ns if a.clock == "cpu" else time.perf_counter_ns
    torch.set_num_threads(1)
    if a.big_only:
        r = big_trace(a.ops, a.big_only, a.dataset)
        print(json.dumps(r))
        return 0
    only = set(a.only.split(",")) if a.only else {"small", "mlp", "conv", "transformer", "real"}
    reps = 5 if a.quick else 7
    out = {"torch": torch.__version__, "native": None}
    try:
        from tensorscope import native

        out["native"] = native.status()
    except Exception:
        pass
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, clock: {a.clock}, native: {out['native']}")
    out["clock"] = a.clock
    fixed = out["fixed_cost_ms"] = fixed_cost(reps)
    if "small" in only:
        run, n = small_ops(1000)
        out["small_ops"] = bench_workload("(a) small elementwise ops on 8x8", run, n, reps, fixed=fixed)
    if "mlp" in only:
        run, n = mlp(4 if a.quick else 10)
        out["mlp"] = bench_workload("(b) MLP forward+backward (4x Linear(128)+ReLU, batch 16)", run, n, reps, fixed=fixed)
    if "conv" in only:
        run, n = conv_net(2 if a.quick else 3)
        out["conv_net"] = bench_workload("(c) conv net training step (3 conv+BN+ReLU, channels_last, SGD)",
                                         run, n, reps, fixed=fixed)
    if "transformer" in only:
        run, n = transformer(2 if a.quick else 3)
        out["transformer"] = bench_workload("(d) 2 transformer blocks forward+backward (d=64, 4 heads, 4x32)",
                                            run, n, reps, fixed=fixed)
    if "real" in only:
        run, n, what = real_model(1 if a.quick else 2)
        out["real_model"] = bench_workload(f"(e) a real model's training step: {what}", run, n, reps, k=2, fixed=fixed)
        out["real_model"]["model"] = what
    ratios(out, a.clock)
    if a.ops:
        # each engine in a fresh process: resident memory is not muddled by the other's freed pages
        import subprocess

        out["big"] = {}
        for eng in ("native", "python"):
            for ds in (False, True):
                key = eng + (" dataset=" if ds else "")
                r = subprocess.run([sys.executable, __file__, "--big-only", eng, "--ops", str(a.ops)] +
                                   (["--dataset"] if ds else []), capture_output=True, text=True)
                print(r.stdout.strip() or r.stderr.strip()[-2000:])
                try:
                    out["big"][key] = json.loads(r.stdout.strip().splitlines()[-1])
                except Exception:
                    out["big"][key] = None
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
