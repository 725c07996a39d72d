"""Costs of the per-op probes, measured (never asserted in tests):

* the native warning capture (op_begin/op_end) inside a real TorchDispatchMode, ns/op
  (target < 500 ns);
* the non-finite screen against the op itself on 1M-element tensors (target: ratio <= 1.0).

    python benchmarks/probes.py
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def main() -> int:
    import torch

    torch.set_num_threads(1)
    from tensorscope import native
    from tensorscope.native import _build

    mod, reason = _build.ensure(_build.HOOKS)
    if mod is None:
        print(f"native hooks unavailable: {reason}")
    else:
        from native_helpers import per_op_ns
        from tensorscope.native._capture import NativeCapture

        cap = NativeCapture(mod)
        try:
            r = per_op_ns(cap, n=20000, repeats=5)
        finally:
            cap.close()
        print(f"native warning capture: {r['overhead_ns']:.0f} ns/op over a bare dispatch mode "
              f"(bare {r['bare_ns']:.0f} ns, with capture {r['capture_ns']:.0f} ns)")
    from test_numerics import _screen_cost_ratios

    ratios = _screen_cost_ratios()
    print("non-finite screen cost / op cost on 1M elements:")
    for (dt, op), v in sorted(ratios.items()):
        print(f"  {dt:9s} {op:5s} {v:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
