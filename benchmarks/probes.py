"""Costs of the per-op probes, measured (never asserted in tests):

* the native warning capture (op_begin/op_end) inside a real TorchDispatchMode, ns/op
  (target < 500 ns);
* the non-finite screen against the op itself on 1M-element tensors (target: ratio <= 1.0).

    python benchmarks/probes.py

Self-contained: benchmarks import nothing from tests/.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class _PlainMode(TorchDispatchMode):
    """A dispatch-mode skeleton without the capture calls (the baseline)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        finally:
            pass


class _CaptureMode(TorchDispatchMode):
    """The same skeleton with op_begin/op_end, as a tracer calls them."""

    def __init__(self, cap):
        super().__init__()
        self.op_begin, self.op_end = cap.op_begin, cap.op_end

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op_begin()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.op_end()


def per_op_ns(cap, n: int = 20000, repeats: int = 3, block: int = 500) -> dict[str, float]:
    """Per-op time of a small op inside a real TorchDispatchMode, without and with op_begin/op_end.

    ``n`` ops per variant per repeat, run as alternating blocks of ``block`` ops in this
    thread's CPU time (the machine is shared; wall time would mostly measure the neighbours).
    The overhead is the median of the paired block differences, robust against the noise that
    dwarfs a sub-microsecond effect when whole runs are compared.
    """
    x = torch.ones(4)
    neg = torch.neg
    plain, with_cap = _PlainMode(), _CaptureMode(cap)

    def run(mode, k) -> float:
        with mode:
            t0 = time.thread_time_ns()
            for _ in range(k):
                neg(x)
            return (time.thread_time_ns() - t0) / k

    run(plain, block), run(with_cap, block)  # warm up
    bare, capd, diffs = [], [], []
    for _ in range(max(1, repeats * n // block)):
        b = run(plain, block)
        c = run(with_cap, block)
        bare.append(b)
        capd.append(c)
        diffs.append(c - b)
    return {"bare_ns": statistics.median(bare), "capture_ns": statistics.median(capd),
            "overhead_ns": statistics.median(diffs)}


def _screen_cases(x, y, one, x2):
    """name -> (traced op, its untraced twin or None, ATen op, args, in-place?)."""
    return {
        "relu": (lambda: aten.relu.default(x), None, aten.relu.default, (x,), None),
        "add": (lambda: aten.add.Tensor(x, y), None, aten.add.Tensor, (x, y), None),
        "mul_": (lambda: aten.mul_.Tensor(x, one), lambda: aten.mul_.Tensor(x2, one), aten.mul_.Tensor,
                 (x, one), True),
    }


def screen_cost_ratios(n: int = 1 << 20) -> dict[tuple[str, str], float]:
    """(probe cost) / (op cost) per dtype and op on ``n`` elements, pre/op/post as the dispatch mode runs them."""
    from tensorscope.recording.engines.python.numerics import NonfiniteScreen

    torch.manual_seed(0)
    results = {}
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(n).to(dt)
        y = torch.randn(n).to(dt)
        one = torch.ones(n, dtype=dt)         # repeated in-place multiplies must stay finite
        x2 = x.clone()                        # untraced in-place runs write here, unseen by the screen
        s = NonfiniteScreen()
        for name, (op, plain, func, args, inplace) in _screen_cases(x, y, one, x2).items():
            plain = plain or op
            s.post(0, func, args, {}, (op(),), None)     # warm up; fills the memo for the in-place case

            def traced(s=s, func=func, args=args, inplace=inplace, op=op):
                st = s.pre(func, args, {}, True) if inplace else None
                o = op()
                s.post(0, func, args, {}, (o,), st)

            t_op = t_traced = float("inf")
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(5):
                    plain()
                t1 = time.perf_counter()
                for _ in range(5):
                    traced()
                t2 = time.perf_counter()
                t_op, t_traced = min(t_op, t1 - t0), min(t_traced, t2 - t1)
            results[(str(dt).replace("torch.", ""), name)] = round(max(t_traced - t_op, 0.0) / t_op, 3)
        if s.n_fired or s.n_pre_screened:
            print(f"  note: {dt} left the cheap path (fired {s.n_fired}, pre-screened {s.n_pre_screened})")
    return results


def main() -> int:
    torch.set_num_threads(1)
    from tensorscope.native import _build

    mod, reason = _build.ensure(_build.HOOKS)
    if mod is None:
        print(f"native hooks unavailable: {reason}")
    else:
        from tensorscope.native._capture import NativeCapture

        cap = NativeCapture(mod)
        try:
            r = per_op_ns(cap, n=20000, repeats=5)
        finally:
            cap.close()
        print(f"native warning capture: {r['overhead_ns']:.0f} ns/op over a bare dispatch mode "
              f"(bare {r['bare_ns']:.0f} ns, with capture {r['capture_ns']:.0f} ns)")
    ratios = screen_cost_ratios()
    print("non-finite screen cost / op cost on 1M elements:")
    for (dt, op), v in sorted(ratios.items()):
        print(f"  {dt:9s} {op:5s} {v:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
